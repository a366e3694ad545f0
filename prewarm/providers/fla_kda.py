"""fla-core's KDA serving path (flash-linear-attention 0.6.0) as a provider: ``provider = "prewarm.providers.fla_kda"``.

fla launches its kernels itself (``kernel[grid](...)``), so :func:`launches` calls fla's public wrappers on
``meta`` tensors with Triton's launch entry point (``KernelInterface.__getitem__``) intercepted: each launch is
recorded as fla made it (its outermost Heuristics / Autotuner object, its arguments) and nothing reaches a device.
The build expands each into every autotune config fla's Autotuner keeps after its own pruning. fla reads the
device when it is imported and when it picks kernels (name, capability, opt-in shared memory, SM count): the
manifest must name the node's device (``[target] device``), whose profile answers those queries.

The calls, for every (activation, gate) dtype pair the spec declares and beta in the activation dtype and fp32:
prefill is one packed varlen ``chunk_kda`` (int64 ``cu_seqlens`` plus its CPU copy, fused gate, in-kernel q/k L2
norm, with and without initial states, final state out); decode one ``fused_recurrent_kda`` per batch bucket and
verify one per draft width, each as equal-length batches and as packed ``cu_seqlens``.

Specialization over the envelope: fla 0.6.0 passes its runtime ints (T, N) with ``do_not_specialize``; the one
compile-time value taken from a shape is l2norm's token bucket ``NB = cdiv(T * H, 65536)`` (a constexpr, an
autotune key). Prefill is planned once per NB value from 1 up to ``[spec.serving] max_prefill_tokens`` (else
:data:`MAX_PREFILL_TOKENS`). The spec is the KDA serving spec (``prewarm_kernels.spec.read_kda``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prewarm_kernels.spec import SpecError, read_kda

MAX_PREFILL_TOKENS = 16384  # the envelope when the spec gives none: a serving engine's max batched tokens
L2NORM_ROWS_PER_BUCKET = 2048 * 32  # fla.modules.norm.l2norm: NB = triton.cdiv(T, 2048 * 32) over T * H rows


@dataclass
class Launch:
    """One kernel launch as fla made it (what ``prewarm.plan`` reads from a provider)."""

    kernel: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""


@contextlib.contextmanager
def intercepted() -> Iterator[list[Launch]]:
    """Within the block every ``kernel[grid](...)`` is recorded instead of launched (this process only)."""
    from triton.runtime.jit import KernelInterface

    records: list[Launch] = []
    original = KernelInterface.__getitem__

    def record(self, grid):
        return lambda *args, **kwargs: records.append(Launch(self, args, kwargs))

    KernelInterface.__getitem__ = record
    try:
        yield records
    finally:
        KernelInterface.__getitem__ = original


def launches(spec: dict) -> list[Launch]:
    """Every kernel launch of fla's KDA serving path for ``spec``, captured on meta tensors (nothing runs)."""
    spec = _check(spec)
    out: list[Launch] = []
    for prefix, call in _calls(spec, "meta"):
        with intercepted() as records:
            call()
        for rec in records:
            rec.label = f"{prefix}/{_name(rec.kernel)}"
        out.extend(records)
    return out


def run(spec: dict, device: str = "cuda") -> None:
    """The same calls on random tensors on ``device``: compiles and autotunes what a server would (device build)."""
    import torch

    spec = _check(spec)
    for _, call in _calls(spec, device):
        call()
    torch.cuda.synchronize()


def prefill_token_counts(heads: int, max_tokens: int) -> list[int]:
    """The smallest packed token count of each l2norm bucket NB in 1..cdiv(max_tokens * heads, rows per bucket)."""
    buckets = -(-max_tokens * heads // L2NORM_ROWS_PER_BUCKET)
    return [(nb - 1) * L2NORM_ROWS_PER_BUCKET // heads + 1 for nb in range(1, buckets + 1)]


def _check(spec: dict) -> dict:
    """The manifest's spec read (``prewarm_kernels.spec``), on the target fla's CUDA path needs."""
    import torch

    read = read_kda(spec)
    if read["backend"] != "cuda":
        raise SpecError("backend", read["backend"], "'cuda' ([target] backend): fla_kda plans fla's CUDA (Triton) "
                        "path")
    if not torch.cuda.is_available():
        raise ValueError("fla picks its kernels from the device (name, capability, shared memory) when imported: "
                         "name the node's device in the manifest, e.g. [target] device = \"H200\"")
    return read


def _calls(spec: dict, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label prefix, thunk) for every call of the serving path, tensors on ``device`` (meta: shapes only)."""
    import torch

    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError as e:
        raise ValueError(f"fla-core is not importable ({e}): install the fla extra, pip install -e '.[fla]'") from e

    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    lb = spec.get("gate_lower_bound")
    fused, l2norm = spec.get("fused_gate", True), spec.get("qk_l2norm", True)
    gen = torch.Generator().manual_seed(0)
    f32 = torch.float32

    def rand(*shape, dtype, scale=1.0):
        if device == "meta":  # shapes only: no data drawn
            return torch.empty(*shape, dtype=dtype, device="meta")
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    gate = ({"A_log": rand(H, dtype=f32, scale=0.5), "dt_bias": rand(H * K, dtype=f32, scale=0.5),
             "use_gate_in_kernel": True, "safe_gate": lb is not None, "lower_bound": lb} if fused else {})

    def inputs(B: int, T: int, act, gdt, bdt):
        g = rand(B, T, H, K, dtype=gdt) if fused else -rand(B, T, H, K, dtype=gdt).abs()
        beta = rand(B, T, H, dtype=bdt).sigmoid()
        return rand(B, T, H, K, dtype=act), rand(B, T, H, K, dtype=act), rand(B, T, H, V, dtype=act), g, beta

    def packed(lengths: list[int]) -> dict:
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        return {"cu_seqlens": cu.to(device), "cu_seqlens_cpu": cu}

    def lengths_for(total: int) -> list[int]:  # a few sequences of unequal length summing to ``total``
        parts = [n for n in (total // 2, total // 3) if n] or [total]
        return [*parts, total - sum(parts)] if total > sum(parts) else parts

    max_tokens = spec["max_prefill_tokens"] or MAX_PREFILL_TOKENS
    buckets = sorted(set(spec["decode_batch_buckets"]))
    drafts = sorted(set(d for d in spec["draft_widths"] if d > 1))
    roles = spec["dtypes"]
    for act_name in roles["activation"]:
        for gate_name in roles["gate"]:
            for beta_name in dict.fromkeys([act_name, "float32"]):
                act, gdt, bdt = (getattr(torch, n) for n in (act_name, gate_name, beta_name))
                tag = f"act={act_name},gate={gate_name},beta={beta_name}"
                if spec.get("prefill", True):
                    for total in prefill_token_counts(H, max_tokens):
                        for with_state in (True, False):
                            def prefill(total=total, with_state=with_state, act=act, gdt=gdt, bdt=bdt):
                                lens = lengths_for(total)
                                h0 = rand(len(lens), H, K, V, dtype=f32) if with_state else None
                                return chunk_kda(*inputs(1, total, act, gdt, bdt), initial_state=h0,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                                 **packed(lens), **gate)
                            yield f"prefill[{tag},T={total},h0={with_state}]", prefill
                for kind, width, batch in ([("decode", 1, b) for b in buckets]
                                           + [("verify", d, b) for d in drafts for b in buckets[-1:]]):  # fmt: skip
                    for varlen in (False, True):
                        def recurrent(width=width, batch=batch, varlen=varlen, act=act, gdt=gdt, bdt=bdt):
                            shape = (1, batch * width) if varlen else (batch, width)
                            extra = {"cu_seqlens": packed([width] * batch)["cu_seqlens"]} if varlen else {}
                            return fused_recurrent_kda(*inputs(*shape, act, gdt, bdt),
                                                       initial_state=rand(batch, H, K, V, dtype=f32),
                                                       output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                                       **{k: v for k, v in gate.items() if k != "safe_gate"},
                                                       **extra)
                        yield f"{kind}[{tag},B={batch},T={width},varlen={varlen}]", recurrent


def _name(kernel) -> str:
    from prewarm import tritoncompat

    return tritoncompat.jit_function(kernel).fn.__name__
