"""explain on triton 3.2 (triton-ascend): its specialization data keys constexprs by name and attrs by index; the
same differences come out as on 3.4+ (tests/test_explain.py)."""
from __future__ import annotations

import pytest
import torch

from prewarm.building import tritoncompat
from prewarm.node.explain import explain
from prewarm.building.backends.npu import activate_offline
from prewarm.planning.plan import Compile

from conftest import ARCH


def requests(*calls) -> list[str]:
    import ascend_toy_kernels as k

    activate_offline(ARCH)
    with tritoncompat.compile_requests(skip=True) as captured:
        for name, args, kwargs in calls:
            getattr(k, name).warmup(*args, grid=(1,), **kwargs)
    assert len(captured) == len(calls)
    return captured


@pytest.fixture(scope="module")
def planned() -> list[Compile]:
    f32 = torch.float32
    data = requests(("add_kernel", (f32, f32, f32, 100, 4096), {"BS": 64}),
                    ("cumsum_kernel", (torch.float32, f32, 100), {"H": 6, "K": 128, "BT": 64}))
    refs = ["ascend_toy_kernels:add_kernel", "ascend_toy_kernels:cumsum_kernel"]
    return [Compile(f"r{i}", ref, f"planned #{i}", d) for i, (ref, d) in enumerate(zip(refs, data))]


def diffs(e):
    return [(d.kind, d.name, d.planned, d.runtime) for d in e.differences]


def test_dtype_and_constexpr_differences_on_triton_32(planned):
    (runtime,) = requests(("cumsum_kernel", (torch.bfloat16, torch.float32, 100), {"H": 6, "K": 128, "BT": 32}))
    assert '"constants"' in runtime  # really the 3.2 layout
    e = explain(runtime, planned, kernel="ascend_toy_kernels:cumsum_kernel")
    assert e.nearest is planned[1]
    assert diffs(e) == [("dtype", "g", "*fp32", "*bf16"), ("constexpr", "BT", "= 64", "= 32")]


@pytest.mark.parametrize("n, runtime_class", [(1, "== 1 (compiled in)"), (4095, "i32 not 1, not divisible by 16")])
def test_specialization_classes_on_triton_32(planned, n, runtime_class):
    f32 = torch.float32
    (runtime,) = requests(("add_kernel", (f32, f32, f32, 100, n), {"BS": 64}))
    e = explain(runtime, planned, kernel="ascend_toy_kernels:add_kernel")
    assert e.nearest is planned[0]
    assert diffs(e) == [("specialization", "n", "i32 divisible by 16", runtime_class)]
    same = requests(("add_kernel", (f32, f32, f32, 7, 4096), {"BS": 64}))[0]  # T is do_not_specialize
    assert explain(same, planned).planned
