"""Seeded, server-like calls of sglang's ``TritonKDAKernel`` within a manifest's envelope: the independent traffic
that ``tests/test_sglang.py`` (on fake tensors, inside ``common.fake_device``) and ``bench/sglang_traffic.py``
(on the H200) check the plan of :mod:`prewarm.providers.sglang.cuda` against.

Written from sglang 0.5.23's own call sites, never from the provider's call builder: ``KDAAttnBackend``'s
``forward_extend`` / ``forward_decode`` / ``_forward_target_verify`` (``kda_backend.py``), the metadata they read
(``hybrid_linear_attn_backend.py``: int32 ``query_start_loc`` and slot tables, the verify scratch rows,
``retrieve_parent_token`` as ``empty_like`` of a long tensor), the state pools (``memory_pool.py``: ``[slots + 1, H, V, K]``, the scratch ``[slots + 1, draft, H, V, K]``) and Kimi-Linear's layer
(``kimi_linear.py``: q/k/v/beta/f_a/g_a out of one fused projection, beta a view of it, the forget gate out of a
batched matmul, A_log ``[1, 1, H, 1]``). Within the envelope (``common.read_spec``) every call draws on its own:
the path, each role's dtype, the batch size (a seeded permutation of 1..the largest batch, so a run of enough calls
sees every size), the draft width and whether the adaptive scratch keeps the widest pitch, dense or ragged verify
(1..width tokens per request), chain or tree verify, the padded rows of a CUDA-graph batch (slot -1), prefill
sequence counts and every length up to the token budget, physical tokens past the logical ones (DP padding), raw
beta as its own tensor or a view of the fused projection, or beta the caller sigmoided, the gate with or without
``dt_bias`` or activated by the caller, the prefix-cache track snapshot, the shapes ``packed_decode`` documents for
``a`` and ``b``. ``Call.options`` holds what a call drew. :func:`sampling_calls`: sglang's FlashInfer sampling of
batches with temperature > 0 (FlashInfer's JIT sampling module, not Triton).
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

from prewarm.providers.capture import index_tensor
from prewarm.providers.sglang.common import read_spec

from . import Call, ServerTraffic, cycle, short


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded server-like calls of TritonKDAKernel within ``spec``'s envelope, tensors on ``device`` (the
    choices are drawn when a call is made, its tensors when it runs)."""
    yield from _Traffic(read_spec(spec), random.Random(seed), device).calls(n)


class _Traffic(ServerTraffic):
    def __init__(self, s, rng: random.Random, device: str):
        from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

        super().__init__(s, rng, device)
        self.kernel = TritonKDAKernel()
        self.widths = cycle(rng, s.draft_widths) if s.draft_widths else None
        self.kinds = [p for p in s.paths if p != "target_verify" or s.draft_widths]

    def draw(self, i: int) -> Call:
        s, rng, torch = self.s, self.rng, self.torch
        kind = rng.choice(self.kinds)
        dts = {role: getattr(torch, rng.choice(names)) for role, names in s.dtypes.items()}
        d = {"kind": kind, **{role: str(dt).removeprefix("torch.") for role, dt in dts.items()},
             "beta_row": rng.choice(s.beta_row_strides)}
        if kind == "extend":
            seqs = rng.randint(1, min(s.max_batch, s.max_prefill_tokens))
            total = rng.randint(seqs, s.max_prefill_tokens)
            cuts = sorted(rng.sample(range(1, total), seqs - 1))
            d["lengths"] = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            d["physical"] = total + rng.choice([0, 0, rng.randint(1, 64)])  # DP-attention padding past the batch
            d["slots"] = rng.sample(range(1, s.max_batch + 1), seqs)
            d["beta"] = rng.choice(["raw", "raw", "sigmoid"])  # kda_backend passes raw; a caller may sigmoid
            d["gate"] = rng.choice(["raw", "raw", "raw-nobias", "activated"])
            d["track"] = s.track_state and rng.random() < 0.4
            d["intermediate"] = d["track"] or rng.random() < 0.2
            d["tracked"] = [rng.choice([-1, 0, 1]) for _ in range(seqs)]  # track_chunk_idx: -1 untracked
        else:
            d["batch"] = batch = next(self.batches)
            d["slots"] = rng.sample(range(1, s.max_batch + 1), batch)
            if batch > 1 and rng.random() < 0.3:  # a CUDA-graph bucket: its padded rows carry slot -1
                pad = rng.randint(1, batch - 1)
                d["slots"][batch - pad:] = [-1] * pad
            if kind == "target_verify":
                d["width"] = width = next(self.widths)
                ragged = batch > 1 and rng.random() < 0.4  # ragged verify: 1..width tokens per request
                d["lens"] = [rng.randint(1, width) for _ in range(batch)] if ragged else [width] * batch
                d["pitch"] = rng.choice([width, s.draft_widths[-1]])  # adaptive: the scratch keeps the widest pitch
                d["tree"] = s.eagle_tree and rng.random() < 0.5
            elif kind == "packed_decode":  # TritonKDAKernel.packed_decode: a and b in the shapes it documents
                d["a"] = rng.choice(["[B, hK]", "[B, h, K]", "[B, 1, hK]"])
                d["b"] = rng.choice(["[1, B, h]", "[B, 1, h]"])
        label = f"{kind}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k != "kind") + "]"
        return Call(label, lambda: getattr(self, kind)(d, dts), d)

    # --- tensors as sglang lays them out ----------------------------------------------------------------------

    def zeros(self, *shape, dtype):
        return self.torch.zeros(*shape, dtype=dtype, device=self.device)

    def index(self, values: list[int], dts: dict):
        return index_tensor(values, dts["index"], self.device)

    def beta(self, tokens: int, row: int, dts: dict):
        """Raw beta [1, T, h] as Kimi's layers hand it over: a view of the fused q/k/v/beta/f_a/g_a projection
        (kimi_linear.py: beta after q, k, v) where the row holds q, k, v; else the tail of K3's merged [f_a | b]
        projection (kimi_k3.py), or b_proj's own output (row = h)."""
        h, K = self.s.heads, self.s.head_k_dim
        proj = self.zeros(tokens, row, dtype=dts["beta"])
        at = 3 * h * K if row >= 3 * h * K + h else row - h
        return proj.narrow(1, at, h).unsqueeze(0)

    def forget_gate(self, tokens: int, dts: dict):
        """fused_fg_b_proj: one batched matmul [2, T, hK]; the forget gate is its first slice, [T, hK]."""
        return self.zeros(2, tokens, self.s.heads * self.s.head_k_dim, dtype=dts["gate"])[0]

    def params(self, dts: dict):
        """The layer's A_log [1, 1, h, 1] and dt_bias [hK]."""
        h, K = self.s.heads, self.s.head_k_dim
        return self.zeros(1, 1, h, 1, dtype=dts["gate_params"]), self.zeros(h * K, dtype=dts["gate_params"])

    def pool(self, dts: dict):
        s = self.s
        return self.zeros(s.max_batch + 1, s.heads, s.head_v_dim, s.head_k_dim, dtype=dts["state"])

    def split_heads(self, qkv):
        """kda_backend: q, k, v = qkv.split(...); each unflattened per head and unsqueezed to [1, T, h, d]."""
        h, K, V = self.s.heads, self.s.head_k_dim, self.s.head_v_dim
        q, k, v = qkv.split([h * K, h * K, h * V], dim=-1)
        return [t.unflatten(-1, (-1, dim)).unsqueeze(0) for t, dim in ((q, K), (k, K), (v, V))]

    def conv_width(self) -> int:
        return 2 * self.s.heads * self.s.head_k_dim + self.s.heads * self.s.head_v_dim

    # --- the calls ----------------------------------------------------------------------------------------------

    def extend(self, d: dict, dts: dict):
        """KDAAttnBackend.forward_extend -> TritonKDAKernel.extend."""
        s, torch = self.s, self.torch
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        lengths, physical = d["lengths"], d["physical"]
        total, seqs = sum(lengths), len(lengths)
        a = self.forget_gate(physical, dts).unflatten(-1, (-1, K)).unsqueeze(0)  # [1, T, h, K] in extend
        b = self.beta(physical, d["beta_row"], dts)
        if total < physical:  # forward_extend drops the padded tokens
            a, b = a[:, :total], b[:, :total]
        # causal_conv1d_fn(mixed_qkv.transpose(0, 1), ...).transpose(0, 1): the conv output is column-major
        q, k, v = self.split_heads(self.zeros(self.conv_width(), total, dtype=dts["activation"]).transpose(0, 1))
        A_log, dt_bias = self.params(dts)
        gate = {"raw": dict(A_log=A_log, dt_bias=dt_bias), "raw-nobias": dict(A_log=A_log, dt_bias=None),
                "activated": dict(A_log=None, dt_bias=None)}[d["gate"]]
        if d["gate"] == "activated":  # the caller applied -exp(A_log) * softplus(g + dt_bias) itself
            a = self.zeros(1, total, h, K, dtype=dts["gate"])
        if d["beta"] == "sigmoid":
            b = self.zeros(1, total, h, dtype=dts["beta"])
        track = {}
        if d["track"]:  # kda_backend: an fp32 snapshot row per request, the chunk each snapshots (-1: none)
            track = dict(track_state=torch.empty((seqs, h, V, K), dtype=torch.float32, device=self.device),
                         track_chunk_idx=self.index(d["tracked"], dts))
        return self.kernel.extend(
            q, k, v, a, b, ssm_states=self.pool(dts), cache_indices=self.index(d["slots"], dts),
            query_start_loc=self.index(list(itertools.accumulate(lengths, initial=0)), dts),
            lower_bound=s.lower_bound, beta_is_raw=d["beta"] == "raw", extend_seq_lens_cpu=lengths,
            extend_prefix_lens=None, layer_id=0, is_spec_decode=False,
            return_intermediate_states=d["intermediate"], **gate, **track)

    def packed_decode(self, d: dict, dts: dict):
        """KDAAttnBackend.forward_decode's packed path (CUDA) -> TritonKDAKernel.packed_decode."""
        s, batch = self.s, d["batch"]
        h, K = s.heads, s.head_k_dim
        a = self.forget_gate(batch, dts)
        a = {"[B, hK]": a, "[B, h, K]": a.unflatten(-1, (h, K)), "[B, 1, hK]": a.unsqueeze(1)}[d["a"]]
        b = self.beta(batch, d["beta_row"], dts)
        b = b if d["b"] == "[1, B, h]" else b.transpose(0, 1)
        A_log, dt_bias = self.params(dts)
        qkv = self.zeros(batch, self.conv_width(), dtype=dts["activation"])  # causal_conv1d_update's fresh output
        return self.kernel.packed_decode(
            qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=self.pool(dts),
            cache_indices=self.index(d["slots"], dts), num_v_heads=h, head_v_dim=s.head_v_dim,
            lower_bound=s.lower_bound, replayssm_d=None, replayssm_k=None, replayssm_g=None,
            replayssm_write_pos=None, replayssm_force_flush=None)

    def decode(self, d: dict, dts: dict):
        """forward_decode's unpacked path (a gate lower bound) -> TritonKDAKernel.decode."""
        batch = d["batch"]
        q, k, v = self.split_heads(self.zeros(batch, self.conv_width(), dtype=dts["activation"]))
        A_log, dt_bias = self.params(dts)
        return self.kernel.decode(
            q, k, v, self.forget_gate(batch, dts), self.beta(batch, d["beta_row"], dts), A_log=A_log,
            dt_bias=dt_bias, ssm_states=self.pool(dts), cache_indices=self.index(d["slots"], dts),
            query_start_loc=self.index(list(range(batch + 1)), dts), lower_bound=self.s.lower_bound)

    def target_verify(self, d: dict, dts: dict):
        """KDAAttnBackend._forward_target_verify -> TritonKDAKernel.target_verify: the conv's per-step output back
        to [tokens, dim] (a reshape copy; a gather when ragged), the speculative scratch, the per-request rows."""
        s, torch = self.s, self.torch
        lens, width = d["lens"], d["width"]
        batch, tokens = len(lens), sum(lens)
        q, k, v = self.split_heads(self.zeros(tokens, self.conv_width(), dtype=dts["activation"]))
        A_log, dt_bias = self.params(dts)
        scratch = self.zeros(s.max_batch + 2, d["pitch"], s.heads, s.head_v_dim, s.head_k_dim, dtype=dts["state"])
        parent = None
        if d["tree"]:  # empty_like(retrieve_next_token) (long), filled with each draft token's parent (-1: the root)
            parent = (torch.arange(width, dtype=torch.long, device=self.device) - 1).expand(batch, width).contiguous()
        return self.kernel.target_verify(
            A_log, dt_bias, q, k, v, self.forget_gate(tokens, dts), self.beta(tokens, d["beta_row"], dts),
            ssm_states=self.pool(dts), cache_indices=self.index(d["slots"], dts),
            query_start_loc=self.index(list(itertools.accumulate(lens, initial=0)), dts),
            intermediate_states_buffer=scratch, intermediate_state_indices=self.index(list(range(s.max_batch + 1)), dts),
            cache_steps=width, retrieve_parent_token=parent, lower_bound=s.lower_bound)


VOCAB = 163840  # Kimi-Linear's and K3's vocabulary: the logits' last dimension


def sampling_calls(max_batch: int, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded calls of sglang 0.5.23's FlashInfer sampling (``Sampler.forward_sampling_backend``, backend
    ``flashinfer``, ``sampler.py``) for batches with temperature > 0: probabilities from logits over the vocabulary
    at each request's temperature, then either the joint top-k/top-p sampler (``top_k_top_p_sampling_from_probs``,
    ``filter_apply_order="joint"``) or, where a request sets min_p, the renorms and the min-p sampler; per-request
    int32 ``top_ks`` and fp32 ``top_ps`` / ``min_ps`` (``sampling_batch_info.py``). The batch size is drawn from
    1..``max_batch`` like the KDA calls'."""
    rng = random.Random(seed)
    batches = cycle(rng, range(1, max_batch + 1))
    for i in range(n):
        batch, min_p = next(batches), rng.random() < 0.3
        temps = [rng.uniform(0.3, 1.5) for _ in range(batch)]

        def run(batch=batch, min_p=min_p, temps=temps, draw=random.Random(rng.random())):
            import torch
            from flashinfer.sampling import (min_p_sampling_from_probs, top_k_renorm_prob,
                                             top_k_top_p_sampling_from_probs, top_p_renorm_prob)

            logits = torch.randn(batch, VOCAB, device=device, dtype=torch.float32)
            probs = torch.softmax(logits / torch.tensor(temps, device=device).view(-1, 1), dim=-1)
            top_ks = torch.tensor([draw.choice([1, 20, 50, VOCAB]) for _ in range(batch)], dtype=torch.int32,
                                  device=device)
            top_ps = torch.tensor([draw.uniform(0.5, 1.0) for _ in range(batch)], device=device)
            if min_p:
                probs = top_p_renorm_prob(top_k_renorm_prob(probs, top_ks), top_ps)
                min_ps = torch.tensor([draw.uniform(0.0, 0.2) for _ in range(batch)], device=device)
                return min_p_sampling_from_probs(probs, min_ps)
            return top_k_top_p_sampling_from_probs(probs.contiguous(), top_ks, top_ps, filter_apply_order="joint")

        yield Call(f"sample#{i}[batch={batch},min_p={min_p}]", run, {"kind": "sample", "batch": batch, "min_p": min_p})
