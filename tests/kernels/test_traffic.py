"""The independent traffic generator (prewarm_kernels.kda.traffic): deterministic per seed, inside the manifest's
envelope where it declares something, varied where it does not, and valid: its calls run for real (Triton
interpreter, fp32) and match the plain-PyTorch reference."""
from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from prewarm.planning.manifest import load
from prewarm_kernels.kda.traffic import FLOATS, INDEX_DTYPES, Envelope, calls

REPO = Path(__file__).resolve().parents[2]
H200 = Envelope.from_spec(load(REPO / "manifests" / "kimi-linear-h200.toml").spec())
ASCEND = Envelope.from_spec(load(REPO / "manifests" / "kimi-k3-ascend-a3.toml").spec())
TOL = 1e-3


def describe(call) -> list:
    """Everything a call passes, without values: tensors by dtype, shape, strides, storage offset."""
    out = [call.label, call.api]
    for name, x in sorted(call.kwargs.items()):
        if isinstance(x, torch.Tensor):
            x = (str(x.dtype), tuple(x.shape), x.stride(), x.storage_offset(), x.device.type)
        out.append((name, x))
    return out


def test_envelope_is_what_the_manifest_declares():
    assert (H200.heads, H200.head_k_dim, H200.head_v_dim) == (32, 128, 128)
    assert H200.activation == (torch.bfloat16,) and H200.gate == (torch.bfloat16, torch.float32)
    assert H200.decode_batch_buckets == (1, 2, 4, 8, 16, 32, 64) and H200.draft_widths == (2, 4)
    assert (H200.gate_lower_bound, H200.backend, H200.fused_gate, H200.qk_l2norm) == (None, "cuda", True, True)
    assert (ASCEND.heads, ASCEND.gate_lower_bound, ASCEND.backend) == (6, -5.0, "npu")  # 96 heads / attention-TP 16


def test_prefill_batches_stay_within_a_declared_token_budget():
    """A server's chunked prefill never hands the kernels more than its budget (the manifest's max_prefill_tokens,
    which also bounds the token buckets the plan tunes): neither does the traffic; without a budget it goes past it."""
    def longest(env):
        return max(c.kwargs["q"].shape[0] * c.kwargs["q"].shape[1] for c in calls(env, 0, 400, "meta")
                   if c.api == "chunk_kda_fwd")

    assert longest(dataclasses.replace(H200, max_prefill_tokens=2000)) <= 2000 < longest(H200)


def test_same_seed_same_calls_other_seed_other_calls():
    first = [describe(c) for c in calls(H200, 7, 300, "meta")]
    assert len(first) == 300
    assert first == [describe(c) for c in calls(H200, 7, 300, "meta")]
    assert first != [describe(c) for c in calls(H200, 8, 300, "meta")]


def test_same_seed_same_values():
    env = dataclasses.replace(H200, heads=2, head_k_dim=16, head_v_dim=16, max_seq_len=40, long_seq_len=70)
    a, b = list(calls(env, 3, 12, "cpu")), list(calls(env, 3, 12, "cpu"))
    for x, y in zip(a, b):
        assert x.label == y.label
        for name, t in x.kwargs.items():
            assert torch.equal(t, y.kwargs[name]) if isinstance(t, torch.Tensor) else t == y.kwargs[name], name


def _survey(env: Envelope, n: int = 500) -> dict[str, set]:
    """What ``n`` calls of seed 0 pass, argument by argument."""
    seen: dict[str, set] = defaultdict(set)
    for c in calls(env, 0, n, "meta"):
        kw = c.kwargs
        seen["api"].add(c.api)
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "initial_state_indices"):
            if name in kw:
                seen[f"{name}.dtype"].add(kw[name].dtype)
                seen[f"{name}.contiguous"].add(kw[name].is_contiguous())
                seen[f"{name}.offset"].add(kw[name].storage_offset() > 0)
                seen[f"{name}.aligned"].add(kw[name].data_ptr() % 16 == 0)  # meta pointers carry the offset
        seen["dims"].add((kw["q"].shape[-2], kw["q"].shape[-1], kw["v"].shape[-1]))
        seen["fused_gate"].add("A_log" in kw)
        seen["lower_bound"].add(kw.get("lower_bound"))
        seen["l2norm"].add(kw["use_qk_l2norm"])
        if c.api == "recurrent_kda":
            n_seq = kw["state_indices"].shape[0]
            seen["draft"].add(kw.get("draft_width", 1))
            seen["batch"].add(n_seq)
            seen["padded"].add(f"n={n_seq},live={n_seq}" not in c.label)
        else:
            cu = kw.get("cu_seqlens")
            seen["varlen"].add(cu is not None)
            if cu is not None:
                seen["cu.dtype"].add(cu.dtype)
                seen["seqs"].add(len(cu) - 1)
                seen["longest"].add(int((cu[1:] - cu[:-1]).max()))
            seen["h0"].add("none" if "initial_state" not in kw else
                           "exact" if "initial_state_indices" not in kw else "pool")
    return seen


def test_traffic_stays_in_the_declared_envelope_and_varies_the_rest():
    s = _survey(H200)
    # declared: dims, activation and gate dtypes, fused gate without a lower bound, L2 norm, draft widths
    assert s["dims"] == {(32, 128, 128)}
    assert s["q.dtype"] == s["k.dtype"] == s["v.dtype"] == {torch.bfloat16}
    assert s["g.dtype"] == {torch.bfloat16, torch.float32}
    assert s["fused_gate"] == {True} and s["lower_bound"] == {None} and s["l2norm"] == {True}
    assert s["draft"] == {1, 2, 4} and s["api"] == {"chunk_kda_fwd", "recurrent_kda"}
    # not declared: every dtype the API accepts, views, offsets, batch sizes past the buckets, padding
    for name in ("beta", "A_log", "dt_bias"):
        assert s[f"{name}.dtype"] == set(FLOATS), name
    assert s["state_indices.dtype"] == s["initial_state_indices.dtype"] == s["cu.dtype"] == set(INDEX_DTYPES)
    for name in ("q", "k", "v", "g", "beta"):
        assert s[f"{name}.contiguous"] == {True, False}, name  # split out of a fused projection
    assert True in s["q.offset"] and True in s["beta.offset"] and True in s["state_indices.offset"]
    assert max(s["batch"]) > max(H200.decode_batch_buckets) and s["padded"] == {True, False}
    assert s["varlen"] == {True, False} and max(s["seqs"]) == 16 and max(s["longest"]) > H200.max_seq_len
    assert s["h0"] == {"pool", "none", "exact"}


def test_switches_the_manifest_leaves_open_are_varied_and_a_lower_bound_is_always_passed():
    s = _survey(dataclasses.replace(ASCEND, fused_gate=None, qk_l2norm=None), 200)
    assert s["fused_gate"] == {True, False} and s["l2norm"] == {True, False}
    assert s["lower_bound"] == {None, -5.0}  # None exactly where there is no fused gate
    assert s["draft"] == {1, 4}
    for name in ("q", "k", "v", "beta", "state_indices"):  # 6 heads: offsets that are not multiples of 16 bytes
        assert s[f"{name}.aligned"] == {True, False}, name


def _zero_or(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slot] per slot, a zero state for -1."""
    return torch.stack([pool[i] if i >= 0 else torch.zeros_like(pool[0]) for i in slots.tolist()])


def _check_against_reference(ref, call) -> None:
    """Run ``call`` and compare what it returns (and does to the pool) with the token-by-token reference."""
    kw = call.kwargs
    g = kw["g"]
    if "A_log" in kw:
        g = ref.gate_ref(g, kw["A_log"], kw["dt_bias"], kw.get("lower_bound"))
    args = dict(scale=kw.get("scale"), use_qk_l2norm=kw["use_qk_l2norm"])
    if call.api == "chunk_kda_fwd":
        pool, idx, cu = kw.get("initial_state"), kw.get("initial_state_indices"), kw.get("cu_seqlens")
        n = kw["q"].shape[0] if cu is None else len(cu) - 1
        h0 = pool if idx is None else _zero_or(pool, idx)
        o_ref, final_ref = ref.recurrent_ref(kw["q"], kw["k"], kw["v"], g, kw["beta"], initial_state=h0,
                                             cu_seqlens=cu, **args)
        o, final = call.run()
        assert float((o.float() - o_ref).abs().max()) <= TOL, call.label
        if kw["output_final_state"]:
            assert final.shape[0] == n and float((final - final_ref).abs().max()) <= TOL, call.label
        return
    pool, idx, D = kw["state_pool"], kw["state_indices"], kw.get("draft_width", 1)
    live = idx >= 0
    before = pool.clone()
    o_ref, final_ref = ref.recurrent_ref(kw["q"], kw["k"], kw["v"], g, kw["beta"], initial_state=_zero_or(pool, idx),
                                         cu_seqlens=torch.arange(len(idx) + 1) * D, **args)
    o, inter = call.run()
    tokens = live.repeat_interleave(D)
    assert float((o[0, tokens].float() - o_ref[0, tokens]).abs().max()) <= TOL, call.label
    after = before.clone()
    if D == 1:  # decode advances the live sequences' slots in place
        after[idx[live].long()] = final_ref[live]
    else:  # verify leaves the pool and returns the state after every draft token
        assert float((inter[live, D - 1] - final_ref[live]).abs().max()) <= TOL, call.label
    assert float((pool - after).abs().max()) <= TOL, call.label


@pytest.mark.parametrize("backend,lower_bound", [("npu", -5.0), ("cuda", None)])
def test_calls_are_valid_and_compute_kda(pk, backend, lower_bound):
    """One call of each kind (varlen and fixed prefill, decode, verify, the two halves of a mixed batch) with
    every incidental choice the generator makes, run for real: pinned configs (npu) or the autotuned path
    narrowed to one config."""
    traffic = importlib.import_module("prewarm_kernels.kda.traffic")  # bound to the interpreted kernels
    env = traffic.Envelope(heads=2, head_k_dim=16, head_v_dim=16, activation=(torch.float32,),
                           gate=(torch.float32,), decode_batch_buckets=(1, 2, 4), draft_widths=(2, 3),
                           gate_lower_bound=lower_bound, backend=backend, max_seq_len=40, long_seq_len=70)
    kinds = {"prefill[varlen": None, "prefill[fixed": None, "decode": None, "verify": None, "offset": None}
    for c in traffic.calls(env, 11, 80, "cpu"):
        kind = next((k for k in kinds if k in c.label), None) if "offset" not in c.label else "offset"
        if kind is not None and kinds[kind] is None:
            kinds[kind] = c
            with pk.one_config(0) if backend == "cuda" else pk.backend.use("npu"):
                _check_against_reference(pk.reference, c)
    assert all(kinds.values()), [k for k, c in kinds.items() if c is None]
