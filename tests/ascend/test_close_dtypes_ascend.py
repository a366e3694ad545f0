"""Closing recorded traffic over dtypes on triton-ascend 3.2's specialization data (its own layout): the added
request is exactly the one triton-ascend makes for a call with that pointer in the other dtype."""
from __future__ import annotations

import json

import torch

from prewarm.building import tritoncompat
from prewarm.building.backends import npu
from prewarm.planning.plan import other_dtypes, other_int_classes


def test_a_closed_request_is_what_triton_ascend_makes_for_the_other_dtype():
    import ascend_toy_kernels as k
    from conftest import ARCH

    npu.activate_offline(ARCH)
    f32, bf16 = torch.float32, torch.bfloat16
    with tritoncompat.compile_requests(skip=True) as made:
        k.add_kernel.warmup(f32, f32, f32, 100, 4096, BS=64, grid=(1,))
        k.add_kernel.warmup(f32, bf16, f32, 100, 4096, BS=64, grid=(1,))
    (what, closed), = other_dtypes(tritoncompat.parse_specialization(made[0]), (("y", ("bfloat16", "float32")),))

    def without_key(data: str) -> dict:  # the in-memory key is not part of the on-disk key
        return {f: v for f, v in json.loads(data).items() if f != "key"}

    assert what == "y=*bf16" and without_key(closed.data) == without_key(made[1])


def test_int_classes_are_left_as_recorded_on_triton_ascend_3_2():
    """3.2 keeps an int equal to 1 among the constexprs by name: closing leaves its ints as recorded (no variant, no
    error), while the dtype closing above still applies."""
    import ascend_toy_kernels as k
    from conftest import ARCH

    npu.activate_offline(ARCH)
    with tritoncompat.compile_requests(skip=True) as made:
        k.add_kernel.warmup(torch.float32, torch.float32, torch.float32, 100, 4096, BS=64, grid=(1,))
    spec = tritoncompat.parse_specialization(made[0])
    assert spec.int_classes == {} and other_int_classes(k.add_kernel, spec, ("T", "n")) == []
