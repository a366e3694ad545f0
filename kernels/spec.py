"""The KDA serving spec: a manifest's ``[spec]`` table as a KDA provider receives it, validated and derived.

A manifest's core is ``[target]`` and ``[[kernels]]``; the model and serving envelope is the providers' business.
Both KDA providers (``prewarm_kernels.kda.serving`` and ``prewarm.providers.fla.kda``) and the traffic generators
read it through :func:`read_kda`, the one place that knows its keys and derives what the kernels see (heads per
rank = ``model.kda_heads`` / attention-TP). A bad value raises :class:`SpecError` naming ``spec.<key>``, the value
and what was expected; the planner adds the manifest's path (kernels/ never imports prewarm).

    [spec.model]     kda_heads, head_k_dim, head_v_dim, layers = 1, gate_lower_bound (a number in [-20, 0))
    [spec.parallel]  tensor_parallel = 1, attention_dp = 1 (attention-TP = tensor_parallel / attention_dp)
    [spec.dtypes]    activation = "bfloat16" (q, k, v), gate = the activation dtype(s) (g): a name or a list
    [spec.serving]   prefill = true, decode_batch_buckets = [], draft_widths = [], fused_gate = true,
                     qk_l2norm = true, max_prefill_tokens (a prefill batch's token budget; providers default it),
                     max_running_requests (a server's cap on concurrent requests: eager decode batches up to it)

fla-core's call options (read for ``prewarm.providers.fla.kda`` and its test traffic; this project's own kernels have
no such switches, their wrappers canonicalize, and their provider refuses them: :func:`fla_only_key`): each ``[spec.serving]`` key of :data:`FLA_CALL_OPTIONS` is a list of
the values to plan (default: see the table), ``[spec.dtypes]`` beta, gate_params (A_log and dt_bias), state (a
recurrent call's initial state or pool) and index (cu_seqlens, state indices, accepted-token counts), and
``[spec.model]`` scale (a number or a list; fla's default head_k_dim ** -0.5) and allow_neg_eigval = false.
"""
from __future__ import annotations

from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
INDEX_DTYPES = ("int32", "int64")
# spec.serving key -> (every value fla-core 0.6.0's KDA accepts, the values planned when the manifest does not say):
# every value, except the switches of fla's schedule and state layout (chunk size, CUDA-graph mode, recompute, state
# layout), planned at fla's own default unless listed. What each changes in fla: prewarm.providers.fla.kda.
FLA_CALL_OPTIONS = {
    "initial_state": ((False, True), (False, True)),
    "final_state": ((False, True), (False, True)),
    "varlen": ((False, True), (False, True)),
    "recurrent_state": (("returned", "in_place", "indexed", "indexed_spec"),) * 2,
    "gate_in_kernel": ((True, False),) * 2,
    "qk_l2norm_in_kernel": ((True, False),) * 2,
    "beta_sigmoid_in_kernel": ((False, True),) * 2,
    "safe_gate": ((False, True),) * 2,
    "disable_recompute": ((False, True), (False,)),
    "state_v_first": ((False, True), (False,)),
    "chunk_size": ((64, 32), (64,)),
    "use_graph": ((False, True), (False,)),
}
FLA_ONLY = {"serving": tuple(FLA_CALL_OPTIONS), "dtypes": ("beta", "gate_params", "state", "index"),
            "model": ("scale", "allow_neg_eigval")}  # the keys only fla's calls have
FLA_RULED_OUT = {  # the options a model rules out (only false remains), and why
    "gate_in_kernel": "spec.serving.fused_gate = false (g is already the decay)",
    "qk_l2norm_in_kernel": "spec.serving.qk_l2norm = false (the model does not normalize q, k)",
    "safe_gate": "fla's safe gate needs spec.model.gate_lower_bound in [-5, 0)",
}
TARGET_KEYS = ("backend", "arch", "device")  # what the planner adds to the manifest's [spec] table


class SpecError(ValueError):
    """A spec value a provider cannot plan: ``key`` is its dotted path under ``spec``."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        what = "is missing" if value is ... else f"= {value!r}"
        super().__init__(f"spec.{key} {what}: expected {expected}")


class _Table:
    """Typed reads of one table of the spec; ``done`` refuses keys nothing read (a typo is an error)."""

    def __init__(self, table: Any, prefix: str):
        if not isinstance(table, dict):
            raise SpecError(prefix.rstrip("."), table, "a table")
        self.table, self.prefix, self.used = table, prefix, set()

    def get(self, key: str, types: type | tuple, expected: str, default: Any = ..., check=None) -> Any:
        self.used.add(key)
        if key not in self.table:
            if default is ...:
                raise SpecError(self.prefix + key, ..., expected)
            return default
        value = self.table[key]
        allowed = types if isinstance(types, tuple) else (types,)
        if (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
                or (check is not None and not check(value))):
            raise SpecError(self.prefix + key, value, expected)
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        return self.get(key, int, "a positive integer", default, check=lambda v: v > 0)

    def switch(self, key: str, default: bool) -> bool:
        return self.get(key, bool, "true or false", default)

    def ints(self, key: str) -> list[int]:
        expected = "a list of distinct positive integers"
        values = self.get(key, list, expected, [])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) or \
                len(set(values)) != len(values):
            raise SpecError(self.prefix + key, values, expected)
        return values

    def dtypes(self, key: str, default: list[str], names: tuple = DTYPES) -> list[str]:
        expected = f"one of {', '.join(names)}, or a non-empty list of distinct ones"
        value = self.get(key, (str, list), expected, default)
        values = [value] if isinstance(value, str) else value
        if not values or len(set(map(str, values))) != len(values) or any(v not in names for v in values):
            raise SpecError(self.prefix + key, value, expected)
        return list(values)

    def choices(self, key: str, accepted: tuple, default: tuple) -> list:
        """A non-empty list of distinct values out of ``accepted`` (``default`` when absent), in accepted's order."""
        expected = f"a non-empty list of distinct values out of {_toml(accepted)}"
        values = self.get(key, list, expected, list(default))
        if not values or any(type(v) is not type(accepted[0]) or v not in accepted for v in values) or \
                len(set(values)) != len(values):
            raise SpecError(self.prefix + key, values, expected)
        return [v for v in accepted if v in values]

    def sub(self, key: str) -> "_Table":
        self.used.add(key)
        return _Table(self.table.get(key, {}), f"{self.prefix}{key}.")

    def done(self) -> None:
        extra = sorted(set(self.table) - self.used)
        if extra:
            raise SpecError(self.prefix + extra[0], self.table[extra[0]],
                            f"no such key here (known: {', '.join(sorted(self.used))})")


def _toml(values: tuple) -> str:
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"') for v in values) + "]"


def read_kda(spec: dict) -> dict:
    """``spec`` (the target's backend / arch / device and the manifest's ``[spec]`` table) -> what the KDA call
    builders plan over: heads per rank, head dims, dtypes per role (``dtype``: the first activation dtype), the
    gate's lower bound, the serving switches, decode buckets, draft widths, the prefill token budget."""
    top = _Table(spec, "")
    target = {key: top.get(key, (str, type(None)), "a string", None) for key in TARGET_KEYS}

    m = top.sub("model")
    heads, head_k_dim, head_v_dim = m.positive("kda_heads"), m.positive("head_k_dim"), m.positive("head_v_dim")
    layers = m.positive("layers", 1)
    lower_bound = m.get("gate_lower_bound", (int, float), "a number in [-20, 0) or absent", None,
                        check=lambda v: -20 <= v < 0)
    scale = m.get("scale", (int, float, list), "a positive number or a non-empty list of distinct ones",
                  [head_k_dim ** -0.5], check=lambda v: _positive_numbers([v] if not isinstance(v, list) else v))
    allow_neg_eigval = m.switch("allow_neg_eigval", False)
    m.done()

    p = top.sub("parallel")
    tp, dp = p.positive("tensor_parallel", 1), p.positive("attention_dp", 1)
    if tp % dp:
        raise SpecError("parallel.attention_dp", dp, f"a divisor of spec.parallel.tensor_parallel = {tp} "
                        "(attention-TP = tensor_parallel / attention_dp)")
    attention_tp = tp // dp
    if heads % attention_tp:
        raise SpecError("model.kda_heads", heads, f"a multiple of attention-TP {attention_tp} (spec.parallel."
                        f"tensor_parallel {tp} / attention_dp {dp}): the heads divide over the attention ranks")
    p.done()

    d = top.sub("dtypes")
    activation = d.dtypes("activation", ["bfloat16"])
    with_fp32 = list(dict.fromkeys([*activation, "float32"]))
    dtypes = {"activation": activation, "gate": d.dtypes("gate", activation), "beta": d.dtypes("beta", with_fp32),
              "gate_params": d.dtypes("gate_params", with_fp32), "state": d.dtypes("state", ["float32"]),
              "index": d.dtypes("index", list(INDEX_DTYPES), INDEX_DTYPES)}
    d.done()

    s = top.sub("serving")
    serving = {
        "prefill": s.switch("prefill", True),
        "decode_batch_buckets": s.ints("decode_batch_buckets"),
        "draft_widths": s.ints("draft_widths"),
        "fused_gate": s.switch("fused_gate", True),
        "qk_l2norm": s.switch("qk_l2norm", True),
        "max_prefill_tokens": s.positive("max_prefill_tokens", None),
        "max_running_requests": s.positive("max_running_requests", None),
    }
    if lower_bound is not None and not serving["fused_gate"]:
        raise SpecError("serving.fused_gate", False, "true when spec.model.gate_lower_bound is set (the bound "
                        "applies to the gate activated in-kernel)")
    accepted = fla_accepted(serving["fused_gate"], serving["qk_l2norm"], lower_bound)
    calls = {}
    for key, (values, default) in FLA_CALL_OPTIONS.items():
        if accepted[key] != values and key in s.table and s.table[key] != [False]:  # the model rules true out
            raise SpecError(f"serving.{key}", s.table[key], f"[false]: {FLA_RULED_OUT[key]}")
        calls[key] = s.choices(key, accepted[key], tuple(v for v in default if v in accepted[key]))
    s.done()
    top.done()
    return {**target, "heads": heads // attention_tp, "attention_tp": attention_tp, "head_k_dim": head_k_dim,
            "head_v_dim": head_v_dim, "layers": layers,
            "gate_lower_bound": None if lower_bound is None else float(lower_bound),
            "dtype": activation[0], "dtypes": dtypes, **serving, "calls": calls,
            "scale": [float(v) for v in (scale if isinstance(scale, list) else [scale])],
            "allow_neg_eigval": allow_neg_eigval}  # fmt: skip


def _positive_numbers(values: list) -> bool:
    return bool(values) and len(set(values)) == len(values) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)


def fla_only_key(spec: dict) -> tuple[str, Any] | None:
    """The first of fla-core's call options ``spec`` sets, as (``"serving.final_state"``, its value), or None: a
    provider of other kernels refuses it rather than ignore it."""
    for table, keys in FLA_ONLY.items():
        given = spec.get(table)
        for key in keys:
            if isinstance(given, dict) and key in given:
                return f"{table}.{key}", given[key]
    return None


def fla_accepted(fused_gate: bool, qk_l2norm: bool, lower_bound) -> dict[str, tuple]:
    """Each fla call option's values fla accepts for this model: in-kernel gate activation only for a raw (fused)
    gate, in-kernel q/k L2 norm only for a model that normalizes them, safe gate only with a bound in [-5, 0)."""
    out = {key: values for key, (values, _) in FLA_CALL_OPTIONS.items()}
    ruled_out = {"gate_in_kernel": not fused_gate, "qk_l2norm_in_kernel": not qk_l2norm,
                 "safe_gate": lower_bound is None or not -5 <= lower_bound < 0}
    return {**out, **{key: (False,) for key, no in ruled_out.items() if no}}
