"""triton-ascend 3.2: a launch whose tensor argument sits at a pointer that is not 16-byte aligned is planned with
that specialization (the plan's ``"aligned": false`` encoding, decoded to a ``meta`` view one element in), and its
compile's cache key is the real launch's. The launch is sgl-kernel-npu's KV page allocator as
``NPUPagedTokenToKVPoolAllocator.alloc_extend`` makes it after an odd count of pages was handed out
(``self.free_pages = self.free_pages[num_new_pages:]``), on real CPU tensors bound by triton-ascend's own JIT; the
same check under upstream Triton 3.6 / 3.8 is tests/test_plan_alignment.py."""
from __future__ import annotations

import pytest
from conftest import ARCH

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.building.probe import planned_keys
from prewarm.planning.plan import Compile, Request, _encode, expand, resolve

KERNEL = "sgl_kernel_npu.mem_cache.allocator:alloc_extend_kernel"


@pytest.fixture(scope="module")
def target():
    from prewarm import devices

    get_target("npu", ARCH, "offline", "A3").activate()
    try:
        yield
    finally:
        devices.deactivate()


@pytest.mark.parametrize("handed_out", [0, 1, 2, 3])
def test_the_allocators_free_page_view_plans_the_real_launchs_key(target, handed_out):
    import torch

    bs, page, tokens = 4, 128, 256
    lengths = lambda: torch.zeros(bs, dtype=torch.int32)  # noqa: E731  (a DSPARK decode reservation's)
    free_pages = torch.arange(1, 1025, dtype=torch.int64)[handed_out:]
    args = (lengths(), lengths(), lengths(), free_pages, torch.empty(tokens, dtype=torch.int64), bs, page, tokens)
    with tritoncompat.compile_requests(skip=True) as real:
        tritoncompat.warmup(resolve(KERNEL), args, {}, grid=(bs,))
    request = Request(KERNEL, "alloc_extend", "test", tuple(_encode(a, "test") for a in args))
    (planned,) = expand(request)
    misaligned = free_pages.data_ptr() % 16 != 0
    assert misaligned == (handed_out % 2 == 1) and ("aligned" in request.args[3]) == misaligned
    assert (("tt.divisibility", 16) in planned.parsed.args["free_page_ptr"].attrs) != misaligned
    assert tritoncompat.on_disk(planned.specialization) == tritoncompat.on_disk(real[0])
    keys = planned_keys([planned])
    assert keys and set(keys) == set(planned_keys([Compile(request.ident, KERNEL, "real launch", real[0])]))
