"""Seeded, server-like calls of vLLM's KDA kernels within a manifest's envelope: the independent traffic that
``tests/test_vllm.py`` (on fake tensors, inside ``vllm_kda.fake_cuda``) checks the plan of
:mod:`prewarm.providers.vllm.kda` against.

Written from vLLM 0.34.0's own call site, never from the provider's call builder: ``KimiGatedDeltaNetAttention``
(``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py``): ``forward`` splits one fused projection
``[T, 3hK + h + K]`` into the mixed q/k/v, raw beta and f_a (beta stays a view of it), f_b_proj makes the gate;
``_forward`` cuts the batch to its actual tokens, splits spec-decode tokens from the rest with ``index_select``
(copies) when a batch mixes them, runs prefill (the causal conv's transposed outputs rearranged to
``[1, T, h, K]``, the gathered initial states, ``chunk_kda_with_fused_gate``), plain decode
(``fused_recurrent_kda_packed_decode`` over the conv output, the state indices a prefix of the metadata's
persistent table) or spec decode (``fused_recurrent_kda`` over views of the conv output, ``[requests, 1 + num_spec]``
state indices, ``num_accepted_tokens``). Every call draws on its own: the batch's make-up, each role's dtype, each
index pointer's dtype, sequence counts and lengths up to the token budget, the decode batch size (a seeded
permutation of 1..the largest batch), the spec request count, the state pool's slot stride. ``Call.options`` holds
what a call drew.
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

from prewarm.providers.capture import index_tensor
from prewarm.providers.vllm.kda import read_spec

from . import Call, ServerTraffic

KDA = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded server-like forward calls of the layer's KDA part within ``spec``'s envelope."""
    yield from _Traffic(read_spec(spec), random.Random(seed), device).calls(n)


class _Traffic(ServerTraffic):
    def __init__(self, s, rng: random.Random, device: str):
        import importlib

        super().__init__(s, rng, device)
        self.kda = importlib.import_module(KDA)
        kinds = []
        if "prefill" in s.paths:
            kinds += ["prefill"]
        if "decode" in s.paths:
            kinds += ["decode"]
        if "spec_verify" in s.paths:
            kinds += ["spec"] + [f"spec+{k}" for k in kinds]
        self.kinds = kinds

    def draw(self, i: int) -> Call:
        s, rng, torch = self.s, self.rng, self.torch
        kind = rng.choice(self.kinds)
        roles = ("activation", "gate", "beta", "gate_params", "state")
        d = {"kind": kind, **{r: rng.choice(s.dtypes[r]) for r in roles},
             **{p: rng.choice(s.dtypes["index"]) for p in ("query_start_loc", "state_indices", "spec_query_start_loc",
                                                           "spec_state_indices", "num_accepted_tokens")},
             "slot_stride": rng.choice(s.state_slot_strides)}
        if kind.startswith("spec"):
            d["width"] = rng.choice(s.draft_widths)
            d["spec_requests"] = rng.randint(1, max(1, s.max_batch // 2))
        rest = kind.removeprefix("spec").removeprefix("+")
        if rest == "decode":
            d["decode_batch"] = next(self.batches)
        elif rest == "prefill":
            budget = s.max_prefill_tokens - d.get("spec_requests", 0) * d.get("width", 0)
            seqs = rng.randint(1, max(1, min(8, budget, s.max_batch)))
            d["lengths"] = [rng.randint(1, max(1, budget // seqs)) for _ in range(seqs)]
        d["padding"] = rng.choice((0, 0, rng.randint(1, 7)))  # physical tokens past the actual ones (graph padding)
        dts = {k: getattr(torch, v) for k, v in d.items() if isinstance(v, str) and v.startswith(("int", "float",
                                                                                                 "bfloat"))}
        label = f"vllm[{i}] " + " ".join(f"{k}={v}" for k, v in d.items())
        return Call(label, lambda: self.forward(d, dts), d)

    def zeros(self, *shape, dtype):
        return self.torch.zeros(*shape, dtype=dtype, device=self.device)

    def forward(self, d: dict, dts: dict):
        """KimiGatedDeltaNetAttention.forward + _forward, the KDA kernel calls only."""
        s, torch = self.s, self.torch
        h, K = s.heads, s.head_k_dim
        spec_tokens = d.get("spec_requests", 0) * d.get("width", 0)
        rest = d["kind"].removeprefix("spec").removeprefix("+")
        ns_tokens = sum(d.get("lengths", [])) if rest == "prefill" else d.get("decode_batch", 0)
        actual = spec_tokens + ns_tokens
        physical = actual + d["padding"]
        projected = self.zeros(physical, 3 * h * K + h + K, dtype=dts["activation"])
        mixed_qkv, beta, f_a = projected.split([3 * h * K, h, K], dim=-1)
        beta = beta.to(dts["beta"]) if dts["beta"] != dts["activation"] else beta  # a checkpoint in another dtype
        g1 = self.zeros(physical, h * K, dtype=dts["gate"]).reshape(1, physical, h, K)
        beta = beta.unsqueeze(0)
        mixed_qkv, g1, beta = mixed_qkv[:actual], g1[:, :actual], beta[:, :actual]
        A_log = self.zeros(h, dtype=dts["gate_params"])
        dt_bias = self.zeros(h * K, dtype=dts["gate_params"])
        slots = s.max_batch + 1
        flat = self.zeros(slots * d["slot_stride"], dtype=dts["state"])
        recurrent_state = flat.as_strided((slots, h, s.head_v_dim, K), (d["slot_stride"], s.head_v_dim * K, K, 1))
        if spec_tokens and ns_tokens:  # mixed batches: index_select copies
            perm = self.zeros(spec_tokens, dtype=torch.int64)
            mixed_qkv_spec, g1_spec, beta_spec = (mixed_qkv.index_select(0, perm), g1.index_select(1, perm),
                                                  beta.index_select(1, perm))
            rest_idx = self.zeros(ns_tokens, dtype=torch.int64)
            mixed_qkv_ns, g1_ns, beta_ns = (mixed_qkv.index_select(0, rest_idx), g1.index_select(1, rest_idx),
                                            beta.index_select(1, rest_idx))
        elif spec_tokens:
            mixed_qkv_spec, g1_spec, beta_spec = mixed_qkv, g1, beta
            mixed_qkv_ns = None
        else:
            mixed_qkv_ns, g1_ns, beta_ns = mixed_qkv, g1, beta
        if spec_tokens:
            n, width = d["spec_requests"], d["width"]
            spec_conv_out = torch.empty(mixed_qkv_spec.shape, dtype=mixed_qkv_spec.dtype, device=self.device)
            q, k, v = (x.reshape(1, spec_tokens, h, K) for x in spec_conv_out.split(h * K, dim=-1))
            table = self.zeros(s.max_batch, width, dtype=dts["spec_state_indices"])
            qsl = index_tensor(list(range(0, spec_tokens + 1, width)) + [spec_tokens] * (s.max_batch - n),
                               dts["spec_query_start_loc"], self.device)
            out = self.zeros(1, physical, h, K, dtype=dts["activation"])[:, :spec_tokens] if mixed_qkv_ns is None \
                else None
            self.kda.fused_recurrent_kda(
                q=q, k=k, v=v, raw_g=g1_spec, raw_beta=beta_spec, A_log=A_log, dt_bias=dt_bias,
                lower_bound=s.lower_bound, initial_state=recurrent_state, cu_seqlens=qsl[:n + 1],
                ssm_state_indices=table[:n],
                num_accepted_tokens=self.zeros(n, dtype=dts["num_accepted_tokens"]) + 1, out=out)
        if mixed_qkv_ns is None:
            return
        if rest == "prefill":
            lengths = d["lengths"]
            qkv = [self.zeros(h * K, ns_tokens, dtype=dts["activation"]).transpose(0, 1) for _ in range(3)]
            q, k, v = (x.reshape(1, ns_tokens, h, K) for x in qkv)  # einops rearrange of the conv's output
            cu = index_tensor(list(itertools.accumulate(lengths, initial=0)), dts["query_start_loc"], self.device)
            initial_state = self.zeros(len(lengths), h, s.head_v_dim, K, dtype=dts["state"])
            self.kda.chunk_kda_with_fused_gate(
                q=q, k=k, v=v, raw_g=g1_ns, raw_beta=beta_ns, A_log=A_log, g_bias=dt_bias,
                lower_bound=s.lower_bound, initial_state=initial_state, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        else:
            B = ns_tokens
            table = self.zeros(s.max_batch, dtype=dts["state_indices"])
            packed_conv_out = torch.empty(mixed_qkv_ns.shape, dtype=mixed_qkv_ns.dtype, device=self.device)
            self.kda.fused_recurrent_kda_packed_decode(
                mixed_qkv=packed_conv_out, raw_g=g1_ns, raw_beta=beta_ns, A_log=A_log, dt_bias=dt_bias,
                lower_bound=s.lower_bound, initial_state=recurrent_state, state_indices=table[:B])
