"""Compile requests as data: the specialization a jit_cache_hook receives (3.2 and 3.4+ layouts) and what a key dir
holds, parsed once into one :class:`Specialization`; the int classes and pointer types closing rewrites them by."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .releases import release

# --- compile requests as data ------------------------------------------------------------------------------------
# The specialization data a jit_cache_hook receives (and ``preload`` takes) is laid out differently in 3.2 (constexprs
# keyed by name, attrs as argument indices) and 3.4+ (constants and attrs keyed by argument path); a key dir holds
# neither, only what compile() stored. Both become one :class:`Specialization` here, so comparing is version-free.


@dataclass(frozen=True)
class Arg:
    """One kernel argument as a compile request fixes it."""

    type: str  # "*bf16", "i32", "fp32"... or "constexpr"
    value: Any = None  # the value compiled in (constexprs, and int arguments Triton specialized to 1 or None)
    attrs: tuple = ()  # ((name, value), ...), e.g. (("tt.divisibility", 16),): an aligned pointer / int % 16 == 0

    def describe(self) -> str:
        """"*bf16 16-byte aligned", "i32 not divisible by 16", "= 64": dtype and specialization class."""
        if self.type == "constexpr":
            return f"= {self.value!r}"
        divisible = ("tt.divisibility", 16) in self.attrs
        if self.type.startswith("*"):
            return f"{self.type} {'16-byte aligned' if divisible else 'not 16-byte aligned'}"
        if self.type[:1] in "iu":
            return f"{self.type} {'divisible by 16' if divisible else 'not 1, not divisible by 16'}"
        return self.type


@dataclass(frozen=True)
class Specialization:
    """A compile request in version-free form: kernel name, arguments in parameter order, compile options.

    Parsed from request data, it also keeps that data, so closing (prewarm.planning.plan) reads its pointer and int arguments
    here and derives the requests Triton makes for other dtypes and int classes from it, without parsing again."""

    name: str  # as Triton records it: "module.qualname" (3.4+), the bare function name (3.2, key dirs)
    args: dict  # parameter name (tuple members "t[0]") -> Arg
    options: dict  # num_warps, num_stages, ... as the request / key dir holds them
    complete: bool = True  # False when rebuilt from a key dir: constexprs and args specialized to 1/None are gone
    context: dict = field(default_factory=dict)  # key dir only: "triton_version" and the env vars set at compile
    data: str = field(default="", compare=False, repr=False)  # the request data it was parsed from ("": a key dir)
    # upstream's layout (3.4+): int classes are read and rewritten by argument path. triton 3.2 keeps ints equal to 1
    # among the constexprs by name: its data is not rewritten (int_classes is empty)
    upstream: bool = field(default=False, compare=False)

    @property
    def function(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def pointers(self) -> dict[str, str]:
        """The pointer parameters (not tuple members) and their types ("*fp32", "*kbf16")."""
        return {n: a.type for n, a in self.args.items() if a.type.startswith("*") and "[" not in n}

    @property
    def int_classes(self) -> dict[str, tuple[str, str]]:
        """The classed int arguments in parameter order, name -> (width, class); one recorded as the constexpr 1 is
        an i32 ``INT_ONE`` (whether the kernel declared it constexpr is the caller's to tell from its params).
        {} for triton 3.2 data."""
        if not self.upstream:
            return {}
        out = {}
        for n, a in self.args.items():
            if "[" in n:
                continue
            if a.type == "constexpr" and a.value == 1:
                out[n] = ("i32", INT_ONE)
            elif a.type in INT_CLASSES:
                out[n] = (a.type, INT_DIVISIBLE if tuple(_DIVISIBLE) in a.attrs else INT_OTHER)
        return out

    def with_pointer_types(self, types: dict[str, str]) -> Specialization:
        """This request with the named pointer parameters of the given types, the rest as is."""
        obj = json.loads(self.data)
        return parse_specialization(json.dumps({**obj, "signature": {**obj["signature"], **types}}))

    def with_int_classes(self, classes: dict[str, tuple[str, str]]) -> Specialization:
        """This request (3.4+: names from :attr:`int_classes`) with the named int arguments in the given (width,
        class), as Triton records a call with such values. The ``key`` (the in-memory cache key) is kept: Triton's
        on-disk key does not read it."""
        obj = json.loads(self.data)
        index = {name: i for i, name in enumerate(obj["signature"])}
        sig = dict(obj["signature"])
        consts = {tuple(k): v for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"])}
        for name, (width, cls) in classes.items():
            path = (index[name],)
            if cls == INT_ONE:
                sig[name], consts[path] = "constexpr", 1
                if release().attrs_for_constexprs:
                    attrs[path] = []
                else:
                    attrs.pop(path, None)
            else:
                sig[name] = width
                consts.pop(path, None)
                attrs[path] = [_DIVISIBLE] if cls == INT_DIVISIBLE else []
        return parse_specialization(json.dumps({**obj, "signature": sig,
                           "constant_keys": [list(k) for k in sorted(consts)], "constant_vals": [consts[k] for k in sorted(consts)],
                           "attrs_keys": [list(k) for k in sorted(attrs)], "attrs_vals": [attrs[k] for k in sorted(attrs)]}))  # fmt: skip


_CONSTEXPR_DICT = "constexpr"


def parse_specialization(data: str, arg_names: Sequence[str] | None = None) -> Specialization:
    """A jit_cache_hook's ``specialization_data`` (either version) as a :class:`Specialization`.

    triton 3.2 lists constexprs apart from the signature and gives attrs by index into the full parameter list;
    ``arg_names`` (the kernel's ``arg_names``) orders them; without it constexprs are assumed to follow the other
    parameters, Triton's usual layout."""
    obj = json.loads(data)
    options = {k: v for k, v in obj.get("options", {}).items()}
    if "constants" in obj:  # 3.2
        sig, constants = obj["signature"], obj["constants"]
        names = list(arg_names) if arg_names else list(sig) + [n for n in constants if n not in sig]
        props = obj.get("attrs", {}).get("arg_properties", {})
        divisible = {names[i] for i in props.get("tt.divisibility", []) if i < len(names)}
        args = {}
        for n in names:
            if n in constants:  # constexprs, and ints equal to 1 (tt.equal_to): a value compiled in
                args[n] = Arg("constexpr", constants[n])
            elif n in sig:
                args[n] = Arg(sig[n], None, (("tt.divisibility", 16),) if n in divisible else ())
        return Specialization(obj["name"], args, options, data=data)
    params = list(obj["signature"].items())
    flat: dict[tuple, tuple[str, str]] = {}  # argument path -> (display name, type)

    def walk(path: tuple, name: str, ty) -> None:
        if isinstance(ty, (list, tuple)):
            for i, t in enumerate(ty):
                walk(path + (i,), f"{name}[{i}]", t)
        else:
            flat[path] = (name, ty)

    for i, (n, ty) in enumerate(params):
        walk((i,), n, ty)
    values = {tuple(k): v for k, v in zip(obj.get("constant_keys", []), obj.get("constant_vals", []))}
    attrs = {tuple(k): tuple(tuple(a) for a in v) for k, v in zip(obj.get("attrs_keys", []), obj.get("attrs_vals", []))}
    args = {}
    for path, (n, ty) in flat.items():
        if ty == "constexpr":
            v = values.get(path)
            args[n] = Arg("constexpr", v.get(_CONSTEXPR_DICT, v) if isinstance(v, dict) else v)
        else:
            args[n] = Arg(ty, None, attrs.get(path, ()))
    return Specialization(obj["name"], args, options, data=data, upstream=True)


# MLIR element types as Triton's signature strings name them
_MLIR_TYPES = {"f16": "fp16", "bf16": "bf16", "f32": "fp32", "f64": "fp64", "f8E4M3FN": "fp8e4nv", "f8E5M2": "fp8e5",
               "f8E4M3FNUZ": "fp8e4b8", "f8E5M2FNUZ": "fp8e5b16", "i1": "i1", "i8": "i8", "i16": "i16", "i32": "i32",
               "i64": "i64"}  # fmt: skip
_TT_FUNC = re.compile(r"tt\.func\s+public\s+@(\w+)\s*\(")
_TT_ARG = re.compile(r"%(\w+)\s*:\s*(!tt\.ptr<(\w+)(?:,\s*\d+)?>|\w+)\s*(\{[^}]*\})?\s*(?:loc\(\"(\w+)\")?")
# compile() stores ``{hash, target, **options, **env_vars}`` plus what the backend adds: not options of the request
_METADATA_NOT_OPTIONS = {"hash", "target", "name", "triton_version", "shared", "tmem_size", "global_scratch_size",
                         "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "tensordesc_meta"}


def read_key_dir(path: str | os.PathLike) -> Specialization | None:
    """The request a key dir was compiled for, as far as Triton stored it (None: not a kernel entry).

    Known: the kernel's function name, its non-constexpr arguments with dtype and divisibility (from the TTIR's
    function signature), the compile options and the cache-invalidating env vars set at compile time (the metadata
    JSON). Not known: the kernel's module, constexpr values, and which arguments were specialized to 1 or None
    (Triton compiles those in and drops them from the signature)."""
    d = Path(path)
    for meta_path in sorted(d.glob("*.json")):
        if meta_path.name.startswith("__grp__") or meta_path.name.endswith(".autotune.json"):
            continue
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or "hash" not in meta or "name" not in meta:
            continue
        ir = next((p for p in (d / f"{meta_path.stem}.ttir", d / f"{meta_path.stem}.source") if p.is_file()), None)
        args = {}
        if ir is not None:
            text = ir.read_text(errors="replace")
            m = _TT_FUNC.search(text)
            if m:
                depth, end = 1, m.end()
                while end < len(text) and depth:
                    depth += {"(": 1, ")": -1}.get(text[end], 0)
                    end += 1
                for a in _TT_ARG.finditer(text[m.end():end]):
                    ssa, ty, pointee, braces, loc_name = a.groups()
                    ty = f"*{_MLIR_TYPES.get(pointee, pointee)}" if pointee else _MLIR_TYPES.get(ty, ty)
                    div = braces and re.search(r"tt\.divisibility\s*=\s*16\b", braces)
                    args[loc_name or ssa] = Arg(ty, None, (("tt.divisibility", 16),) if div else ())
        options = {k: v for k, v in meta.items() if k not in _METADATA_NOT_OPTIONS and not k.isupper()}
        context = {"triton_version": meta.get("triton_version"), "env": {k: v for k, v in meta.items() if k.isupper()}}
        return Specialization(meta["name"], args, options, complete=False, context=context)
    return None


# --- rewriting compile requests -----------------------------------------------------------------------------------
# Closing recorded traffic (plan.py) derives, from one recorded request, the ones Triton makes for other dtypes and
# int classes (Specialization.with_pointer_types / with_int_classes). Triton (3.4+) puts a specialized int argument in
# one of three classes: equal to 1 (compiled in as the constexpr 1), a multiple of 16 (tt.divisibility 16), neither;
# a 1 is an i32, so an i64 is in one of the last two.
INT_ONE, INT_DIVISIBLE, INT_OTHER = "=1", "%16=0", "other"
INT_CLASSES = {"i32": (INT_ONE, INT_DIVISIBLE, INT_OTHER), "i64": (INT_DIVISIBLE, INT_OTHER)}


def int_class(value: int) -> str:
    """The class Triton specializes an int argument's ``value`` on (INT_CLASSES)."""
    return INT_ONE if value == 1 else INT_DIVISIBLE if value % 16 == 0 else INT_OTHER
_DIVISIBLE = ["tt.divisibility", 16]


def pointer_type(dtype: str, const: bool = False) -> str:
    """Triton's signature type for a tensor of the torch dtype named ``dtype``: "*bf16", "*kfp32" (``const``)."""
    import torch
    from triton.runtime.jit import mangle_type  # its second parameter differs between versions: not passed

    return ("*k" if const else "*") + mangle_type(torch.empty(0, dtype=getattr(torch, dtype), device="meta"))[1:]
