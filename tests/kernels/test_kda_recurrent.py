"""The token-recurrent kernel for decode (1 token per sequence) and verify (draft width 4) against the reference."""
from __future__ import annotations

import pytest
import torch


TOL = 1e-4


@pytest.mark.parametrize("H", [1, 3])
def test_decode_advances_pool_in_place(pk, H):
    K = V = 32
    N, P = 5, 8
    q, k, v, g, beta, pool = pk.make_inputs(1, N, H, K, V, seed=H, pool=P)
    idx = torch.tensor([6, 0, 3, -1, 2], dtype=torch.int32)  # -1: a padding slot (CUDA-graph batch), skipped
    before = pool.clone()
    with pk.backend.use("default"):
        o, inter = pk.recurrent.recurrent_kda(q, k, v, g, beta, pool, idx)
    assert inter is None
    live = [0, 1, 2, 4]
    cu = torch.arange(N + 1, dtype=torch.int32)
    o_ref, final_ref = pk.reference.recurrent_ref(q, k, v, g, beta, initial_state=before,
                                                  initial_state_indices=idx.clamp_min(0), cu_seqlens=cu)
    assert pk.max_err(o[0, live], o_ref[0, live]) <= TOL
    assert pk.max_err(pool[idx[live].long()], final_ref[live]) <= TOL
    untouched = [i for i in range(P) if i not in idx[live].tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("H", [1, 3])
def test_verify_draft_4_keeps_pool_and_returns_every_step(pk, H):
    K = V = 32
    N, D = 3, 4
    q, k, v, g, beta, pool = pk.make_inputs(1, N * D, H, K, V, seed=10 + H, pool=4)
    idx = torch.tensor([1, 3, 0], dtype=torch.int32)
    before = pool.clone()
    with pk.backend.use("npu"):
        o, inter = pk.recurrent.recurrent_kda(q, k, v, g, beta, pool, idx, draft_width=D)
    assert torch.equal(pool, before)
    cu = torch.arange(0, N * D + 1, D, dtype=torch.int32)
    o_ref, _ = pk.reference.recurrent_ref(q, k, v, g, beta, initial_state=before, initial_state_indices=idx,
                                          cu_seqlens=cu)
    assert pk.max_err(o, o_ref) <= TOL
    for d in range(D):  # the state after accepting d + 1 draft tokens
        cu_d = torch.tensor([0, d + 1], dtype=torch.int32)
        for n in range(N):
            sl = slice(n * D, n * D + d + 1)
            _, s_ref = pk.reference.recurrent_ref(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                  initial_state=before[idx[n].long()][None], cu_seqlens=cu_d)
            assert pk.max_err(inter[n, d], s_ref[0]) <= TOL


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fused_gate_and_l2norm(pk, lower_bound):
    H, K, V, N = 3, 32, 32, 4
    q, k, v, _, beta, pool = pk.make_inputs(1, N, H, K, V, seed=3, pool=N)
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(1, N, H, K, generator=gen) * 2
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)
    idx = torch.arange(N, dtype=torch.int32)
    before = pool.clone()
    o, _ = pk.recurrent.recurrent_kda(q, k * 2, v, raw, beta, pool, idx, use_qk_l2norm=True, A_log=A_log,
                                      dt_bias=dt_bias, lower_bound=lower_bound)
    g = pk.reference.gate_ref(raw, A_log, dt_bias, lower_bound)
    o_ref, final_ref = pk.reference.recurrent_ref(q, k * 2, v, g, beta, initial_state=before,
                                                  cu_seqlens=torch.arange(N + 1), use_qk_l2norm=True)
    assert pk.max_err(o, o_ref) <= TOL and pk.max_err(pool, final_ref) <= TOL


def test_batch_size_is_never_a_variant_only_the_draft_width(pk):
    """Any number of sequences runs one compiled variant per draft width: N is a runtime int that Triton does not
    specialize (not a constexpr, in do_not_specialize), while the grid still follows the token bucket."""
    H, K, V = 2, 16, 16
    pool = torch.zeros(8, H, K, V, device="meta")
    seen = []
    for n, d in [(1, 1), (3, 1), (16, 1), (17, 1), (3, 4), (5, 4)]:
        q = torch.empty(1, n * d, H, K, device="meta")
        with pk.launch.capture() as recs:
            pk.recurrent.recurrent_kda(q, q, q, q, torch.empty(1, n * d, H, device="meta"), pool,
                                       torch.empty(n, dtype=torch.int32, device="meta"), draft_width=d)
        (rec,) = recs
        seen.append((rec.kwargs["DRAFT"], rec.args[-1], rec.grid))
        assert rec.args[-1] == n and sorted(rec.kwargs) == ["BK", "BV", "DRAFT", "GATE", "H", "K", "USE_QK_L2NORM",
                                                             "V", "num_stages", "num_warps"]
    assert [s[0] for s in seen] == [1, 1, 1, 1, 4, 4]
    assert [s[2] for s in seen] == [(1, 2), (1, 8), (1, 32), (1, 64), (1, 8), (1, 16)]


def test_bad_inputs(pk):
    q, k, v, g, beta, pool = pk.make_inputs(1, 6, 2, 16, 16, pool=4)
    with pytest.raises(ValueError, match="6 tokens but 4 sequences x draft_width 1"):
        pk.recurrent.recurrent_kda(q, k, v, g, beta, pool, torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"state_pool must be an fp32 pool \[P, H=2, K=16, V=16\], got torch.float16"):
        pk.recurrent.recurrent_kda(q, k, v, g, beta, pool.half(), torch.arange(6, dtype=torch.int32))


def test_beta_is_read_as_given_in_the_activation_dtype_or_fp32(pk):
    """Decode is launch-bound, so a bf16 beta beside bf16 activations, or an fp32 one, reaches the kernel as given
    (no cast launch) and gives exactly what the same values in fp32 give; any other float dtype is cast to fp32."""
    H, K, V, N = 2, 16, 16, 3
    q, k, v, g, beta, pool = pk.make_inputs(1, N, H, K, V, seed=5, pool=N)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    idx = torch.arange(N, dtype=torch.int32)
    read = {}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        b = beta.to(dtype)
        with pk.launch.capture() as recs:
            pk.recurrent.recurrent_kda(q, k, v, g, b, pool, idx)
        (rec,) = recs
        read[dtype] = rec.args[4].dtype
        assert (rec.args[4] is b) == (dtype != torch.float16)
    assert read == {torch.bfloat16: torch.bfloat16, torch.float32: torch.float32, torch.float16: torch.float32}
    as_bf16, as_fp32 = pool.clone(), pool.clone()
    o1, _ = pk.recurrent.recurrent_kda(q, k, v, g, beta.bfloat16(), as_bf16, idx)
    o2, _ = pk.recurrent.recurrent_kda(q, k, v, g, beta.bfloat16().float(), as_fp32, idx)
    assert torch.equal(o1, o2) and torch.equal(as_bf16, as_fp32) and not torch.equal(as_bf16, pool)
