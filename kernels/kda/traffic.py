"""Seeded, server-like calls of the public KDA API, written independently of ``serving.py`` (the planner's calls).

A plan is only as good as its closure over what callers really pass. This generator is the judge: it draws calls
within a deployment's declared envelope (heads per rank, head dims, activation dtype(s), decode buckets, draft
widths, gate lower bound, backend) the way a server makes them, and varies everything the envelope does not fix:

- packed varlen prefills (1..16 sequences of 1..``max_seq_len`` tokens, now and then a long one; a batch within the
  envelope's ``max_prefill_tokens`` where it declares one, as a server's chunked prefill keeps it), fixed-length
  batched prefills, initial states from the pool by index (-1: a new sequence), none, or exactly one per
  sequence; decode batches of 1 up to twice the largest bucket (padded to a bucket with -1 slots, as a CUDA-graph
  replay does, or not), verify with every draft width, mixed batches (prefill and decode tokens in one buffer:
  the decode part is a view with a storage offset, its state indices a slice of the batch's);
- every dtype the API accepts where the envelope does not fix it: beta, A_log, dt_bias in bf16 / fp16 / fp32,
  the gate in the activation dtype or fp32, state indices and ``cu_seqlens`` int32 / int64;
- q/k/v(/g) as contiguous tensors or as views split out of one fused projection; beta contiguous, a strided half
  of a fused [.., 2H] projection, or a slice of the q/k/v projection (which then puts q/k/v at an odd offset);
- the fused gate and in-kernel L2 norm on and off unless the envelope says what the server uses.

It never imports the planner's provider (``serving.py``) and never imports ``prewarm``. Tensors are made when a
call is drawn; ``Call.run()`` only makes the API call (so a bench can time it). On ``meta`` the tensors hold no
data and only the launches matter (the closure test captures them); on a real device they hold valid values.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..backend import use
from ..spec import read_kda
from .chunk import chunk_kda_fwd
from .recurrent import recurrent_kda

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64"}  # fmt: skip


def _dtypes(value) -> tuple[torch.dtype, ...]:
    """"bfloat16" or ["bfloat16", "float32"] (a spec's dtype entry) -> torch dtypes."""
    names = [value] if isinstance(value, str) else list(value)
    return tuple(getattr(torch, n) for n in names)


@dataclass(frozen=True)
class Envelope:
    """What a deployment fixes; the generator varies everything else. ``None`` for a switch: the spec is silent."""

    heads: int  # KDA heads per rank
    head_k_dim: int
    head_v_dim: int
    activation: tuple[torch.dtype, ...]  # q, k, v
    gate: tuple[torch.dtype, ...]  # g (raw gate or log-decay)
    decode_batch_buckets: tuple[int, ...]
    draft_widths: tuple[int, ...]
    gate_lower_bound: float | None
    backend: str = "cuda"
    prefill: bool = True
    fused_gate: bool | None = None  # does the server pass A_log / dt_bias (gate activated in-kernel)?
    qk_l2norm: bool | None = None  # does it ask for the in-kernel L2 norm of q and k?
    max_seq_len: int = 3000  # a prefill sequence's usual length bound
    long_seq_len: int = 16384  # the occasional long prefill sequence
    max_prefill_tokens: int | None = None  # a prefill batch's token budget (the server's chunked-prefill size)

    @classmethod
    def from_spec(cls, spec: dict) -> "Envelope":
        """The envelope a manifest declares: the ``spec`` dict its kernel providers receive, read as they read it
        (``prewarm_kernels.spec.read_kda``)."""
        spec = read_kda(spec)
        return cls(heads=spec["heads"], head_k_dim=spec["head_k_dim"], head_v_dim=spec["head_v_dim"],
                   activation=_dtypes(spec["dtypes"]["activation"]), gate=_dtypes(spec["dtypes"]["gate"]),
                   decode_batch_buckets=tuple(spec["decode_batch_buckets"]), draft_widths=tuple(spec["draft_widths"]),
                   gate_lower_bound=spec["gate_lower_bound"], backend=spec["backend"] or "cuda",
                   prefill=spec["prefill"], fused_gate=spec["fused_gate"], qk_l2norm=spec["qk_l2norm"],
                   max_prefill_tokens=spec["max_prefill_tokens"])

    @property
    def max_batch(self) -> int:
        """Decode / verify batches are drawn up to this: twice the largest bucket (the API takes any size)."""
        return 2 * max(self.decode_batch_buckets or (8,))

    @property
    def pool_size(self) -> int:
        return self.max_batch + 16


@dataclass
class Call:
    """One API call, tensors already made on the device: ``run()`` makes it and returns the API's result."""

    label: str
    run: Callable[[], object]
    api: str = ""  # "chunk_kda_fwd" | "recurrent_kda"
    kwargs: dict = field(default_factory=dict)  # what run() passes (tensors are shared: decode updates the pool)


class _Draw:
    """The random choices and tensor factory of one ``calls()`` stream."""

    def __init__(self, env: Envelope, seed: int, device: str):
        self.env, self.device = env, torch.device(device)
        self.rng = random.Random(seed)
        self.gen = None if self.device.type == "meta" else torch.Generator(self.device).manual_seed(seed)
        self.pool = self.tensor((env.pool_size, env.heads, env.head_k_dim, env.head_v_dim), torch.float32,
                                lambda x: x.normal_(0, 0.5, generator=self.gen))
        # the current call's switches (set by options(); a mixed batch's two calls share them)
        self.fused = self.qk_norm = False
        self.last_options: tuple[dict, str] = ({}, "")

    # --- tensors --------------------------------------------------------------------------------------------

    def tensor(self, shape, dtype, fill: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
        """A new tensor; on a real device filled in fp32 by ``fill`` (default: standard normal), then cast."""
        if self.gen is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        x = torch.empty(shape, dtype=torch.float32, device=self.device)
        (fill or (lambda t: t.normal_(generator=self.gen)))(x)
        return x.to(dtype)

    def uniform(self, lo: float, hi: float):
        return lambda x: x.uniform_(lo, hi, generator=self.gen)

    def pick(self, options):
        return self.rng.choice(list(options))

    def switch(self, declared: bool | None) -> bool:
        return self.rng.random() < 0.5 if declared is None else declared

    def slots(self, n: int) -> list[int]:
        """``n`` distinct pool slots (each live sequence owns one)."""
        return self.rng.sample(range(self.env.pool_size), n)

    def indices(self, values: list[int], dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device)

    def inputs(self, B: int, T: int) -> tuple[dict, str]:
        """q, k, v, g [B, T, H, *] and beta [B, T, H]: contiguous, or views split out of one fused projection
        (g in it too where it has the activation dtype; beta in it, ahead of q, or a strided half of a fused
        [B, T, 2H] projection of its own, or a tensor of any float dtype)."""
        H, K, V = self.env.heads, self.env.head_k_dim, self.env.head_v_dim
        dt, gdt = self.pick(self.env.activation), self.pick(self.env.gate)
        g_fill = (lambda x: x.normal_(0, 2, generator=self.gen)) if self.fused else self.uniform(-0.31, -0.01)
        b_fill = self.uniform(0.05, 0.95)
        layout = self.pick(["contiguous", "fused", "beta+fused"] + ["fused+g"] * (gdt == dt))
        if layout == "contiguous":
            out = dict(zip("qkv", (self.tensor((B, T, H, d), dt) for d in (K, K, V))))
        else:
            names = ["beta"] * (layout == "beta+fused") + ["q", "k", "v"] + ["g"] * (layout == "fused+g")
            widths = {"beta": H, "q": H * K, "k": H * K, "v": H * V, "g": H * K}
            proj = self.tensor((B, T, sum(widths[n] for n in names)), dt)
            out = {n: p.view(B, T, H, -1) for n, p in zip(names, proj.split([widths[n] for n in names], dim=-1))}
            if "beta" in out:
                out["beta"] = out["beta"].view(B, T, H)
        if "g" not in out:
            out["g"] = self.tensor((B, T, H, K), gdt, g_fill)
        elif self.gen is not None:
            g_fill(out["g"])
        b_label = f"beta={_SHORT[dt]}/in-projection"
        if "beta" not in out:
            b_dt = self.pick(FLOATS)
            b_label = f"beta={_SHORT[b_dt]}"
            if self.rng.random() < 0.6:
                out["beta"] = self.tensor((B, T, H), b_dt, b_fill)
            else:
                half = self.rng.randrange(2)
                out["beta"] = self.tensor((B, T, 2 * H), b_dt, b_fill)[..., half * H:(half + 1) * H]
                b_label += f"/strided{half}"
        elif self.gen is not None:
            b_fill(out["beta"])
        if self.gen is not None and not self.qk_norm:  # unit-norm keys keep the delta rule contractive
            k = out["k"]
            k.copy_(k / k.float().norm(dim=-1, keepdim=True).to(k.dtype))
        return out, f"qkv={_SHORT[dt]}/{layout} g={_SHORT[out['g'].dtype]} {b_label}"

    def gate_args(self) -> tuple[dict, str]:
        """A_log [H], dt_bias [H*K] (each in any accepted dtype) and the envelope's lower bound, or nothing."""
        if not self.fused:
            return {}, "gate=none"
        H, K = self.env.heads, self.env.head_k_dim
        a_dt, b_dt = self.pick(FLOATS), self.pick(FLOATS)
        out = {"A_log": self.tensor((H,), a_dt, lambda x: x.normal_(0, 0.5, generator=self.gen)),
               "dt_bias": self.tensor((H * K,), b_dt)}
        kind = "softplus"
        if self.env.gate_lower_bound is not None:
            out["lower_bound"] = float(self.env.gate_lower_bound)
            kind = "lower_bound"
        return out, f"gate={kind} A_log={_SHORT[a_dt]} dt_bias={_SHORT[b_dt]}"

    def options(self) -> tuple[dict, str]:
        """Per call: fused gate and L2 norm (as declared, else either), scale given or left to the default."""
        self.fused, self.qk_norm = self.switch(self.env.fused_gate), self.switch(self.env.qk_l2norm)
        out = {"use_qk_l2norm": self.qk_norm}
        if self.rng.random() < 0.5:
            out["scale"] = self.env.head_k_dim ** -0.5
        return out, f"l2norm={int(self.qk_norm)}"

    # --- calls ----------------------------------------------------------------------------------------------

    def seq_lens(self) -> list[int]:
        n = self.pick([1] * 4 + [2, 3, 4] * 2 + list(range(5, 17)))
        lens = [self.rng.randint(1, self.env.max_seq_len) for _ in range(n)]
        if self.rng.random() < 0.1:
            lens[self.rng.randrange(n)] = self.rng.randint(self.env.max_seq_len + 1, self.env.long_seq_len)
        budget = self.env.max_prefill_tokens
        while budget is not None and sum(lens) > budget:  # a chunked-prefill server splits what exceeds its budget
            over = sum(lens) - budget
            lens = lens[:-1] if lens[-1] <= over else lens[:-1] + [lens[-1] - over]
        return lens

    def prefill(self, lens: list[int], fixed: bool = False, tensors: tuple[dict, str] | None = None,
                slot_ids: torch.Tensor | None = None) -> Call:
        """chunk_kda_fwd over packed sequences ``lens`` (or a [len(lens), T] batch when ``fixed``)."""
        opts, o_label = self.options() if tensors is None else self.last_options
        B, T = (len(lens), lens[0]) if fixed else (1, sum(lens))
        acts, a_label = tensors or self.inputs(B, T)
        gate, g_label = self.gate_args()
        kw = dict(acts, **gate, **opts, output_final_state=self.rng.random() < 0.9)
        kw.update(self.initial_state(len(lens)) if slot_ids is None else
                  {"initial_state": self.pool, "initial_state_indices": slot_ids})
        shape = f"B={B},T={T}"
        if not fixed:
            cu_dt = self.pick(INDEX_DTYPES)
            kw["cu_seqlens"] = torch.tensor([0] + list(_cumsum(lens)), dtype=cu_dt)
            shape = f"n={len(lens)},T={T},cu={_SHORT[cu_dt]}"
        idx = kw.get("initial_state_indices")
        h0 = "none" if "initial_state" not in kw else "exact" if idx is None else f"pool idx={_SHORT[idx.dtype]}"
        label = (f"prefill[{'fixed' if fixed else 'varlen'} {shape}] {a_label} {g_label} {o_label} "
                 f"h0={h0} final={int(kw['output_final_state'])}")
        return self.call(label, chunk_kda_fwd, kw)

    def initial_state(self, n: int) -> dict:
        """Initial states of ``n`` prefill sequences: from the pool by index (-1: a new sequence, zero state), none
        at all, or a slice of the pool holding exactly n states."""
        form = self.pick(["pool"] * 7 + ["none", "exact"])
        if form == "none":
            return {}
        if form == "exact":
            first = self.rng.randrange(self.env.pool_size - n + 1)
            return {"initial_state": self.pool[first:first + n]}
        slots = [-1 if self.rng.random() < 0.2 else s for s in self.slots(n)]
        return {"initial_state": self.pool, "initial_state_indices": self.indices(slots, self.pick(INDEX_DTYPES))}

    def recurrent(self, live: int, draft: int, tensors: tuple[dict, str] | None = None,
                  slot_ids: torch.Tensor | None = None) -> Call:
        """recurrent_kda for ``live`` sequences x ``draft`` tokens; maybe padded to a bucket with -1 slots."""
        opts, o_label = self.options() if tensors is None else self.last_options
        n = live
        buckets = [b for b in self.env.decode_batch_buckets if b >= live]
        if slot_ids is None and buckets and self.rng.random() < 0.5:  # a CUDA-graph replay pads the batch
            n = min(buckets)
        T = n * draft
        acts, a_label = tensors or self.inputs(1, T)
        gate, g_label = self.gate_args()
        if slot_ids is None:
            idx_dt = self.pick(INDEX_DTYPES)
            slot_ids = self.indices(self.slots(live) + [-1] * (n - live), idx_dt)
        kw = dict(acts, **gate, **opts, state_pool=self.pool, state_indices=slot_ids)
        if draft > 1:
            kw["draft_width"] = draft
        kind = "decode" if draft == 1 else f"verify draft={draft}"
        label = (f"{kind}[n={n},live={live}] {a_label} {g_label} {o_label} "
                 f"idx={_SHORT[slot_ids.dtype]}")
        return self.call(label, recurrent_kda, kw)

    def mixed(self) -> list[Call]:
        """One batch of prefill and decode tokens (chunked-prefill scheduling): one fused buffer, two calls; the
        decode part is a view with a storage offset and its state indices a slice of the batch's."""
        lens = self.seq_lens()[: self.rng.randint(1, 4)]
        live = self.rng.randint(1, self.env.max_batch)
        Tp = sum(lens)
        self.last_options = self.options()
        acts, a_label = self.inputs(1, Tp + live)
        idx = self.indices(self.slots(len(lens) + live), self.pick(INDEX_DTYPES))
        pre = {name: t[:, :Tp] for name, t in acts.items()}
        dec = {name: t[:, Tp:] for name, t in acts.items()}
        return [self.prefill(lens, tensors=(pre, a_label), slot_ids=idx[: len(lens)]),
                self.recurrent(live, 1, tensors=(dec, a_label + " offset"), slot_ids=idx[len(lens):])]

    def call(self, label: str, fn, kwargs: dict) -> Call:
        def run():
            with use(self.env.backend):
                return fn(**kwargs)

        return Call(label, run, fn.__name__, kwargs)

    def step(self) -> list[Call]:
        """One server step: a prefill, a decode, a verify or a mixed batch."""
        kinds = ["decode"] * 3 + ["verify"] * 2 * bool(self.env.draft_widths)
        if self.env.prefill:
            kinds += ["varlen"] * 3 + ["fixed"] + ["mixed"] * 2
        kind = self.pick(kinds)
        if kind == "varlen":
            return [self.prefill(self.seq_lens())]
        if kind == "fixed":
            B = self.rng.randint(2, 8)
            longest = min(self.env.max_seq_len // 4 + 1, (self.env.max_prefill_tokens or 1 << 30) // B or 1)
            return [self.prefill([self.rng.randint(1, longest)] * B, fixed=True)]
        if kind == "mixed":
            return self.mixed()
        draft = 1 if kind == "decode" else self.pick(self.env.draft_widths)
        return [self.recurrent(self.rng.randint(1, self.env.max_batch), draft)]


def _cumsum(xs: list[int]) -> Iterator[int]:
    total = 0
    for x in xs:
        total += x
        yield total


def calls(env: Envelope, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` calls drawn from ``seed`` (same seed, same calls), tensors made on ``device`` as each is drawn.

    Decode calls update the shared state pool in place, as a server's do: run them in the order drawn.
    """
    draw = _Draw(env, seed, device)
    made = 0
    while made < n:
        for c in draw.step()[: n - made]:
            made += 1
            yield c
