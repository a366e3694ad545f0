"""A planned launch whose tensor argument sits at a pointer that is not 16-byte aligned (a view past an odd count of
elements: sglang's KV allocator's free-page list after it hands pages out, DP attention's 0-d token-count views on
DP ranks 1..3, EAGLE's retrieve rows) compiles what the real launch compiles: Triton specializes a pointer on
16-byte divisibility only, the plan encodes such an argument with ``"aligned": false`` (and only such an argument:
every other request keeps its bytes and id), and decoding gives a ``meta`` tensor Triton's own binder puts in the
same class. Checked against Triton's binder on real CPU tensor views, under whichever Triton this env runs (.venv:
3.6; .venv-vllm / .venv-sglang: 3.8; triton-ascend 3.2 has its own test, tests/ascend/test_plan_alignment_ascend.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))  # prewarm_toy

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.building.probe import planned_keys
from prewarm.planning.plan import Compile, Request, _encode, expand

KERNEL = "prewarm_toy.kernels:add_kernel"  # (x_ptr, y_ptr, out_ptr, n, BLOCK: constexpr)
# (dtype, element offset of the view): int64 / int32 / bf16 / int8 one element in, int32 3 in: not 16-byte aligned;
# int64 2 in, fp32 4 in, int8 16 in: aligned again
VIEWS = [("int64", 1), ("int32", 3), ("bfloat16", 1), ("int8", 1), ("int64", 2), ("float32", 4), ("int8", 16)]


@pytest.fixture(scope="module")
def target():
    get_target("cuda", "sm_90", "offline").activate()


def _real_and_planned(view):
    """(Triton's specialization of a real launch with ``view`` as x_ptr, the plan's compile of the same launch)."""
    import torch

    from prewarm.planning.plan import resolve

    kernel = resolve(KERNEL)
    args = (view, torch.zeros(16, dtype=view.dtype), torch.zeros(16, dtype=view.dtype), 16)
    with tritoncompat.compile_requests(skip=True) as real:
        tritoncompat.warmup(kernel, args, {"BLOCK": 16}, grid=(1,))
    request = Request(KERNEL, "add", "test", tuple(_encode(a, "test") for a in args), {"BLOCK": 16})
    (planned,) = expand(request)
    return request, Compile(request.ident, KERNEL, "real launch", real[0]), planned


@pytest.mark.parametrize("dtype,offset", VIEWS, ids=[f"{d}+{o}" for d, o in VIEWS])
def test_a_view_plans_the_real_launchs_pointer_class_and_key(target, dtype, offset):
    import torch

    view = torch.zeros(64, dtype=getattr(torch, dtype))[offset:offset + 16]
    misaligned = view.data_ptr() % 16 != 0
    request, real, planned = _real_and_planned(view)
    assert ("aligned" in request.args[0]) == misaligned and request.args[0].get("aligned", False) is False
    divisible = ("tt.divisibility", 16) in planned.parsed.args["x_ptr"].attrs
    assert divisible != misaligned  # the decoded meta tensor's class, as Triton's binder sees it
    assert tritoncompat.on_disk(planned.specialization) == tritoncompat.on_disk(real.specialization)
    assert set(planned_keys([planned])) == set(planned_keys([real]))  # the same cache key dir on the node


def test_an_aligned_tensor_keeps_its_encoding_and_the_request_its_id(target):
    """Only a misaligned argument carries the key: an aligned one encodes as before (dtype and shape), so every
    request planned before keeps its id and its bytes, and the two classes are two requests."""
    import torch

    base = torch.zeros(64, dtype=torch.int64)
    assert _encode(base[2:18], "test") == {"tensor": "int64", "shape": [16]}
    assert _encode(base[1:17], "test") == {"tensor": "int64", "shape": [16], "aligned": False}
    aligned, _, _ = _real_and_planned(base[2:18])
    misaligned, _, _ = _real_and_planned(base[1:17])
    assert aligned.ident != misaligned.ident
    assert aligned.ident == Request(KERNEL, "add", "test", ({"tensor": "int64", "shape": [16]},
                                                             *aligned.args[1:]), {"BLOCK": 16}).ident
