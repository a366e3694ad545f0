"""triton-ascend's differences from upstream Triton, by layout (3.2, 3.5): its specialization data, its cache key's
home and key-dir encoding, its compiler lookup, the front end it runs without CANN, and what its options hold."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .releases import triton_distribution
from .runtime import cache_invalidating_env_vars, cache_key_text

# --- triton-ascend versions ---------------------------------------------------------------------------------------
# Two layouts: "3.2" (triton-ascend 3.2.x, on the registry today: a triton 3.2 core) and "3.5" (its main branch,
# 3.5/3.6: a triton 3.5 core, which fla-core's NPU extra already pins). What differs, read from both sources:
# the specialization data (3.2: "constants" by name and "attrs"/"arg_properties" by index; 3.5: upstream's
# constant_keys/attrs_keys by argument path), the cache key's home and key-dir encoding (3.2: compiler.py,
# urlsafe base64; 3.5: runtime/cache.py get_cache_key, base32), the compiler lookup (3.5 tries the
# bishengir-compile bundled in the wheel first) and what NPUOptions holds (3.5: bisheng_options names libdevice by
# its absolute install path, so the key depends on where triton is installed; compile_on_910_95 read from the
# node's PCI ids / npu-smi, where 3.2.0 hard-codes False).

ASCEND_LAYOUTS = ("3.2", "3.5")
ASCEND_BUNDLED_COMPILER = ("bishengir", "bin", "bishengir-compile")  # under triton/backends/ascend on 3.5+


def ascend_layout(version: str | None = None) -> str:
    """"3.2" or "3.5" for a triton-ascend ``version`` (default: the installed one)."""
    version = version or triton_distribution()[1]
    major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    return "3.5" if (major, minor) >= (3, 5) else "3.2"


def ascend_backend_dir() -> Path | None:
    """triton/backends/ascend of the installed triton-ascend (None: not installed), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "ascend"
    return path if path.is_dir() else None


def ascend_key_dir(digest: str, layout: str | None = None) -> str:
    """The dir ``get_cache_manager`` keeps a hex key in: urlsafe base64 on 3.2 (runtime/cache.py _base64), base32
    on 3.5+ (_base32, as upstream 3.4+)."""
    import base64

    raw = bytes.fromhex(digest)
    if (layout or ascend_layout()) == "3.5":
        return base64.b32encode(raw).decode().rstrip("=")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def ascend_ast_source(jit, data: dict, layout: str | None = None):
    """The ASTSource ``JITFunction.preload`` builds from specialization ``data`` (3.2: constants by name and an
    AscendAttrsDescriptor; 3.5+: constexprs and attrs keyed by argument path, as upstream)."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    def value(v):
        return tl.dtype(v) if isinstance(v, str) and tl.dtype.is_dtype(v) else v

    if (layout or ascend_layout()) == "3.5":
        constexprs = {tuple(k): value(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
        return ASTSource(jit, dict(data["signature"]), constexprs, attrs)
    from triton.backends.ascend.compiler import AscendAttrsDescriptor

    constants = {k: value(v) for k, v in data["constants"].items()}
    return ASTSource(jit, dict(data["signature"]), constants, AscendAttrsDescriptor.from_dict(data["attrs"]))


ASCEND_FRONT_END = ("ast", "ttir", "ttadapter")  # compile()'s stages that run without CANN, in its order


@dataclass
class FrontEnd:
    """compile()'s front end set up for one request: where it keys, with what options, and its stages to run."""

    key_dir: str  # the key dir under TRITON_CACHE_DIR compile() would use for the request
    options: Any  # the backend's parsed options (NPUOptions)
    steps: list  # [(stage name, step)], ASCEND_FRONT_END's present stages in order; step(previous module) -> module


@contextlib.contextmanager
def ascend_front_end(jit, specialization_data: str, target):
    """triton-ascend's ``compile()`` pipeline for exactly the request ``preload(specialization_data)`` compiles, on
    ``target``, as far as it runs without CANN: keyed and staged as compile() does it, the stages left to the caller
    to run in order. The MLIR context lives for the block. The 3.5 layout follows upstream 3.5's compile() (target
    and language passed, codegen per options, no thread pool to stop), read from its source: no 3.5 wheel to run."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    layout = ascend_layout()
    data = json.loads(specialization_data)
    src = ascend_ast_source(jit, data, layout)  # as JITFunction.preload rebuilds the request ...
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    # ... and compile() keys and stages it.
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    env_vars = cache_invalidating_env_vars()
    digest = hashlib.sha256(cache_key_text(src, backend, opts, env_vars).encode()).hexdigest()
    metadata = {"hash": digest, "target": target, **opts.__dict__, **env_vars}
    stages: dict = {}
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    if layout == "3.5":
        import triton

        metadata["triton_version"] = triton.__version__
        backend.add_stages(stages, opts, src.language)
        make_ir_args = (target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    else:
        backend.add_stages(stages, opts)
        make_ir_args = (opts, backend.get_codegen_implementation(), backend.get_module_map(), context)
    # (simt-only kernels have no ttadapter stage: ttir goes straight to bishengir-compile)
    steps = [(ASCEND_FRONT_END[0], lambda _: src.make_ir(*make_ir_args))]
    steps += [(name, lambda m, f=stages[name]: f(m, metadata)) for name in ASCEND_FRONT_END[1:] if name in stages]
    try:
        yield FrontEnd(ascend_key_dir(digest, layout), opts, steps)
    finally:
        if layout == "3.2":
            context.disable_multithreading()  # as compile(): a later fork must not inherit a live thread pool


def ascend_compiler_path(layout: str | None = None, backend_dir: Path | None = None) -> str | None:
    """bishengir-compile as triton-ascend's ``utils._get_npucompiler_path`` resolves it: on 3.5+ the one bundled in
    the wheel first; then PATH; then $TRITON_NPU_COMPILER_PATH/npuc. None where that file does not exist."""
    import shutil

    layout = layout or (ascend_layout() if triton_distribution()[0] == "triton-ascend" else "3.2")
    backend_dir = backend_dir or ascend_backend_dir()
    if layout == "3.5" and backend_dir is not None and backend_dir.joinpath(*ASCEND_BUNDLED_COMPILER).is_file():
        return str(backend_dir.joinpath(*ASCEND_BUNDLED_COMPILER))
    found = shutil.which("bishengir-compile")
    if found is None:
        found = os.path.join(os.environ.get("TRITON_NPU_COMPILER_PATH", ""), "npuc")
    return found if os.path.isfile(found) else None


@functools.lru_cache()
def _ascend_sources(backend_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(backend_dir.rglob("*.py")))


def ascend_reads_env(name: str, backend_dir: Path | None = None) -> bool:
    """Does the installed triton-ascend backend read env var ``name`` at all (TRITON_ENABLE_UBTUNER: not 3.2.0)?"""
    backend_dir = backend_dir or ascend_backend_dir()
    return backend_dir is not None and f'"{name}"' in _ascend_sources(backend_dir)


def ascend_compile_on_910_95() -> bool | None:
    """The 910_95 flag NPUOptions carries (in the key, and switching the pipeline): triton-ascend 3.5+ reads it from
    the node (PCI device 0xd806 or npu-smi); None where the installed release has no detection (3.2.0: False)."""
    import importlib.util

    if triton_distribution()[0] != "triton-ascend" or importlib.util.find_spec("triton.tools.get_ascend_devices") is None:
        return None
    from triton.tools.get_ascend_devices import is_compile_on_910_95

    return bool(is_compile_on_910_95)


def ascend_install_path_in_key(option_defaults: dict | None = None) -> str | None:
    """The install dir NPUOptions' defaults embed (3.5+: bisheng_options = "... <backend>/lib/libdevice.10.bc"), so
    two installs at different paths have different keys; None where the options hold no path (3.2.0)."""
    if option_defaults is None:
        if triton_distribution()[0] != "triton-ascend":
            return None
        from triton.backends.ascend.compiler import NPUOptions

        option_defaults = NPUOptions().__dict__
    paths = [w for w in str(option_defaults.get("bisheng_options") or "").split() if os.path.isabs(w)]
    return paths[0] if paths else None
