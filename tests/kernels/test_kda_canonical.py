"""The wrappers' canonical form keeps results exact: a bf16 beta is its fp32 copy, a view is its contiguous copy,
an unaligned tensor its aligned copy, int64 indices their int32 copy; what cannot be canonicalized is refused with a
message naming the argument (interpreter, fp32 activations)."""
from __future__ import annotations

import pytest
import torch

H, K, V = 2, 16, 16
LENS = [1, 63, 65]


def _cu(lens, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=dtype)


def _inputs(pk, T, seed=0):
    q, k, v, _, beta, pool = pk.make_inputs(1, T, H, K, V, seed=seed, pool=6)
    gen = torch.Generator().manual_seed(seed + 1)
    raw = torch.randn(1, T, H, K, generator=gen)
    return q, k, v, raw, beta, pool, torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)


def _fused_views(*tensors):
    """The same values as views split out of one fused [..., sum of widths] projection (not contiguous)."""
    flat = [t.reshape(*t.shape[:2], -1) for t in tensors]
    proj = torch.cat(flat, dim=-1)
    return [p.view(t.shape) for p, t in zip(proj.split([f.shape[-1] for f in flat], dim=-1), tensors)]


def _unaligned(t):
    """The same values, contiguous, at a 4-byte offset (data_ptr % 16 != 0)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16
    return out


def _prefill(pk, q, k, v, raw, beta, pool, A_log, dt_bias, idx, cu):
    with pk.backend.use("npu"):
        return pk.chunk.chunk_kda_fwd(q, k, v, raw, beta, initial_state=pool, initial_state_indices=idx,
                                      output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True, A_log=A_log,
                                      dt_bias=dt_bias, lower_bound=-5.0)


def test_prefill_bf16_params_views_unaligned_int64_equal_their_canonical_copies(pk):
    q, k, v, raw, beta, pool, A_log, dt_bias = _inputs(pk, sum(LENS))
    beta, A_log, dt_bias = beta.bfloat16(), A_log.bfloat16(), dt_bias.bfloat16()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    o, final = _prefill(pk, q, k, v, raw, beta.float(), pool, A_log.float(), dt_bias.float(), idx, _cu(LENS))
    qv, kv, vv, rv = _fused_views(q, k, v, raw)
    assert not qv.is_contiguous()
    beta_view = torch.stack([beta, beta], -1)[..., 1]  # a strided bf16 view
    o2, final2 = _prefill(pk, qv, kv, vv, rv, beta_view, pool, A_log, dt_bias, idx.long(), _cu(LENS, torch.int64))
    assert torch.equal(o, o2) and torch.equal(final, final2)
    o3, final3 = _prefill(pk, _unaligned(q), _unaligned(k), _unaligned(v), _unaligned(raw), beta, pool, A_log,
                          dt_bias, idx, _cu(LENS))
    assert torch.equal(o, o3) and torch.equal(final, final3)


def test_prefill_without_pool_or_indices_equals_the_indexed_form(pk):
    """No initial state = zero states; a pool of exactly N states = indices 0..N-1; a negative index = a zero state;
    the final state is the same whether or not the caller keeps it (the kernel has one form for all of them)."""
    q, k, v, raw, beta, pool, A_log, dt_bias = _inputs(pk, sum(LENS), seed=3)
    N = len(LENS)
    zeros = torch.zeros(N, H, K, V)
    o, final = _prefill(pk, q, k, v, raw, beta, zeros, A_log, dt_bias, torch.arange(N, dtype=torch.int32), _cu(LENS))
    with pk.backend.use("npu"):
        o_none, final_none = pk.chunk.chunk_kda_fwd(q, k, v, raw, beta, output_final_state=True, cu_seqlens=_cu(LENS),
                                                    use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
        o_exact, _ = pk.chunk.chunk_kda_fwd(q, k, v, raw, beta, initial_state=pool[:N], cu_seqlens=_cu(LENS),
                                            use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    o_idx, _ = _prefill(pk, q, k, v, raw, beta, pool, A_log, dt_bias, torch.arange(N, dtype=torch.int32), _cu(LENS))
    assert torch.equal(o, o_none) and torch.equal(final, final_none)
    assert torch.equal(o_exact, o_idx)
    zeroed = pool.clone()
    zeroed[4] = 0  # index -1 (a new sequence in a pooled batch) = slot 4 holding zeros
    o_neg, final_neg = _prefill(pk, q, k, v, raw, beta, pool, A_log, dt_bias, torch.tensor([2, -1, 0]), _cu(LENS))
    o_ref, final_ref = _prefill(pk, q, k, v, raw, beta, zeroed, A_log, dt_bias, torch.tensor([2, 4, 0]), _cu(LENS))
    assert torch.equal(o_neg, o_ref) and torch.equal(final_neg, final_ref)


def test_recurrent_bf16_beta_views_int64_equal_their_canonical_copies(pk):
    N, D = 3, 2
    q, k, v, raw, beta, pool, A_log, dt_bias = _inputs(pk, N * D, seed=5)
    beta = beta.bfloat16()
    idx = torch.tensor([5, 1, 3], dtype=torch.int32)
    outs = []
    for args in [(q, k, v, raw, beta.float(), idx), (*_fused_views(q, k, v, raw), beta, idx.long())]:
        outs.append(pk.recurrent.recurrent_kda(*args[:5], pool, args[5], draft_width=D, use_qk_l2norm=True,
                                               A_log=A_log.bfloat16(), dt_bias=dt_bias))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("change, message", [
    (dict(beta=torch.zeros(1, 6, H, dtype=torch.int32)),
     "beta: dtype torch.int32 not supported (expected one of ['torch.float32', 'torch.bfloat16', 'torch.float16'])"),
    (dict(q=torch.zeros(1, 6, H, K, dtype=torch.float64)), "q: dtype torch.float64 not supported"),
    (dict(v=torch.zeros(1, 6, H, V, dtype=torch.bfloat16)), "q, k, v must share one dtype"),
    (dict(state_indices=torch.zeros(6, dtype=torch.float32)),
     "state_indices: dtype torch.float32 not supported (expected one of ['torch.int32', 'torch.int64'])"),
    (dict(state_pool=torch.zeros(8, H, K, V, dtype=torch.bfloat16)), "state_pool must be an fp32 pool"),
    (dict(state_pool=torch.zeros(8, H, V, K).transpose(-1, -2)),
     "state_pool must be contiguous with a 16-byte aligned data pointer (it is read and written in place"),
    (dict(A_log=torch.zeros(H, dtype=torch.int64)), "A_log: dtype torch.int64 not supported"),
    (dict(lower_bound=-6.0), "lower_bound must be in [-5, 0), got -6.0"),
])
def test_recurrent_refuses_what_it_cannot_canonicalize(pk, change, message):
    q, k, v, raw, beta, pool, A_log, dt_bias = _inputs(pk, 6)
    kw = {**dict(q=q, k=k, v=v, g=raw, beta=beta, state_pool=pool, state_indices=torch.arange(6, dtype=torch.int32),
                 A_log=A_log, dt_bias=dt_bias), **change}
    with pytest.raises(ValueError) as e:
        pk.recurrent.recurrent_kda(**kw)
    assert message in str(e.value)


def test_prefill_refuses_a_non_fp32_or_strided_pool(pk):
    q, k, v, raw, beta, pool, A_log, dt_bias = _inputs(pk, sum(LENS))
    idx = torch.arange(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"initial_state must be an fp32 pool \[P, H=2, K=16, V=16\], got torch.bfloat16"):
        _prefill(pk, q, k, v, raw, beta, pool.bfloat16(), A_log, dt_bias, idx, _cu(LENS))
    with pytest.raises(ValueError, match="initial_state must be contiguous"):
        _prefill(pk, q, k, v, raw, beta, pool[::2], A_log, dt_bias, idx, _cu(LENS))
    with pytest.raises(ValueError, match=r"initial_state_indices: dtype torch.int16 not supported"):
        _prefill(pk, q, k, v, raw, beta, pool, A_log, dt_bias, idx.short(), _cu(LENS))
