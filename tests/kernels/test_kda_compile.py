"""Every launch of the serving mix compiles for the H200 (sm_90): real Triton compiles on this GPU-less box.

The interpreter runs kernels but never compiles them, and some errors (constexpr rules, dot shapes, layouts) only
show up in the compiler. With a driver that only names the target, ``JITFunction.warmup`` compiles through the
real JIT path (see docs/triton-cache-facts.md). The pinned configs (one per kernel) keep this to 12 compiles.
"""
from __future__ import annotations

import pytest
import torch
from triton.runtime import driver

from prewarm.devices import OfflineDriver

SPEC = {"backend": "npu", "arch": "sm_90",  # a manifest's [spec] as the provider receives it (6 heads per rank)
        "model": {"kda_heads": 6, "head_k_dim": 128, "head_v_dim": 128, "gate_lower_bound": -5.0, "layers": 69},
        "serving": {"decode_batch_buckets": [1, 16], "draft_widths": [4]}}


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
    assert len(launches) == 12  # 8 prefill (l2norm twice), decode and verify (draft 4) with a bf16 and an fp32 beta
    for rec in launches:
        kernel = rec.kernel.warmup(*rec.args, grid=rec.grid, **rec.kwargs)
        assert kernel.metadata.target.arch == 90, rec.label
        assert kernel.metadata.num_warps == rec.kwargs["num_warps"], rec.label


# --- closure of the public API over incidental caller choices -----------------------------------------------------
# Every variant below is something a server may pass (other float dtypes for beta / A_log / dt_bias, int64 indices,
# views out of a fused projection, an unaligned offset, other sequence counts and lengths, a fixed-length batch,
# no initial state, no final state): each must make exactly the compile requests of the plain call. A declared
# choice (the gate dtype) must not: that is what the manifest plans.

H, K, V = 2, 32, 32


def _requests(call) -> set[str]:
    """The specialization data of every compile request ``call()`` makes (every autotune config; none compiled)."""
    from prewarm.building import tritoncompat
    from prewarm_kernels.launch import capture

    with capture() as launches:
        call()
    with tritoncompat.compile_requests(skip=True) as seen:
        for rec in launches:
            tritoncompat.warmup(rec.kernel, rec.args, rec.kwargs, rec.grid)
    return set(seen)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _fused(T: int, parts: int, width: int, dtype=torch.bfloat16):
    """``parts`` views [1, T, H, width] split out of one [1, T, parts * H * width] projection (not contiguous)."""
    proj = _meta(1, T, parts * H * width, dtype=dtype)
    return [p.view(1, T, H, width) for p in proj.split(H * width, dim=-1)]


def _unaligned(*shape, dtype=torch.bfloat16):
    """A contiguous tensor at a 2-byte offset (data_ptr % 16 != 0)."""
    n = 1
    for s in shape:
        n *= s
    return _meta(n + 1, dtype=dtype)[1:].view(*shape)


def _prefill(lens=(1, 63, 64, 65, 200), beta_dtype=torch.float32, param_dtype=torch.float32, idx_dtype=torch.int32,
             layout="contiguous", gate_dtype=torch.bfloat16, fixed=False, state="indexed", final=True):
    from prewarm_kernels.kda import chunk_kda_fwd

    B, T = (len(lens), lens[0]) if fixed else (1, sum(lens))
    if layout == "fused":
        q, k, v = (x.view(B, T, H, -1) for x in _fused(B * T, 3, K))
        beta = _meta(B, T, 2 * H, dtype=beta_dtype)[..., H:]
    else:
        make = _unaligned if layout == "unaligned" else _meta
        q, k, v = make(B, T, H, K), make(B, T, H, K), make(B, T, H, V)
        beta = make(B, T, H, dtype=beta_dtype)
    N = len(lens)
    kw = {}
    if state == "indexed":
        kw = dict(initial_state=_meta(N + 7, H, K, V, dtype=torch.float32),
                  initial_state_indices=_meta(N, dtype=idx_dtype))
    elif state == "exact":
        kw = dict(initial_state=_meta(N, H, K, V, dtype=torch.float32))
    cu = None if fixed else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=idx_dtype)
    return lambda: chunk_kda_fwd(q, k, v, _meta(B, T, H, K, dtype=gate_dtype), beta, cu_seqlens=cu,
                                 output_final_state=final, use_qk_l2norm=True, A_log=_meta(H, dtype=param_dtype),
                                 dt_bias=_meta(H * K, dtype=param_dtype), lower_bound=-5.0, **kw)


def _decode(n=16, draft=1, beta_dtype=torch.float32, idx_dtype=torch.int32, layout="contiguous",
            gate_dtype=torch.bfloat16):
    from prewarm_kernels.kda import recurrent_kda

    T = n * draft
    if layout == "fused":
        q, k, v, g = _fused(T, 4, K)
    else:
        q, k, v, g = _meta(1, T, H, K), _meta(1, T, H, K), _meta(1, T, H, V), _meta(1, T, H, K, dtype=gate_dtype)
    return lambda: recurrent_kda(q, k, v, g, _meta(1, T, H, dtype=beta_dtype), _meta(200, H, K, V, dtype=torch.float32),
                                 _meta(n, dtype=idx_dtype), draft_width=draft, use_qk_l2norm=True,
                                 A_log=_meta(H, dtype=torch.float32), dt_bias=_meta(H * K, dtype=torch.float32))


@pytest.mark.parametrize("variant", [
    dict(beta_dtype=torch.bfloat16), dict(beta_dtype=torch.float16), dict(param_dtype=torch.bfloat16),
    dict(idx_dtype=torch.int64), dict(layout="fused"), dict(layout="unaligned"), dict(lens=(1,)),
    dict(lens=(16,) * 17), dict(lens=(4096, 3)), dict(fixed=True, lens=(100, 100, 100)), dict(state="none"),
    dict(state="exact"), dict(final=False),
], ids=lambda v: ",".join(f"{k}={getattr(x, '__name__', str(x)).replace('torch.', '')}" for k, x in v.items()))
def test_prefill_compiles_do_not_depend_on_incidental_choices(sm90, variant):
    base = _requests(_prefill())
    assert len(base) == 4 + 18 + 9 + 6 + 4 + 8 + 6  # one per autotune config of the 7 prefill kernels
    assert _requests(_prefill(**variant)) == base


@pytest.mark.parametrize("variant", [
    dict(n=1), dict(n=17), dict(n=64), dict(n=1000), dict(beta_dtype=torch.float16), dict(idx_dtype=torch.int64),
    dict(layout="fused"),
], ids=lambda v: ",".join(f"{k}={str(x).replace('torch.', '')}" for k, x in v.items()))
@pytest.mark.parametrize("draft", [1, 4])
def test_recurrent_compiles_do_not_depend_on_batch_size_or_incidental_choices(sm90, variant, draft):
    base = _requests(_decode(draft=draft))
    assert len(base) == 1
    assert _requests(_decode(draft=draft, **variant)) == base


@pytest.mark.parametrize("draft", [1, 4])
def test_recurrent_reads_a_beta_in_the_activation_dtype_as_given(sm90, draft):
    """A bf16 beta beside bf16 activations is read without a cast (decode is launch-bound): one other variant than
    an fp32 beta, which the serving plan holds too (it plans both)."""
    base = _requests(_decode(draft=draft))
    own = _requests(_decode(draft=draft, beta_dtype=torch.bfloat16))
    assert len(own) == 1 and own != base



def test_declared_choices_are_variants(sm90):
    """What the manifest declares does make other requests (so the tests above can fail): the gate dtype, the
    draft width."""
    assert _requests(_prefill(gate_dtype=torch.float32)) != _requests(_prefill())
    assert _requests(_decode(gate_dtype=torch.float32)) != _requests(_decode())
    assert _requests(_decode(draft=2)) != _requests(_decode(draft=4))
