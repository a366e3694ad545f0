"""The on-disk cache key and what it is made of: the parts compile() hashes, the key dir's name, and the forms of
key dir names each Triton writes."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from .ascend import ascend_ast_source
from .releases import release
from .runtime import cache_invalidating_env_vars, cache_key_text, jit_function, triton_key

# --- the on-disk cache key and what it is made of --------------------------------------------------------------
# compile() keys a request by sha256(f"{triton_key()}-{src.hash()}-{backend.hash()}-{options.hash()}-{env vars}")
# (:func:`cache_key_text`); src.hash() folds the kernel's ``cache_key`` (its source, starting line, the constexpr
# globals it and its callees read (3.4+), its callees' keys) into the request's signature, constexprs and attrs. A
# recording stores the key and these parts, so a host that cannot reproduce the key can say which part differs.


def ast_source(jit, data: dict):
    """The ASTSource ``JITFunction.preload`` builds from specialization ``data`` (either layout)."""
    if "constant_keys" not in data:  # 3.2 (triton-ascend): constants by name, an AttrsDescriptor
        return ascend_ast_source(jit, data, "3.2")
    import triton.language as tl
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    restores = release().restores_constants
    tuples = convert_to_tuple_if_list if restores else (lambda v: v)

    def value(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(tuples(v["constexpr"]))
        if restores and isinstance(v, dict) and "jit_function" in v:
            from triton.runtime.jit import _triton_jit_function_registry as known  # filled as kernels are defined

            if v["jit_function"] not in known:
                raise RuntimeError(f"Unable to resolve JITFunction {v['jit_function']} for preload")  # as preload
            return known[v["jit_function"]]
        return tuples(v)

    constexprs = {tuple(k): value(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    return ASTSource(jit, signature, constexprs, attrs)


def on_disk(data: str) -> str:
    """The request ``data`` as far as the on-disk key reads it: without the in-memory ``key`` (which repeats the
    launch's own option kwargs), so two requests Triton keeps in one key dir compare equal."""
    obj = json.loads(data)
    obj.pop("key", None)
    return json.dumps(obj, sort_keys=True)


def key_dir_name(digest: str) -> str:
    """The dir name ``get_cache_manager`` keeps a hex key in (3.4+: base32; 3.2: urlsafe base64)."""
    from triton.runtime import cache

    encode = getattr(cache, "_base32", None) or cache._base64
    return encode(digest)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _callees(jit) -> dict[str, dict]:
    """The @jit functions ``jit`` calls directly, as its ``cache_key`` folds them in: "module:qualname" -> their own
    cache_key, starting line and source digest (a callee's key covers its callees)."""
    import inspect

    from triton.runtime import jit as rt

    found: dict[str, dict] = {}

    class Callees(rt.DependenciesFinder):
        def _update_hash(self, func):
            super()._update_hash(func)
            fn = getattr(func, "fn", None)
            if fn is not None and hasattr(func, "cache_key"):
                found[f"{fn.__module__}:{fn.__qualname__}"] = {
                    "cache_key": func.cache_key, "line": func.starting_line_number, "source": _digest(func.src)}

    kwargs = {"name": getattr(jit, "_fn_name", jit.__name__), "globals": jit.__globals__, "src": jit.src}
    if release().knobs:
        kwargs["nonlocals"] = inspect.getclosurevars(jit.fn).nonlocals
    Callees(**kwargs).visit(jit.parse())
    return dict(sorted(found.items()))


_KERNEL_PARTS: dict[int, tuple[str, dict]] = {}  # id(jit) -> (its cache_key, kernel_key_parts): once per kernel


def kernel_key_parts(jit) -> dict:
    """What a kernel puts into every key of it: its ``cache_key`` and what Triton folds into that (source digest,
    starting line, the constexpr globals read, as "name" -> repr of the value, and the direct callees)."""
    from triton.language.core import constexpr

    cache_key = jit.cache_key  # computes used_global_vals too (Triton keeps both for the kernel's life)
    known = _KERNEL_PARTS.get(id(jit))
    if known is not None and known[0] == cache_key:
        return known[1]
    read = {}
    if release().knobs:  # 3.2 only checks the constexpr globals at launch
        read = {name: repr(val.value) for (name, _), (val, _) in jit.used_global_vals.items()
                if isinstance(val, constexpr)}  # fmt: skip
    parts = {"cache_key": cache_key, "source": _digest(jit.src), "line": jit.starting_line_number,
             "globals": dict(sorted(read.items())), "calls": _callees(jit)}
    _KERNEL_PARTS[id(jit)] = (cache_key, parts)
    return parts


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def options_key_view(options) -> dict:
    """A backend's parsed options as their ``hash()`` reads them: name -> value, the libraries in ``extern_libs``
    by their content's digest (CUDAOptions.hash hashes the file, not its path)."""
    out = {}
    for name, value in sorted(options.__dict__.items()):
        if name == "extern_libs" and value:
            value = [[lib, hashlib.sha256(Path(path).read_bytes()).hexdigest() if os.path.isfile(path) else path]
                     for lib, path in sorted(value)]  # fmt: skip
        out[name] = _jsonable(value)
    return out


def cache_key_parts(jit, specialization_data: str, target=None) -> tuple[str, dict]:
    """(key dir, parts): the dir under TRITON_CACHE_DIR that ``compile()`` looks the request up in, in this process
    (this Triton, env vars, kernel source; ``target``: the active driver's by default), and what it composed the
    key of, each part as Triton itself computes it: ``triton`` (version, triton_key digest), ``kernel``
    (:func:`kernel_key_parts`), ``request`` (src.hash(): the kernel's key with the request's signature, constexprs
    and attrs), ``backend`` (backend.hash(); CUDA: ptxas's version text and the arch), ``options`` (options.hash()
    and :func:`options_key_view`) and ``env`` (the cache-invalidating env vars set)."""
    import triton
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver

    data = json.loads(specialization_data)
    jit = jit_function(jit)
    src = ast_source(jit, data)  # as preload rebuilds the request ...
    backend = make_backend(target or driver.active.get_current_target())
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))  # ... and compile() parses it
    env = cache_invalidating_env_vars()
    key = key_dir_name(_digest(cache_key_text(src, backend, options, env)))
    parts = {"triton": {"version": triton.__version__, "digest": triton_key()}, "kernel": kernel_key_parts(jit),
             "request": src.hash(), "backend": str(backend.hash()),
             "options": {"digest": options.hash(), "values": options_key_view(options)},
             "env": dict(sorted(env.items()))}  # fmt: skip
    return key, parts


# Every dir Triton keeps in its cache is named by get_cache_manager(hex digest): the digest's bytes, urlsafe base64 on
# 3.2 (upstream and triton-ascend 3.2: runtime/cache.py _base64), base32 from 3.3 on (_base32; triton-ascend 3.5 as
# well), "=" padding stripped. Its callers hash with sha256 (kernels, cuda_utils/hip_utils and launchers, autotune
# results, triton-ascend's launchers and precompiled header), except triton-ascend's npu_utils (md5 of its source).
# The last character holds the digest's last bits then zero bits, so only some characters can end a key.
_KEY_DIR_FORMS = {  # (encoding, digest bytes): the exact form
    ("base64", 32): r"[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]",
    ("base64", 16): r"[A-Za-z0-9_-]{21}[AQgw]",
    ("base32", 32): r"[A-Z2-7]{51}[AQ]",
    ("base32", 16): r"[A-Z2-7]{25}[AEIMQUY4]",
}
_KEY_DIR_WORDS = {("base64", 32): "urlsafe base64 of a sha256 (43 characters)",
                  ("base64", 16): "urlsafe base64 of an md5 (22 characters: npu_utils)",
                  ("base32", 32): "base32 of a sha256 (52 characters A-Z 2-7)",
                  ("base32", 16): "base32 of an md5 (26 characters: npu_utils)"}


@functools.lru_cache()
def key_dir_form(distribution: str | None, version: str | None) -> tuple[re.Pattern, str]:
    """(a pattern that fullmatches exactly the key dir names that Triton ``distribution`` ``version`` writes, its
    description). Where either is not known: every form Triton 3.2+ writes."""
    encodings = {"base64", "base32"}
    numbers = [int(x) for x in re.findall(r"\d+", version or "")[:2]]
    if len(numbers) == 2:  # 3.3 is not a release prewarm supports: both forms
        encodings = {"base64"} if tuple(numbers) < (3, 3) else {"base32"} if tuple(numbers) > (3, 3) else encodings
    digests = {32} if distribution not in ("triton-ascend", None, "unknown") else {32, 16}
    forms = sorted((e, d) for e in encodings for d in digests)
    return (re.compile("|".join(_KEY_DIR_FORMS[f] for f in forms)),
            " or ".join(_KEY_DIR_WORDS[f] for f in forms) + ", without padding")
