"""The KDA serving spec: a manifest's ``[spec]`` table as a KDA provider receives it, validated and derived.

A manifest's core is ``[target]`` and ``[[kernels]]``; the model and serving envelope is the providers' business.
Both KDA providers (``prewarm_kernels.kda.serving`` and ``prewarm.providers.fla_kda``) and the traffic generators
read it through :func:`read_kda`, the one place that knows its keys and derives what the kernels see (heads per
rank = ``model.kda_heads`` / attention-TP). A bad value raises :class:`SpecError` naming ``spec.<key>``, the value
and what was expected; the planner adds the manifest's path (kernels/ never imports prewarm).

    [spec.model]     kda_heads, head_k_dim, head_v_dim, layers = 1, gate_lower_bound (a number in [-20, 0))
    [spec.parallel]  tensor_parallel = 1, attention_dp = 1 (attention-TP = tensor_parallel / attention_dp)
    [spec.dtypes]    activation = "bfloat16" (q, k, v), gate = the activation dtype(s) (g): a name or a list
    [spec.serving]   prefill = true, decode_batch_buckets = [], draft_widths = [], fused_gate = true,
                     qk_l2norm = true, max_prefill_tokens (a prefill batch's token budget; providers default it)
"""
from __future__ import annotations

from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
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

    def dtypes(self, key: str, default: list[str]) -> list[str]:
        expected = f"one of {', '.join(DTYPES)}, or a non-empty list of distinct ones"
        value = self.get(key, (str, list), expected, default)
        values = [value] if isinstance(value, str) else value
        if not values or len(set(map(str, values))) != len(values) or any(v not in DTYPES for v in values):
            raise SpecError(self.prefix + key, value, expected)
        return list(values)

    def sub(self, key: str) -> "_Table":
        self.used.add(key)
        return _Table(self.table.get(key, {}), f"{self.prefix}{key}.")

    def done(self) -> None:
        extra = sorted(set(self.table) - self.used)
        if extra:
            raise SpecError(self.prefix + extra[0], self.table[extra[0]],
                            f"no such key here (known: {', '.join(sorted(self.used))})")


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
    dtypes = {"activation": activation, "gate": d.dtypes("gate", activation)}
    d.done()

    s = top.sub("serving")
    serving = {
        "prefill": s.switch("prefill", True),
        "decode_batch_buckets": s.ints("decode_batch_buckets"),
        "draft_widths": s.ints("draft_widths"),
        "fused_gate": s.switch("fused_gate", True),
        "qk_l2norm": s.switch("qk_l2norm", True),
        "max_prefill_tokens": s.positive("max_prefill_tokens", None),
    }
    if lower_bound is not None and not serving["fused_gate"]:
        raise SpecError("serving.fused_gate", False, "true when spec.model.gate_lower_bound is set (the bound "
                        "applies to the gate activated in-kernel)")
    s.done()
    top.done()
    return {**target, "heads": heads // attention_tp, "attention_tp": attention_tp, "head_k_dim": head_k_dim,
            "head_v_dim": head_v_dim, "layers": layers,
            "gate_lower_bound": None if lower_bound is None else float(lower_bound),
            "dtype": activation[0], "dtypes": dtypes, **serving}  # fmt: skip
