"""Seeded, server-like calls of fla-core's public KDA API (``chunk_kda``, ``fused_recurrent_kda``,
``fused_recurrent_kda_fwd``, ``fused_kda_gate``) within a manifest's envelope: the independent traffic that
``bench/fla_traffic.py`` (on a GPU) and ``tests/test_fla.py`` (on ``meta`` tensors) check the plan of
:mod:`prewarm.providers.fla.kda` against.

Written from fla's signatures and docstrings and the KDA serving spec only, never from the provider's call builder
(a proof driven by the planner's own calls cannot see what the plan misses). Every call draws every option of its
entry point on its own, out of the values the spec lets a deployment use (``prewarm_kernels.spec.read_kda``): the
initial state or none, the final state or none, returned, written in place or into a pool by
``ssm_state_indices`` ([N] for decode, [N, D] with ``num_accepted_tokens`` for verify), packed ``cu_seqlens`` (with
or without its CPU copy) or equal-length batches, each index tensor's dtype drawn apart from the others' (int64
offsets beside int32 slot indices, as servers pass them), the gate activated in-kernel or before the call (by
``fused_kda_gate``, in any output dtype, or by the caller), q/k L2 norm and beta's sigmoid in-kernel or not, safe
gate, chunk size, CUDA-graph mode (padded ``cu_seqlens``, ``max_num_seqs``), recompute, state layout,
``return_intermediate_states``, the dtypes of beta, A_log / dt_bias, g and the state, the scale left to fla or
passed, ``out`` passed or not; and what no option names: batch sizes from 1 to twice the largest decode bucket,
sequence counts and odd lengths up to the token budget, q/k/v as views of one fused projection, A_log shaped [H] or
[1, 1, H, 1]. ``Call.options`` holds what a call drew.
"""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

from . import Call

TOKEN_BUDGET = 16384  # a serving engine's max batched tokens per prefill step when the spec gives none


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded server-like calls of fla's public KDA API within ``spec``'s envelope, tensors on ``device``."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.kda.gate import fused_kda_gate
    from prewarm_kernels.spec import read_kda

    rng = random.Random(seed)
    spec = read_kda(spec)  # the manifest's envelope: heads per rank, dtypes per role, the call options it allows
    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    opts, dts = spec["calls"], spec["dtypes"]
    lb, neg = spec["gate_lower_bound"], spec["allow_neg_eigval"]
    budget = spec["max_prefill_tokens"] or TOKEN_BUDGET
    buckets = spec["decode_batch_buckets"]
    max_batch = spec["max_running_requests"] or max(buckets or [1])  # the most sequences a server puts in one call
    widths = [1] * bool(buckets) + [w for w in spec["draft_widths"] if w > 1]
    meta = device == "meta"

    def dtype(name: str):
        return getattr(torch, name)

    def tensor(*shape, dtype, scale: float = 1.0):
        if meta:
            return torch.empty(*shape, dtype=dtype, device="meta")
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)

    def ints(values: list, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    def pick(o: dict, name: str, values: list):
        o[name] = rng.choice(values)
        return o[name]

    def draw_inputs(o: dict) -> None:
        """What every entry point takes: dtypes, how g is made and passed, beta, the q/k norm, layout, scale."""
        pick(o, "act", dts["activation"])
        pick(o, "beta", dts["beta"])
        pick(o, "beta_sigmoid_in_kernel", opts["beta_sigmoid_in_kernel"])
        pick(o, "qk_l2norm_in_kernel", opts["qk_l2norm_in_kernel"])
        pick(o, "state_v_first", opts["state_v_first"])
        pick(o, "scale", [None, *spec["scale"]])  # None: fla's own default
        pick(o, "g", dts["gate"])
        pick(o, "gate_params", dts["gate_params"])
        pick(o, "A_log_shape", [(H,), (1, 1, H, 1)])
        if not pick(o, "gate_in_kernel", opts["gate_in_kernel"]):
            how = pick(o, "gate_activation", ["fused_kda_gate", "caller"] if spec["fused_gate"] else ["caller"])
            pick(o, "activated_dtype", [None, *dts["gate"]] if how == "fused_kda_gate" else dts["gate"])

    def projection(o: dict, B: int, T: int):
        """q, k, v: views of one fused projection, or three tensors."""
        act = dtype(o["act"])
        if not o.get("views"):
            return tensor(B, T, H, K, dtype=act), tensor(B, T, H, K, dtype=act), tensor(B, T, H, V, dtype=act)
        qkv = tensor(B, T, H * (2 * K + V), dtype=act)
        return tuple(t.unflatten(-1, (H, -1)) for t in qkv.split([H * K, H * K, H * V], dim=-1))

    def inputs(o: dict, B: int, T: int) -> dict:
        q, k, v = projection(o, B, T)
        params = dtype(o["gate_params"])
        a_log, dt_bias = tensor(*o["A_log_shape"], dtype=params, scale=0.5), tensor(H * K, dtype=params, scale=0.5)
        raw = tensor(B, T, H, K, dtype=dtype(o["g"]))
        if o["gate_in_kernel"]:
            gate = {"g": raw, "use_gate_in_kernel": True, "A_log": a_log, "dt_bias": dt_bias, "lower_bound": lb}
        elif o["gate_activation"] == "fused_kda_gate":  # as fla's own layer decodes
            out = {} if o["activated_dtype"] is None else {"output_dtype": dtype(o["activated_dtype"])}
            gate = {"g": fused_kda_gate(raw, a_log, dt_bias, lower_bound=lb, **out)}
        else:  # a decay the caller computed, in its own dtype
            decay = dtype(o["activated_dtype"])
            gate = {"g": tensor(B, T, H, K, dtype=decay) if meta else
                    -torch.nn.functional.softplus(raw.float()).to(decay)}
        beta = tensor(B, T, H, dtype=dtype(o["beta"]))
        sigmoid = o["beta_sigmoid_in_kernel"]
        if not sigmoid and not meta:
            beta = beta.sigmoid() * (2 if neg else 1)  # the model's beta, activated by the caller
        extra = {"use_qk_l2norm_in_kernel": o["qk_l2norm_in_kernel"], "state_v_first": o["state_v_first"],
                 "use_beta_sigmoid_in_kernel": sigmoid, "allow_neg_eigval": sigmoid and neg}
        if o["scale"] is not None:
            extra["scale"] = o["scale"]
        return {"q": q, "k": k, "v": v, "beta": beta, **gate, **extra}

    def state(o: dict, N: int, state_dtype) -> object:
        kv = (V, K) if o["state_v_first"] else (K, V)
        return tensor(N, H, *kv, dtype=state_dtype, scale=0.1)

    def prefill() -> Call:
        o: dict = {"entry": "chunk_kda"}
        varlen = pick(o, "varlen", opts["varlen"])
        graph = pick(o, "use_graph", opts["use_graph"])
        if varlen:
            seqs = rng.randint(1, 12)
            lengths = [rng.randint(1, max(1, budget // seqs)) for _ in range(seqs)]
            lengths += [0] * (rng.randint(1, 3) if graph else 0)  # graph capture: zero-length tail sequences
            cpu_copy = meta or rng.random() < 0.5  # on meta fla needs the host copy to size its chunk indices
            o.update(B=1, T=sum(lengths), N=len(lengths), cu_seqlens=rng.choice(dts["index"]),
                     cu_seqlens_cpu=rng.choice(dts["index"]) if cpu_copy else None,  # its own dtype, or not passed
                     max_num_seqs=graph and rng.random() < 0.5)
        else:
            B, lengths = rng.randint(1, max_batch), []
            o.update(B=B, T=rng.randint(1, max(1, budget // B)), N=B)
        o["views"] = rng.random() < 0.5
        draw_inputs(o)
        for name in ("initial_state", "final_state", "chunk_size", "safe_gate", "disable_recompute"):
            pick(o, name, opts[name])
        o["chunk_size_passed"] = o["chunk_size"] != 64 or rng.random() < 0.5
        pick(o, "return_intermediate_states", [False] if o["disable_recompute"] else [False, True])

        def run():
            args = inputs(o, o["B"], o["T"])
            if varlen:
                offsets = torch.tensor([0, *lengths]).cumsum(0)  # int64, as torch.tensor / cumsum make them
                args["cu_seqlens"] = offsets.to(device, dtype(o["cu_seqlens"]))
                if o["cu_seqlens_cpu"]:
                    args["cu_seqlens_cpu"] = offsets.to(dtype(o["cu_seqlens_cpu"]))
                if o["max_num_seqs"]:
                    args["max_num_seqs"] = o["N"]
            if o["initial_state"]:
                args["initial_state"] = state(o, o["N"], torch.float32)  # chunk_kda asserts fp32 states
            if o["chunk_size_passed"]:
                args["chunk_size"] = o["chunk_size"]
            with torch.inference_mode() if o["return_intermediate_states"] else contextlib.nullcontext():
                return chunk_kda(**args, output_final_state=o["final_state"], safe_gate=o["safe_gate"],
                                 use_graph=graph, disable_recompute=o["disable_recompute"],
                                 return_intermediate_states=o["return_intermediate_states"])

        return Call(_label(o), run, o)

    def recurrent() -> Call:
        o: dict = {"recurrent_state": rng.choice(opts["recurrent_state"])}
        mode = o["recurrent_state"]
        o["entry"] = rng.choice(["fused_recurrent_kda", "fused_recurrent_kda_fwd"]) if mode == "returned" else \
            "fused_recurrent_kda_fwd"
        # fla reads a token's state slot at ssm_state_indices[n * stride + t]: [N] indices hold one token a sequence
        # (decode), more tokens need [N, D] ones (indexed_spec); [N] with more ran past them on the H200
        W = pick(o, "tokens_per_seq", [1] if mode == "indexed" else widths)
        N = pick(o, "batch", list(range(1, max_batch + 1)))
        varlen = pick(o, "varlen", opts["varlen"])
        if varlen:
            pick(o, "cu_seqlens", dts["index"])
        if mode.startswith("indexed"):
            pick(o, "ssm_state_indices", dts["index"])
        if mode == "indexed_spec":
            pick(o, "num_accepted_tokens", dts["index"])
        pick(o, "state", dts["state"])
        draw_inputs(o)
        if mode == "returned":
            pick(o, "initial_state", opts["initial_state"])
            pick(o, "final_state", opts["final_state"])
        else:
            o["out"] = rng.random() < 0.5
        slots = N * W + rng.randint(1, 8)  # a pool larger than the batch
        order = rng.sample(range(slots), N * W)
        accepted = [rng.randint(1, W) for _ in range(N)]

        def run():
            B, T = (1, N * W) if varlen else (N, W)
            args = inputs(o, B, T)
            if varlen:
                args["cu_seqlens"] = ints(list(range(0, N * W + 1, W)), dtype(o["cu_seqlens"]))
            if mode == "returned":
                if o["initial_state"]:
                    args["initial_state"] = state(o, N, dtype(o["state"]))
                if o["entry"] == "fused_recurrent_kda":
                    return fused_recurrent_kda(**args, output_final_state=o["final_state"])
                return fused_recurrent_kda_fwd(**args, output_final_state=o["final_state"], inplace_final_state=False)
            args["initial_state"] = state(o, N if mode == "in_place" else slots, dtype(o["state"]))
            if mode == "indexed":
                args["ssm_state_indices"] = ints(order[:N], dtype(o["ssm_state_indices"]))
            elif mode == "indexed_spec":
                args["ssm_state_indices"] = ints([order[i * W:(i + 1) * W] for i in range(N)],
                                                 dtype(o["ssm_state_indices"]))
                args["num_accepted_tokens"] = ints(accepted, dtype(o["num_accepted_tokens"]))
            if o["out"]:
                args["out"] = torch.empty_like(args["v"])
            return fused_recurrent_kda_fwd(**args)  # inplace_final_state: fla's default, True

        return Call(_label(o), run, o)

    kinds = [prefill] * 2 * spec["prefill"] + [recurrent] * 3 * bool(widths)
    for _ in range(n):
        yield rng.choice(kinds)()


def _label(o: dict) -> str:
    return f"{o['entry']}[" + ",".join(f"{k}={v}" for k, v in o.items() if k != "entry") + "]"
