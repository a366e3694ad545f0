"""Seeded, server-like calls of fla-core's public KDA API (``chunk_kda``, ``fused_recurrent_kda``) within a
manifest's envelope: the independent traffic that ``bench/fla_traffic.py`` (on a GPU) and ``tests/test_fla.py`` (on
``meta`` tensors) check the plan of :mod:`prewarm.providers.fla_kda` against.

Written from fla's public API and the KDA serving spec only, never from the provider's call builder (a proof driven
by the planner's own calls cannot see what the plan misses): random packed prefill batches (sequence count, every
length, total up to the envelope's token budget, initial states or not, the CPU copy of ``cu_seqlens`` or not),
decode at any batch size (equal-length or packed), multi-token verify at the declared draft widths, q/k/v as views
of one fused projection, beta in bf16 or fp32, gate in each declared dtype.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

TOKEN_BUDGET = 16384  # a serving engine's max batched tokens per prefill step (the manifest's envelope)


@dataclass
class Call:
    label: str
    run: Callable[[], object]


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded server-like calls of fla's public KDA API within ``spec``'s envelope, tensors on ``device``."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from prewarm_kernels.spec import read_kda

    rng = random.Random(seed)
    spec = read_kda(spec)  # the manifest's spec as the providers read it: heads per rank, dtypes per role
    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    acts, gates = spec["dtypes"]["activation"], spec["dtypes"]["gate"]
    lb = spec["gate_lower_bound"]
    drafts = [d for d in spec["draft_widths"] if d > 1]
    max_batch = max(spec["decode_batch_buckets"] or [1])

    def tensor(*shape, dtype):
        if device == "meta":
            return torch.empty(*shape, dtype=dtype, device="meta")
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    def dtypes() -> tuple:
        """(activation, gate, beta): a deployment's activation and gate dtypes, beta as its model makes it."""
        return (getattr(torch, rng.choice(acts)), getattr(torch, rng.choice(gates)),
                rng.choice([torch.bfloat16, torch.float32]))

    def layer(B: int, T: int, act, gdt, bdt):
        qkv = tensor(B, T, H * (2 * K) + H * V, dtype=act)  # one fused projection: q, k, v are views of it
        q, k, v = (t.unflatten(-1, (H, -1)) for t in qkv.split([H * K, H * K, H * V], dim=-1))
        beta = tensor(B, T, H, dtype=bdt).sigmoid()
        gate = dict(A_log=tensor(H, dtype=torch.float32), dt_bias=tensor(H * K, dtype=torch.float32),
                    use_gate_in_kernel=True, lower_bound=lb)
        return (q, k, v, tensor(B, T, H, K, dtype=gdt), beta), gate

    def cu(lengths: list[int]):
        cpu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        return cpu.to(device), cpu

    for _ in range(n):
        types = dtypes()
        tag = ",".join(str(t).removeprefix("torch.") for t in types)
        kind = rng.choices(["prefill", "decode", "verify"], weights=[2, 3, 2 if drafts else 0])[0]
        if kind == "prefill":
            seqs = rng.randint(1, 12)
            lengths = [rng.randint(1, TOKEN_BUDGET // seqs) for _ in range(seqs)]
            with_state, cpu_copy = rng.random() < 0.7, device == "meta" or rng.random() < 0.5

            def prefill(lengths=lengths, with_state=with_state, cpu_copy=cpu_copy, types=types):
                (q, k, v, g, beta), gate = layer(1, sum(lengths), *types)
                dev, cpu = cu(lengths)
                h0 = tensor(len(lengths), H, K, V, dtype=torch.float32) if with_state else None
                return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=dev,
                                 cu_seqlens_cpu=cpu if cpu_copy else None, safe_gate=lb is not None, **gate)

            yield Call(f"prefill[{tag}] seqs={seqs} T={sum(lengths)} h0={with_state}", prefill)
        else:
            width = 1 if kind == "decode" else rng.choice(drafts)
            batch, packed = rng.randint(1, max_batch), rng.random() < 0.5

            def recurrent(width=width, batch=batch, packed=packed, types=types):
                (q, k, v, g, beta), gate = layer(1, batch * width, *types) if packed else layer(batch, width, *types)
                extra = {"cu_seqlens": cu([width] * batch)[0]} if packed else {}
                return fused_recurrent_kda(q, k, v, g, beta, initial_state=tensor(batch, H, K, V, dtype=torch.float32),
                                           output_final_state=True, use_qk_l2norm_in_kernel=True, **gate, **extra)

            yield Call(f"{kind}[{tag}] B={batch} T={width} packed={packed}", recurrent)
