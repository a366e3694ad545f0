"""The key a recording stores (tritoncompat.cache_key_parts, computed in the recorded process) on triton-ascend
3.2.0: the key dir its compile() keys the request under (the front end lower.py drives), with the SoC in the backend
part; a request recorded for one SoC names the SoC when keyed for another."""
from __future__ import annotations

import torch
from conftest import ARCH

from prewarm.building import tritoncompat
from prewarm.building.backends import npu
from prewarm.building.keys import compare


def test_the_recorded_key_is_compiles_key_dir_and_names_the_soc():
    import ascend_toy_kernels as k
    from triton.backends.compiler import GPUTarget

    npu.activate_offline(ARCH)
    with tritoncompat.compile_requests(skip=True) as made:
        k.add_kernel.warmup(torch.float32, torch.float32, torch.float32, 100, 4096, BS=64, grid=(1,))
    key, parts = tritoncompat.cache_key_parts(k.add_kernel, made[0])
    with tritoncompat.ascend_front_end(tritoncompat.jit_function(k.add_kernel), made[0],
                                       GPUTarget("npu", ARCH, 0)) as front:
        assert key == front.key_dir
    other, other_parts = tritoncompat.cache_key_parts(k.add_kernel, made[0], GPUTarget("npu", "Ascend910_9392", 0))
    assert other != key
    assert [d.format(("recorded", "here")) for d in compare("ascend_toy_kernels:add_kernel", parts, other_parts)] == [
        f"backend backend.hash() (CUDA: ptxas --version and the arch; Ascend: the SoC): recorded GPUTarget(backend="
        f"'npu', arch='{ARCH}', warp_size=0), here GPUTarget(backend='npu', arch='Ascend910_9392', warp_size=0)"]
