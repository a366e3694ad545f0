"""Every chunked stage and the full forward against the plain-PyTorch reference (interpreter, fp32)."""
from __future__ import annotations

import pytest
import torch


TOL = 1e-4
VARLEN = [1, 63, 64, 65]  # one batch: a single token, a partial chunk, an exact chunk, one past it


def _cu(lens):
    return torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("varlen,H,with_h0", [(False, 1, True), (False, 3, False), (True, 1, False), (True, 3, True)])
def test_every_stage_matches_reference(pk, varlen, H, with_h0):
    K = V = 32
    if varlen:
        cu, B, T, N = _cu(VARLEN), 1, sum(VARLEN), len(VARLEN)
    else:
        cu, B, T, N = None, 2, 65, 2
    q, k, v, g, beta, pool = pk.make_inputs(B, T, H, K, V, seed=H, pool=N + 2 if with_h0 else None)
    idx = torch.arange(N, dtype=torch.int32).flip(0) + 1 if with_h0 else None
    ref = pk.reference.chunk_stages_ref(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                        cu_seqlens=cu)
    scale = K ** -0.5
    with pk.backend.use("npu"):
        G = pk.cumsum.chunk_cumsum(g, cu)
        Ai, Aqk = pk.intra.chunk_intra(q, k, G, beta, scale, cu)
        w, u, kg = pk.recompute.chunk_recompute(k, v, beta, G, Ai, cu)
        h, v_new, final = pk.state.chunk_state(kg, w, u, G, pool, idx, True, cu)
        o = pk.output.chunk_output(q, G, h, Aqk, v_new, scale, cu)
    got = {"G": G, "Aqk": Aqk, "Ainv": Ai, "w": w, "u": u, "kg": kg, "v_new": v_new, "o": o,
           "h": h.reshape(-1, H, K, V), "final_state": final}
    errs = {name: pk.max_err(val, ref[name]) for name, val in got.items()}
    assert all(e <= TOL for e in errs.values()), errs
    o_rec, final_rec = pk.reference.recurrent_ref(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                                  cu_seqlens=cu)
    assert pk.max_err(o, o_rec) <= TOL and pk.max_err(final, final_rec) <= TOL


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("config", [0, -1])
def test_autotuned_path_matches_recurrence(pk, varlen, config):
    """The default (autotuned) wrappers, pinned to their first / last config: different BK/BS/BV tilings."""
    H, K, V = 3, 32, 32
    cu, B, T, N = (_cu(VARLEN), 1, sum(VARLEN), len(VARLEN)) if varlen else (None, 2, 63, 2)
    q, k, v, g, beta, pool = pk.make_inputs(B, T, H, K, V, seed=7, pool=N)
    with pk.one_config(config):
        o, final = pk.chunk.chunk_kda_fwd(q, k, v, g, beta, initial_state=pool, output_final_state=True,
                                          cu_seqlens=cu)
    o_ref, final_ref = pk.reference.recurrent_ref(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu)
    assert pk.max_err(o, o_ref) <= TOL and pk.max_err(final, final_ref) <= TOL


def test_head_dim_128(pk):
    H, K, V = 1, 128, 128
    cu = _cu([1, 65, 64])
    q, k, v, g, beta, pool = pk.make_inputs(1, 130, H, K, V, seed=3, pool=5)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    with pk.backend.use("npu"):
        o, final = pk.chunk.chunk_kda_fwd(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                          output_final_state=True, cu_seqlens=cu)
    o_ref, final_ref = pk.reference.recurrent_ref(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                                  cu_seqlens=cu)
    assert pk.max_err(o, o_ref) <= TOL and pk.max_err(final, final_ref) <= TOL


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("path", ["npu", "autotuned"])
def test_fused_gate_and_l2norm(pk, lower_bound, path):
    """Raw gate + A_log + dt_bias activated in the cumsum kernel, q/k L2-normalised in-kernel; on the NPU's pinned
    configs (the token kernel gathers each row) and on CUDA's first autotune config (it stores each value)."""
    H, K, V = 3, 32, 32
    cu = _cu([65, 1, 63])
    q, k, v, _, beta, _ = pk.make_inputs(1, 129, H, K, V, seed=11)
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(1, 129, H, K, generator=gen) * 2
    raw[0, 0, 0, :4] = 30.0  # softplus linear branch
    A_log = torch.randn(H, generator=gen) * 0.5 - 1.0
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    k = k * 3  # not normalised: the kernel must do it
    with pk.backend.use("npu") if path == "npu" else pk.one_config(0):
        o, final = pk.chunk.chunk_kda_fwd(q, k, v, raw, beta, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
        G = pk.cumsum.chunk_cumsum(raw, cu, A_log, dt_bias, lower_bound)
    g = pk.reference.gate_ref(raw, A_log, dt_bias, lower_bound)
    ref = pk.reference.chunk_stages_ref(q, k, v, g, beta, cu_seqlens=cu)
    assert pk.max_err(G, ref["G"]) <= TOL
    o_ref, final_ref = pk.reference.recurrent_ref(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True)
    assert pk.max_err(o, o_ref) <= TOL and pk.max_err(final, final_ref) <= TOL


def test_bad_inputs_name_what_is_wrong(pk):
    q, k, v, g, beta, _ = pk.make_inputs(1, 10, 2, 16, 16)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        pk.chunk.chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="beta: expected shape"):
        pk.chunk.chunk_kda_fwd(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state has 3 states for 1 sequences"):
        pk.chunk.chunk_kda_fwd(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 16, 16))
    with pytest.raises(ValueError, match="B == 1"):
        pk.chunk.chunk_kda_fwd(*(torch.cat([x, x]) for x in (q, k, v, g, beta)),
                               cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="lower_bound must be in"):
        pk.chunk.chunk_kda_fwd(q, k, v, g, beta, A_log=torch.zeros(2), dt_bias=torch.zeros(32), lower_bound=-7.0)


def test_the_chunk_index_covers_every_token_once_and_skips_empty_sequences():
    """A server's packed batch can hold an empty sequence (a finished request's slot); each chunk is (sequence, chunk
    within it), every sequence's chunks are contiguous from its offset, and the tokens they cover are all tokens."""
    from prewarm_kernels.index import prepare_chunk_index

    lens = [0, 1, 64, 0, 65, 128]
    idx = prepare_chunk_index(_cu(lens), 64, sum(lens))
    assert idx.indices.dtype == idx.offsets.dtype == torch.int32 and idx.indices.shape == (idx.num_chunks, 2)
    assert idx.offsets.tolist() == [0, 0, 1, 2, 2, 4, 6]
    assert idx.indices.tolist() == [[1, 0], [2, 0], [4, 0], [4, 1], [5, 0], [5, 1]]
    assert sum(min(64, lens[s] - 64 * c) for s, c in idx.indices.tolist()) == sum(lens)
    # the state kernel's launch order: every sequence once, by chunk count, most first, ties in batch order
    assert idx.longest_first.dtype == torch.int32 and idx.longest_first.tolist() == [4, 5, 1, 2, 0, 3]
    assert idx.cu_seqlens.dtype == torch.int32 and idx.cu_seqlens.tolist() == [0, 0, 1, 65, 65, 130, 258]
    # all of it one tensor (one host-to-device copy), each field 16-byte aligned in it: a kernel's pointer
    # specialization is then that of a tensor of its own
    for field in (idx.cu_seqlens, idx.indices, idx.offsets, idx.longest_first):
        assert field.untyped_storage().data_ptr() == idx.packed.untyped_storage().data_ptr()
        assert (field.data_ptr() - idx.packed.data_ptr()) % 16 == 0
    moved = idx.to(torch.device("cpu"))
    assert moved.indices.tolist() == idx.indices.tolist() and moved.longest_first.tolist() == [4, 5, 1, 2, 0, 3]
    assert prepare_chunk_index(_cu([0, 0]), 64, 0).indices.shape == (0, 2)
