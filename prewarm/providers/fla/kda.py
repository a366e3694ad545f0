"""fla-core's KDA (flash-linear-attention 0.6.0), its whole public API, as a provider:
``provider = "prewarm.providers.fla.kda"``.

fla launches its kernels itself (``kernel[grid](...)``), so :func:`launches` calls fla's public entry points on
``meta`` tensors with Triton's launch entry point (``KernelInterface.__getitem__``) intercepted: each launch is
recorded as fla made it (its outermost Heuristics / Autotuner object, its arguments) and nothing reaches a device.
The build expands each into every autotune config fla's Autotuner keeps after its own pruning. fla reads the
device when it is imported and when it picks kernels (name, capability, opt-in shared memory, SM count): the
manifest must name the node's device (``[target] device``), whose profile answers those queries.

The entry points: ``chunk_kda`` (prefill), ``fused_recurrent_kda`` and ``fused_recurrent_kda_fwd`` (decode and
verify, state returned, written in place or into a state pool by ``ssm_state_indices``, with
``num_accepted_tokens`` for speculative verify) and ``fused_kda_gate`` (the gate activated before a call with
``use_gate_in_kernel=False``, as fla's own layer decodes). Every option of theirs that changes a constexpr, a
pointer's dtype or a specialization class is an axis: a ``[spec.serving]`` list of the values to plan (the call
options of ``prewarm_kernels.spec.FLA_CALL_OPTIONS``), the ``[spec.dtypes]`` roles (activation, gate, beta,
gate_params, state, index) and ``[spec.model]`` (gate_lower_bound, scale, allow_neg_eigval). :func:`options` says
for each what is planned against what fla accepts; ``prewarm plan`` prints every axis a manifest or a default
narrows.

The compile count is a product per kernel, never across kernels: each fla kernel is compiled once per combination
of the axes that reach it, times its autotune configs. ``chunk_kda`` runs one kernel per stage and each axis reaches
only some stages, so its calls are the union of one product per stage (:data:`PREFILL_STAGES`): the stages after
the gate see q/k/v, beta as read, the state switches, indices, chunk size, graph mode, layout and safe gate; the
gate stage sees g, A_log/dt_bias, indices, chunk size and graph mode; the q/k L2 norm sees the activation dtype and
its token bucket ``NB = cdiv(T * H, 65536)`` (planned for each bucket up to ``[spec.serving] max_prefill_tokens``,
else :data:`MAX_PREFILL_TOKENS`); the beta sigmoid sees beta's dtype and its element count's class (fla specializes
it). The recurrent kernel sees every recurrent axis, so those are crossed in full: that product is where the count
grows (see ``README``). Each index pointer a kernel takes is its own specialization, so each takes every planned
index dtype on its own: the recurrent kernel's cu_seqlens, ssm_state_indices and num_accepted_tokens are crossed
(:data:`INDEX_POINTERS`); chunk_kda's kernels see cu_seqlens and what fla derives from it in its dtype (chunk indices
and offsets; ``cu_seqlens_cpu``, the host copy, reaches no kernel). fla's runtime ints T and N are not specialized,
so lengths and batch sizes multiply nothing but two constexprs: the width D of ``[N, D]`` state indices (a stride:
once per draft width) and the batch size B of an equal-length ``chunk_kda`` whose gate was activated before the call
(fla's local cumsum: once per B up to :func:`max_batch`).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prewarm_kernels.spec import DTYPES, FLA_CALL_OPTIONS, INDEX_DTYPES, SpecError, fla_accepted, read_kda

MAX_PREFILL_TOKENS = 16384  # the envelope when the spec gives none: a serving engine's max batched tokens
L2NORM_ROWS_PER_BUCKET = 2048 * 32  # fla.modules.norm.l2norm: NB = triton.cdiv(T, 2048 * 32) over T * H rows
SIGMOID_TOKENS = range(1, 17)  # fused_beta_sigmoid specializes its element count: every class of tokens * heads

# chunk_kda's axes, by the stage (group of kernels) they reach: each stage is planned over the product of its axes
PREFILL_STAGES = {
    "state": ("act", "beta", "sigmoid", "index", "graph", "chunk", "v_first", "initial", "final", "safe",
              "recompute"),  # intra, token-parallel / sub-chunk, inter + solve, recompute w/u, state h, output o
    "gate": ("gate_in_kernel", "g", "params", "index", "graph", "chunk", "batch"),  # gate + cumsum, or cumsum
    "l2norm": ("act", "l2norm", "tokens"),  # l2norm_fwd: NB from the token count
    "sigmoid": ("beta", "sigmoid", "tokens"),  # fused_beta_sigmoid: its element count's specialization class
}


NOT = "not planned:"  # the mark of a parameter the table says is not planned
_QKV = "spec.dtypes.activation; shapes from spec.model, lengths by every class the kernels specialize"
_FLAGS = {"use_qk_l2norm_in_kernel": "spec.serving.qk_l2norm_in_kernel", "use_gate_in_kernel":
          "spec.serving.gate_in_kernel", "use_beta_sigmoid_in_kernel": "spec.serving.beta_sigmoid_in_kernel",
          "allow_neg_eigval": "spec.model.allow_neg_eigval", "lower_bound": "spec.model.gate_lower_bound",
          "state_v_first": "spec.serving.state_v_first", "output_final_state": "spec.serving.final_state"}
_RECURRENT = {"q": _QKV, "k": _QKV, "v": _QKV, "g": "spec.dtypes.gate (raw, activated in-kernel) or activated",
              "beta": "spec.dtypes.beta", "A_log": "spec.dtypes.gate_params", "dt_bias": "spec.dtypes.gate_params",
              "scale": "spec.model.scale (a constexpr of the recurrent kernel)",
              "initial_state": "spec.serving.initial_state / recurrent_state, spec.dtypes.state",
              "cu_seqlens": "spec.serving.varlen, spec.dtypes.index (each index pointer's dtype on its own)",
              **_FLAGS}
# Every parameter of fla's public KDA API and what plans it (:data:`NOT_PLANNED`: what does not). Written from fla's
# signatures and docstrings; tests/test_fla.py compares it with ``inspect.signature`` of the installed fla, so a
# parameter a new fla adds fails the tests instead of going unplanned.
API = {
    "chunk_kda": {
        "q": _QKV, "k": _QKV, "v": _QKV, "beta": "spec.dtypes.beta", **_FLAGS,
        "g": "spec.dtypes.gate (raw, activated in-kernel) or activated (fp32 or the raw dtype)",
        "scale": "a runtime float of every chunk kernel: any value, no variant",
        "initial_state": "spec.serving.initial_state (fp32: fla requires it)",
        "safe_gate": "spec.serving.safe_gate", "disable_recompute": "spec.serving.disable_recompute",
        "return_intermediate_states": "keeps h instead of freeing it (inference mode): no kernel sees it",
        "cu_seqlens": "spec.serving.varlen, spec.dtypes.index",
        "cu_seqlens_cpu": "passed with cu_seqlens (its host copy in any index dtype: no kernel argument; fla derives "
                          "chunk indices in cu_seqlens' dtype)",
        "cp_context": f"{NOT} context parallelism (its own kernels, a process group): planned without it",
        "use_graph": "spec.serving.use_graph", "max_num_seqs": "spec.serving.use_graph (the padded batch)",
        "kwargs": "A_log, dt_bias (spec.dtypes.gate_params), chunk_size (spec.serving.chunk_size), "
                  "transpose_state_layout (the deprecated name of state_v_first)",
    },
    "fused_recurrent_kda": {**_RECURRENT, "kwargs": "transpose_state_layout (the deprecated name of state_v_first)"},
    "fused_recurrent_kda_fwd": {
        **_RECURRENT, "inplace_final_state": "spec.serving.recurrent_state (in_place, indexed, indexed_spec)",
        "ssm_state_indices": "spec.serving.recurrent_state (indexed: [N], indexed_spec: [N, D]), spec.dtypes.index "
                             "(each index pointer's dtype on its own)",
        "num_accepted_tokens": "spec.serving.recurrent_state indexed_spec, spec.dtypes.index (each index pointer's "
                               "dtype on its own)",
        "out": f"{NOT} planned as fla's default (zeros_like(v)); an out of another dtype than v is another "
               "pointer type",
        "kwargs": "transpose_state_layout (the deprecated name of state_v_first)",
    },
    "fused_kda_gate": {"g": "spec.dtypes.gate", "A_log": "spec.dtypes.gate_params",
                       "dt_bias": "spec.dtypes.gate_params", "lower_bound": "spec.model.gate_lower_bound",
                       "output_dtype": "fp32 (fla's default) or the gate's dtype"},
}
# parameters planned only at fla's default (a call that passes them otherwise may compile), and why
NOT_PLANNED = {f"{fn}.{param}": how.removeprefix(NOT).strip() for fn, table in API.items()
               for param, how in table.items() if how.startswith(NOT)}


@dataclass
class Launch:
    """One kernel launch as fla made it (what ``prewarm.planning.plan`` reads from a provider)."""

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
    """Every kernel launch of fla's KDA API over ``spec``'s envelope, captured on meta tensors (nothing runs)."""
    spec = _check(spec)
    out: list[Launch] = []
    for label, call in _calls(spec, "meta"):
        with intercepted() as records:
            call()
        for rec in records:
            rec.label = f"{label}/{_name(rec.kernel)}"
        out.extend(records)
    return out


def run(spec: dict, device: str = "cuda") -> None:
    """The same calls on random tensors on ``device``: compiles and autotunes what a server would (device build)."""
    import torch

    spec = _check(spec)
    for _, call in _calls(spec, device):
        call()
    torch.cuda.synchronize()


def options(spec: dict) -> list[dict]:
    """Each of fla's API axes: its spec key, the values planned, every value fla accepts, whether the manifest set
    it (a narrowed axis is planned on fewer values than fla accepts, by the manifest or by a documented default);
    then each parameter of :data:`NOT_PLANNED`, with why."""
    read = read_kda(spec)
    given = {table: set(spec.get(table, {}) if isinstance(spec.get(table), dict) else ())
             for table in ("serving", "dtypes", "model")}
    accepted = fla_accepted(read["fused_gate"], read["qk_l2norm"], read["gate_lower_bound"])
    rows = [(f"serving.{key}", read["calls"][key], list(accepted[key])) for key in FLA_CALL_OPTIONS]
    rows += [(f"dtypes.{role}", read["dtypes"][role], list(INDEX_DTYPES if role == "index" else DTYPES))
             for role in ("activation", "gate", "beta", "gate_params", "state", "index")]
    rows.append(("model.scale", read["scale"], None))  # any number: fla's default head_k_dim ** -0.5 unless listed
    out = [{"key": f"spec.{key}", "planned": planned, "accepted": accepted,
            "given": key.split(".")[1] in given[key.split(".")[0]],
            "narrowed": accepted is not None and planned != accepted} for key, planned, accepted in rows]
    return out + [{"key": f"fla.{name}", "planned": None, "accepted": None, "given": False, "narrowed": True,
                   "why": why} for name, why in NOT_PLANNED.items()]


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


@dataclass(frozen=True)
class Prefill:
    """One ``chunk_kda`` call: a value for every axis (``index``: cu_seqlens' dtype, None for equal lengths)."""

    act: str
    g: str
    beta: str
    params: str
    index: str | None
    initial: bool
    final: bool
    chunk: int
    graph: bool
    v_first: bool
    recompute: bool
    gate_in_kernel: bool
    l2norm: bool
    sigmoid: bool
    safe: bool
    tokens: int
    batch: int  # sequences of an equal-length batch (index None): a constexpr of fla's local cumsum


@dataclass(frozen=True)
class Recurrent:
    """One ``fused_recurrent_kda`` (state ``returned``) or ``fused_recurrent_kda_fwd`` call."""

    act: str
    g: str
    beta: str
    params: str | None
    cu_seqlens: str | None  # its dtype (packed sequences), None for an equal-length batch
    state_indices: str | None  # ssm_state_indices' dtype (indexed modes)
    accepted: str | None  # num_accepted_tokens' dtype (indexed_spec)
    mode: str  # spec.serving.recurrent_state
    initial: bool
    final: bool
    state: str
    width: int  # tokens per sequence: the D of [N, D] state indices
    v_first: bool
    gate_in_kernel: bool
    l2norm: bool
    sigmoid: bool
    scale: float


def prefills(spec: dict) -> list[Prefill]:
    """Every ``chunk_kda`` call to plan: per stage of :data:`PREFILL_STAGES`, the product of its axes' planned
    values, every other axis at its first planned value."""
    if not spec["prefill"]:
        return []
    c, d = spec["calls"], spec["dtypes"]
    max_tokens = spec["max_prefill_tokens"] or MAX_PREFILL_TOKENS
    axes = {"act": d["activation"], "beta": d["beta"], "sigmoid": c["beta_sigmoid_in_kernel"],
            "index": [None] * (False in c["varlen"]) + d["index"] * (True in c["varlen"]),
            "graph": c["use_graph"], "chunk": c["chunk_size"], "v_first": c["state_v_first"],
            "initial": c["initial_state"], "final": c["final_state"], "safe": c["safe_gate"],
            "recompute": c["disable_recompute"], "gate_in_kernel": c["gate_in_kernel"], "g": _gates(spec),
            "params": d["gate_params"], "l2norm": c["qk_l2norm_in_kernel"],
            "tokens": sorted({*prefill_token_counts(spec["heads"], max_tokens), *SIGMOID_TOKENS}),
            "batch": list(range(1, max_batch(spec) + 1))}
    base = {name: values[0] for name, values in axes.items()}
    base["tokens"] = 64 + 1  # two chunks, the second partial
    out: dict[Prefill, None] = {}
    for stage, names in PREFILL_STAGES.items():
        for values in itertools.product(*(axes[n] for n in names)):
            call = Prefill(**{**base, **dict(zip(names, values))})
            if _valid_prefill(call, spec):
                out.setdefault(call)
    return list(out)


def _gates(spec: dict) -> list[str]:
    """g's dtypes: the declared raw gate dtypes, and an activated gate in those or fp32 (fused_kda_gate's default)."""
    return list(dict.fromkeys([*spec["dtypes"]["gate"], "float32"]))


def _valid_prefill(p: Prefill, spec: dict) -> bool:
    """A raw gate (activated in-kernel) only in its declared dtypes; batches of more than one equal-length sequence
    only where the batch size is a constexpr (fla's local cumsum of a gate activated before the call)."""
    return (p.gate_in_kernel is False or p.g in spec["dtypes"]["gate"]) and \
        (p.batch == 1 or (p.index is None and not p.gate_in_kernel))


def max_batch(spec: dict) -> int:
    """The most sequences one call holds: ``[spec.serving] max_running_requests``, else the largest decode bucket."""
    return spec["max_running_requests"] or max(spec["decode_batch_buckets"] or [1])


# the index pointers the recurrent kernel takes in each spec.serving.recurrent_state mode, besides cu_seqlens
INDEX_POINTERS = {"returned": (), "in_place": (), "indexed": ("state_indices",),
                  "indexed_spec": ("state_indices", "accepted")}


def recurrents(spec: dict) -> list[Recurrent]:
    """Every recurrent call to plan: the full product of the recurrent kernel's axes (it sees them all), each index
    pointer in every planned index dtype on its own."""
    c, d = spec["calls"], spec["dtypes"]
    widths = [1] * bool(spec["decode_batch_buckets"]) + sorted(w for w in spec["draft_widths"] if w > 1)
    out = []
    for act, beta, gik, l2norm, sigmoid, v_first, scale, mode, varlen in itertools.product(
            d["activation"], d["beta"], c["gate_in_kernel"], c["qk_l2norm_in_kernel"], c["beta_sigmoid_in_kernel"],
            c["state_v_first"], spec["scale"], c["recurrent_state"], c["varlen"]):
        gates = itertools.product(d["gate"], d["gate_params"]) if gik else ((g, None) for g in _gates(spec))
        states = itertools.product(c["initial_state"], c["final_state"]) if mode == "returned" else [(True, True)]
        pointers = ("cu_seqlens",) * varlen + INDEX_POINTERS[mode]
        for (g, params), (initial, final), state, width, dtypes in itertools.product(
                gates, states, d["state"], widths if mode == "indexed_spec" else widths[:1],
                itertools.product(d["index"], repeat=len(pointers))):
            index = {"cu_seqlens": None, "state_indices": None, "accepted": None, **dict(zip(pointers, dtypes))}
            out.append(Recurrent(act, g, beta, params, **index, mode=mode, initial=initial, final=final,
                                 state=state if initial else "float32", width=width, v_first=v_first,
                                 gate_in_kernel=gik, l2norm=l2norm, sigmoid=sigmoid, scale=scale))
    return list(dict.fromkeys(out))


def gate_activations(spec: dict) -> list[tuple[str, str, str]]:
    """(g, A_log/dt_bias, output) dtypes of every ``fused_kda_gate`` call: the gate activated before a recurrent or
    chunk call that does not activate it in-kernel."""
    if False not in spec["calls"]["gate_in_kernel"] or not spec["fused_gate"]:
        return []
    d = spec["dtypes"]
    return list(itertools.product(d["gate"], d["gate_params"], _gates(spec)))


def _calls(spec: dict, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) for every planned call, tensors on ``device`` (meta: shapes only)."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        from fla.ops.kda.gate import fused_kda_gate
    except ImportError as e:
        raise ValueError(f"fla-core is not importable ({e}): install the fla extra, pip install -e '.[fla]'") from e

    t = _Tensors(spec, device)
    for p in prefills(spec):
        yield _label("prefill", p), lambda p=p: chunk_kda(**t.prefill(p))
    for r in recurrents(spec):
        fn = fused_recurrent_kda if r.mode == "returned" else fused_recurrent_kda_fwd
        yield _label("decode" if r.width == 1 else "verify", r), lambda fn=fn, r=r: fn(**t.recurrent(r))
    for g, params, out in gate_activations(spec):
        yield f"gate[g={g},params={params},out={out}]", lambda g=g, p=params, o=out: fused_kda_gate(**t.gate(g, p, o))


def _label(kind: str, call: Any) -> str:
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    return f"{kind}[" + ",".join(f"{k}={short.get(v, v)}" for k, v in vars(call).items()) + "]"


class _Tensors:
    """The arguments of each planned call, on ``device`` (``meta``: shapes and dtypes only; else valid values)."""

    def __init__(self, spec: dict, device: str):
        import torch

        self.torch, self.device = torch, device
        self.H, self.K, self.V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
        self.lb, self.neg = spec["gate_lower_bound"], spec["allow_neg_eigval"]
        self.gen = torch.Generator().manual_seed(0)

    def rand(self, *shape, dtype: str, scale: float = 1.0):
        dt = getattr(self.torch, dtype)
        if self.device == "meta":
            return self.torch.empty(*shape, dtype=dt, device="meta")
        return (self.torch.randn(*shape, generator=self.gen) * scale).to(self.device, dt)

    def ints(self, values: list[int], dtype: str, device: str | None = None):
        return self.torch.tensor(values, dtype=getattr(self.torch, dtype), device=device or self.device)

    def gate_params(self, dtype: str) -> dict:
        return {"A_log": self.rand(self.H, dtype=dtype, scale=0.5), "dt_bias": self.rand(self.H * self.K, dtype=dtype,
                                                                                        scale=0.5)}

    def qkvgb(self, B: int, T: int, act: str, g: str, beta: str, sigmoid: bool) -> dict:
        H, K, V = self.H, self.K, self.V
        b = self.rand(B, T, H, dtype=beta)
        return {"q": self.rand(B, T, H, K, dtype=act), "k": self.rand(B, T, H, K, dtype=act),
                "v": self.rand(B, T, H, V, dtype=act), "g": self.rand(B, T, H, K, dtype=g),
                "beta": b if sigmoid or self.device == "meta" else b.sigmoid()}

    def beta_options(self, sigmoid: bool) -> dict:
        """Raw beta with the sigmoid in-kernel (x2 there for a model with negative eigenvalues), or beta as given."""
        return {"use_beta_sigmoid_in_kernel": sigmoid, "allow_neg_eigval": sigmoid and self.neg}

    def gate_options(self, gate_in_kernel: bool, params: str | None) -> dict:
        if not gate_in_kernel:
            return {"use_gate_in_kernel": False}
        return {"use_gate_in_kernel": True, "lower_bound": self.lb, **self.gate_params(params)}

    def prefill(self, p: Prefill) -> dict:
        """chunk_kda: ``batch`` equal-length sequences of ``tokens`` tokens in all, or packed sequences of unequal
        lengths."""
        lengths = [p.tokens // 2, p.tokens - p.tokens // 2] if p.tokens > 1 else [1]
        B, T = (1, p.tokens) if p.index else (p.batch, max(1, p.tokens // p.batch))
        args = self.qkvgb(B, T, p.act, p.g, p.beta, p.sigmoid)
        extra: dict = {}
        n = B
        if p.index:
            cu = [0, *itertools.accumulate(lengths)] + [sum(lengths)] * (1 if p.graph else 0)  # graph: a padded tail
            n = len(cu) - 1
            extra = {"cu_seqlens": self.ints(cu, p.index), "cu_seqlens_cpu": self.ints(cu, p.index, "cpu")}
            if p.graph:
                extra["max_num_seqs"] = n
        if p.initial:
            extra["initial_state"] = self.rand(n, self.H, *self.state_shape(p.v_first), dtype="float32")
        return {**args, **extra, "output_final_state": p.final, "use_qk_l2norm_in_kernel": p.l2norm,
                "safe_gate": p.safe, "chunk_size": p.chunk, "use_graph": p.graph, "state_v_first": p.v_first,
                "disable_recompute": p.recompute, **self.beta_options(p.sigmoid),
                **self.gate_options(p.gate_in_kernel, p.params)}

    def state_shape(self, v_first: bool) -> tuple[int, int]:
        return (self.V, self.K) if v_first else (self.K, self.V)

    def recurrent(self, r: Recurrent) -> dict:
        """fused_recurrent_kda(_fwd): N sequences of ``width`` tokens, equal-length or packed; the state per
        sequence, in place, or in a pool of slots read and written through ``ssm_state_indices``."""
        N, W = 3, r.width
        args = self.qkvgb(1, N * W, r.act, r.g, r.beta, r.sigmoid) if r.cu_seqlens else \
            self.qkvgb(N, W, r.act, r.g, r.beta, r.sigmoid)
        extra: dict = {"scale": r.scale, "use_qk_l2norm_in_kernel": r.l2norm, "state_v_first": r.v_first,
                       **self.beta_options(r.sigmoid), **self.gate_options(r.gate_in_kernel, r.params)}
        if r.cu_seqlens:
            extra["cu_seqlens"] = self.ints(list(range(0, N * W + 1, W)), r.cu_seqlens)
        shape = self.state_shape(r.v_first)
        if r.mode == "returned":
            extra["output_final_state"] = r.final
            if r.initial:
                extra["initial_state"] = self.rand(N, self.H, *shape, dtype=r.state)
            return {**args, **extra}
        slots = N * W + 2  # a pool larger than the batch
        extra.update(initial_state=self.rand(slots if r.mode.startswith("indexed") else N, self.H, *shape,
                                             dtype=r.state), inplace_final_state=True)
        if r.mode == "indexed":
            extra["ssm_state_indices"] = self.ints([slots - 1 - n for n in range(N)], r.state_indices)
        elif r.mode == "indexed_spec":
            extra["ssm_state_indices"] = self.ints([[n * W + i for i in range(W)] for n in range(N)], r.state_indices)
            extra["num_accepted_tokens"] = self.ints([1 + n % W for n in range(N)], r.accepted)
        return {**args, **extra}

    def gate(self, g: str, params: str, out: str) -> dict:
        return {"g": self.rand(2, 5, self.H, self.K, dtype=g), **self.gate_params(params), "lower_bound": self.lb,
                "output_dtype": getattr(self.torch, out)}


def _name(kernel) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(kernel).fn.__name__
