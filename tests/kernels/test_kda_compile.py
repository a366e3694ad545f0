"""Every launch of the serving mix compiles for the H200 (sm_90): real Triton compiles on this GPU-less box.

The interpreter runs kernels but never compiles them, and some errors (constexpr rules, dot shapes, layouts) only
show up in the compiler. With a driver that only names the target, ``JITFunction.warmup`` compiles through the
real JIT path (see docs/triton-cache-facts.md). The pinned configs (one per kernel) keep this to ~13 compiles.
"""
from __future__ import annotations

import pytest
from triton.runtime import driver

from prewarm.targets import OfflineDriver

SPEC = {"backend": "npu", "arch": "sm_90", "heads": 6, "head_k_dim": 128, "head_v_dim": 128, "dtype": "bfloat16",
        "gate_lower_bound": -5.0, "prefill": True, "decode_batch_buckets": [1, 16], "draft_widths": [4],
        "layers": 69}


@pytest.fixture
def sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    saved = driver._active  # reset_active() would probe for a GPU; put back exactly what was there
    driver.set_active(OfflineDriver("cuda", 90, 32))
    try:
        yield
    finally:
        driver._active = saved


def test_serving_launches_compile_for_sm90(sm90):
    from prewarm_kernels.kda import serving

    launches = serving.launches(SPEC)
    assert len(launches) == 11  # 9 prefill (l2norm twice), 1 decode, 1 verify (draft 4)
    for rec in launches:
        kernel = rec.kernel.warmup(*rec.args, grid=rec.grid, **rec.kwargs)
        assert kernel.metadata.target.arch == 90, rec.label
        assert kernel.metadata.num_warps == rec.kwargs["num_warps"], rec.label
