"""sglang's ``load_jit`` modules (``sglang.kernels.jit.utils.compile``): built, looked up and watched through sglang's
own compile layer.

``load_jit(*args, **kwargs)`` keys a module twice: a build key over everything known before compiling (the module
args, the source digests, the generated build.ninja text, the target, ``nvcc --version``, ``$CXX --version``, the
versions of apache-tvm-ffi / flashinfer-python / deep_gemm / nvidia-mathdx / torch) selects
``$SGLANG_JIT_CACHE_DIR/<target>/<module>/build-<key>/``; in it a leaf ``deps-<key>/`` is a hit only when re-hashing
every file its ``sgl_deps.json`` lists (each header the compiler read, by anchor: ``kernels``, ``tvm_ffi``,
``pkg:nvidia``, ``toolkit``, ``sitepkgs``, ``sys``) reproduces its name. Everything here runs sglang's code: a build is
a real ``load_jit`` call for the manifest's arch (``override_jit_cuda_arch``), a lookup the same call stopped at its
``find_prebuilt``. sglang memoizes its arch, toolchain, fingerprint and each ops module's loaded module
(``cache_once``) per process, so every entry point here empties those memos before and after (a fresh process's view).

Into each leaf it builds, a build writes ``prewarm-key.json`` (the readable inputs of its build key:
:func:`key_parts`; sglang reads only ``sgl_deps.json`` and the ``.so``), so the leaf carries it wherever it is shipped;
a lookup that finds no build dir for its key compares against it to name the factor that differs.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ...shipping import layouts
from ...errors import BuildError, EnvironmentProblem
from ...jit import JitLibrary, JitRequest, Lookup, nvcc_path, parse_arch

CACHE_VAR = "SGLANG_JIT_CACHE_DIR"
KEY_FILE = "prewarm-key.json"


class _Stopped(Exception):
    """Raised into ``load_jit`` at its cache lookup: nothing past it (load, lock, compile) runs."""


class _Unloaded:
    """What ``load_jit`` returns under :func:`capture_requests`: the module's functions, each doing nothing (a planner
    runs nothing on the GPU)."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr: str):
        return lambda *args, **kwargs: None


def _forget_memos() -> None:
    """Empty every ``cache_once`` memo of sglang's kernel code (arch, toolchain, fingerprint, anchors, each ops
    module's loaded module) and its file-digest memo, so the next call computes them as a fresh process would."""
    from sglang.kernels.jit.utils.common import cache_once
    from sglang.kernels.jit.utils.compile import cache

    memo_code = cache_once(lambda: None).__code__
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("sglang.kernels."):
            continue
        for fn in list(vars(module).values()):
            if getattr(fn, "__code__", None) is memo_code:
                for cell in fn.__closure__ or ():
                    if isinstance(cell.cell_contents, dict):
                        cell.cell_contents.clear()
    cache.clear_digest_cache()


@contextlib.contextmanager
def _session(root: Path | None = None, arch: str | None = None) -> Iterator[None]:
    """sglang's JIT code as a fresh process sees it with ``SGLANG_JIT_CACHE_DIR=root`` (None: as set) targeting
    ``arch`` (None: the GPU torch reports); the memos are emptied again on exit, so nothing computed here stays."""
    try:
        from sglang.kernels.jit.utils.arch import override_jit_cuda_arch
    except ImportError as e:
        raise EnvironmentProblem(f"sglang's JIT compile layer (sglang.kernels.jit.utils) is not importable by "
                                 f"{sys.executable}: {e}") from e

    saved = os.environ.get(CACHE_VAR)
    # sglang warns "Cannot detect CUDA architecture." where no GPU is visible (a build box, a planner, an Ascend
    # host): the arch here is the manifest's or a device profile's, so the warning would only mislead
    arch_log = logging.getLogger("sglang.kernels.jit.utils.arch")
    level = arch_log.level
    arch_log.setLevel(logging.ERROR)
    _forget_memos()
    try:
        if root is not None:
            os.environ[CACHE_VAR] = str(root)
        if arch is None:
            yield
        else:
            major, minor, suffix = parse_arch(arch)
            with override_jit_cuda_arch(major, minor, suffix or None):
                yield
    finally:
        if root is not None:
            if saved is None:
                os.environ.pop(CACHE_VAR, None)
            else:
                os.environ[CACHE_VAR] = saved
        _forget_memos()
        arch_log.setLevel(level)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """sglang runs ``ninja`` from PATH: where none is there, the one the ``ninja`` package installed beside this
    interpreter (a venv's bin, which a test run's PATH may lack). Its version is no part of the key."""
    if shutil.which("ninja"):
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _call(request: JitRequest) -> tuple[tuple, dict]:
    """``load_jit``'s arguments as the call site passed them (JSON turned the wrapper pairs into lists)."""
    kwargs = {k: [tuple(w) for w in v] if k.endswith("_wrappers") and v is not None else v
              for k, v in (request.call.get("kwargs") or {}).items()}
    return tuple(request.call.get("args") or ()), kwargs


def _resolve(request: JitRequest) -> dict:
    """sglang's own resolution of ``request``: ``load_jit`` run up to its cache lookup and stopped there; its
    BuildSpec (``spec``), build-key dir (``scope``) and ``find_prebuilt`` answer (``found``)."""
    from sglang.kernels.jit.utils.compile import loader

    seen: dict = {}
    find = loader._find_prebuilt

    def stop(*, spec, scope):
        seen.update(spec=spec, scope=scope, found=find(spec=spec, scope=scope))
        raise _Stopped

    args, kwargs = _call(request)
    loader._find_prebuilt = stop
    try:
        loader.load_jit(*args, **kwargs)
    except _Stopped:
        pass
    finally:
        loader._find_prebuilt = find
    return seen


def _fingerprint_parts() -> dict[str, str]:
    """What sglang's ``_environment_fingerprint`` hashes, readable (checked against sglang's own hash, so a new
    factor in a later sglang is said instead of missed)."""
    import subprocess
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from sglang.kernels.jit.utils.arch import get_jit_cuda_arch
    from sglang.kernels.jit.utils.compile import cache, toolchain

    target = f"cuda:{get_jit_cuda_arch().target_name}"
    compilers = []
    for path in (toolchain.device_compiler_path(), toolchain.host_compiler_path()):
        try:
            compilers.append(subprocess.check_output([path, "--version"], text=True))
        except (OSError, subprocess.SubprocessError):
            compilers.append("unknown")
    versions = []
    for name in cache._VERSIONED_PACKAGES:
        try:
            versions.append((name, dist_version(name)))
        except (PackageNotFoundError, ValueError):
            versions.append((name, "absent"))
    if cache._hash_parts([target, compilers, versions]) != cache._environment_fingerprint():
        raise RuntimeError("sglang's JIT environment fingerprint hashes more than prewarm.providers.sglang.jit reads "
                           "(target, nvcc/c++ --version, package versions): this sglang is newer than prewarm knows")
    return {"sglang.jit.target": target, "sglang.jit.nvcc": compilers[0].strip(),
            "sglang.jit.cxx": compilers[1].strip(), **{f"sglang.jit.{name}": v for name, v in versions}}


def key_parts(spec) -> dict:
    """The readable inputs of ``spec``'s build key: the fingerprint's factors, each direct source's anchored path
    and digest, the generated build.ninja as the key sees it (roots replaced by their anchors)."""
    from sglang.kernels.jit.utils.compile import cache, ninja

    sources = {":".join(cache._normalize_path(Path(p).resolve())): cache._file_digest(Path(p).resolve())
               for p in sorted(spec.sources)}
    return {"module": spec.module_name, "toolchain": _fingerprint_parts(), "sources": sources,
            "build.ninja": cache._normalize_text(ninja.generate(spec))}


def _differs(here: dict, built: dict) -> str:
    """The first input of the build key that differs between this environment and a build (both :func:`key_parts`)."""
    for name in sorted(set(here["toolchain"]) | set(built["toolchain"])):
        a, b = here["toolchain"].get(name), built["toolchain"].get(name)
        if a != b:
            return f"{name} differs: {_first_difference(a, b)}"
    for name in sorted(set(here["sources"]) | set(built["sources"])):
        if here["sources"].get(name) != built["sources"].get(name):
            return f"source {name} differs"
    if here["build.ninja"] != built["build.ninja"]:
        return f"build.ninja (flags, paths) differs: {_first_difference(here['build.ninja'], built['build.ninja'])}"
    return "the module's wrapper exports differ"


def _first_difference(here: str | None, built: str | None) -> str:
    """The first line that differs between two texts (a compiler's --version, a build.ninja), shortened."""
    a, b = (here or "").splitlines(), (built or "").splitlines()
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def line(lines: list[str], text: str | None) -> str:
        if text is None:
            return "absent"
        s = lines[i] if i < len(lines) else "(no such line)"
        return repr(s if len(s) <= 120 else s[:117] + "...")
    return f"{line(a, here)} here, {line(b, built)} in the build"


def _why_missed(seen: dict) -> str:
    """Why ``find_prebuilt`` found nothing, as sglang would decide it: no build dir for this build key (name the
    factor that differs from a build beside it), or no leaf whose dependencies still hash to its name (name the
    first dependency that changed, as sglang's ``_refresh`` does)."""
    from sglang.kernels.jit.utils.compile import cache
    from sglang.srt.environ import envs

    scope: Path = seen["scope"]
    if envs.SGLANG_JIT_FORCE_RECOMPILE.get():
        return "SGLANG_JIT_FORCE_RECOMPILE is set: sglang rebuilds every module"
    if not scope.is_dir():
        builds = sorted(p.name for p in scope.parent.glob("build-*"))
        if not builds:
            built = sorted(p.parent.name for p in scope.parent.parent.parent.glob(f"*/{scope.parent.name}"))
            where = f" (built for {', '.join(built)})" if built else ""
            return f"no build of {scope.parent.name} for target {scope.parent.parent.name}{where}"
        records = sorted(scope.parent.glob(f"build-*/deps-*/{KEY_FILE}"))
        if not records:
            return f"no build for this build key ({scope.name}; {', '.join(builds)} there, no record of its inputs)"
        here = key_parts(seen["spec"])
        return f"no build for this build key ({scope.name}): " + _differs(here, json.loads(records[-1].read_text()))
    leaves = sorted(scope.glob("deps-*"))
    for leaf in leaves:
        entries = cache._read_deps(leaf)
        if entries is None:
            continue
        current, changed = cache._refresh(entries)
        if current is None:
            return f"dependency {changed[0]} (recorded in {leaf.name}) is not here"
        if changed:
            return f"dependency {changed[0]} differs from the build's ({leaf.name})"
        if not (leaf / f"{seen['spec'].module_name}.so").is_file():
            return f"{leaf.name} has no {seen['spec'].module_name}.so"
    return f"{scope} has no leaf with a dependency list" if leaves else f"{scope} has no built leaf"


def _lookups(requests: list[JitRequest]) -> list[Lookup]:
    out = []
    for request in requests:
        seen = _resolve(request)
        found = seen["found"]
        out.append(Lookup(request, True, str(found)) if found is not None else
                   Lookup(request, False, None, _why_missed(seen)))
    return out


def _caller(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


def _request(args: tuple, kwargs: dict, origin: str) -> JitRequest:
    from sglang.kernels.jit.utils.compile.spec import BuildSpec

    module_args = tuple(str(a) for a in args)  # as load_jit does
    # the name as sglang derives it (BuildSpec.module_name: a function of the args alone)
    name = BuildSpec(module_args, (), (), (), (), (), (), (), (), True).module_name
    call = {"args": list(module_args), "kwargs": json.loads(json.dumps(kwargs))}
    return JitRequest("sglang", name, call, origin)


@contextlib.contextmanager
def capture_requests(arch: str | None = None) -> Iterator[list[JitRequest]]:
    """While active, every ``load_jit`` call sglang's kernel code makes is recorded (one :class:`JitRequest` per
    module, in call order) and answered by a stand-in module whose functions do nothing: nothing is built or loaded.
    ``arch``: the GPU to resolve for (None: the one torch reports, e.g. a device profile's). The modules' memos are
    emptied on entry and exit, so each module getter calls ``load_jit`` again here and keeps no stand-in after."""
    import sglang.kernels.jit.utils as utils
    from sglang.kernels.jit.utils import compile as jit_compile
    from sglang.kernels.jit.utils.compile import loader

    real = loader.load_jit
    captured: list[JitRequest] = []

    def recording(*args, **kwargs):
        request = _request(args, kwargs, _caller())
        if request not in captured:
            captured.append(request)
        return _Unloaded(request.name)

    def binding(fn) -> list:  # the modules holding fn as load_jit (bound by name into each ops module)
        return [m for name, m in list(sys.modules.items())
                if m is not None and name.startswith("sglang.") and getattr(m, "load_jit", None) is fn]

    # and where a module imported during the block binds it from
    for module in {*binding(real), utils, jit_compile}:
        module.load_jit = recording
    try:
        with _session(None, arch):
            yield captured
    finally:
        for module in binding(recording):
            module.load_jit = real


# sglang's ``load_jit`` cache (sglang/kernels/jit/utils/compile/cache.py)::
#
#     <root>/<target>/<module_name>/build-<16 hex>/deps-<16 hex>/{sgl_deps.json, <module_name>.so}
#
# An entry is one such leaf (sglang's ninja build dir, renamed: its sources, build file and objects too), its key the
# path under the root ("sm90a/sgl_kernel_jit_x/build-.../deps-..."); sglang's own ``.lock`` and ``.staging-<uuid>``
# beside the leaves are neither entries nor reported. A leaf is published by one rename, as sglang itself does. The
# node's dir: ``SGLANG_JIT_CACHE_DIR``, else ``~/.cache/sglang/jit``.
#
# What sglang loads (``loader``): ``load_jit`` computes ``<root>/<_target_tag()>/<module_name>/build-<build_key>``
# (``cache.build_key_dir``; every part a path, links followed) and ``cache.find_prebuilt`` scans it for names
# starting with ``deps-``, newest mtime first, taking the first whose ``sgl_deps.json`` (read through any link)
# re-hashes to its name (``deps-`` + 16 hex: no other name can match) and whose ``<module_name>.so`` is a file.
# ``_target_tag()`` is ``sm``/``mp`` + the arch, a HIP gfx name, ``sail_`` + [alnum -_.] or ``unknown``;
# ``module_name`` is ``sgl_kernel_jit_`` + the module's args joined by ``_``, each ``str()`` of what the call site
# passed: any character but ``/``, any length (prewarm's own ``parts`` are the names it ships).
LAYOUT = layouts.Layout(
    "sglang-jit",
    (re.compile(r"[A-Za-z0-9_]{1,32}"), re.compile(r"sgl_kernel_jit_[A-Za-z0-9_.+-]{1,200}"),
     re.compile(r"build-[0-9a-f]{16}"), re.compile(r"deps-[0-9a-f]{16}")),
    "<target>/sgl_kernel_jit_<module>/build-<16 hex>/deps-<16 hex>", CACHE_VAR, "~/.cache/sglang/jit",
    True, own_names=re.compile(r"\.lock|\.staging-.*"),
    loader=(re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), re.compile(r"sgl_kernel_jit_.*"),
            re.compile(r"build-[0-9a-f]{16}"), re.compile(r"deps-[0-9a-f]{16}")),
    loads="{key}/{1}.so", reader="sglang's find_prebuilt")


class SglangJit(JitLibrary):
    name = "sglang"
    cache_layout = LAYOUT
    env_var = CACHE_VAR
    hook_module = "sglang.kernels.jit.utils.compile.ninja"
    target_factor = "sglang.jit.target"
    stamp_code = ("sglang.kernels.jit",)
    env_prefixes = ("SGLANG_", "TVM_", "CXX")

    def compilers(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """nvcc (as ``toolchain.device_compiler_path``) and the host compiler: $CXX, else ``c++`` (as
        ``toolchain.host_compiler_path``), as PATH resolves a bare name."""
        cxx = environ.get("CXX", "c++")
        return [nvcc_path(environ), shutil.which(cxx, path=environ.get("PATH")) or cxx]

    def node_dir(self, environ: Mapping[str, str] = os.environ) -> Path:
        """As sglang's ``cache.cache_root``: ``$SGLANG_JIT_CACHE_DIR``, else ``~/.cache/sglang/jit`` (the layout's)."""
        return self.cache_layout.node_dir(environ)

    def toolchain(self, arch: str) -> dict[str, str]:
        with _session(None, arch):
            return _fingerprint_parts()

    def build(self, requests: list[JitRequest], root: Path, arch: str) -> list[Lookup]:
        """Each request's ``load_jit`` call replayed with ``SGLANG_JIT_CACHE_DIR=root`` for ``arch``: sglang keys,
        compiles (nvcc through its ninja file), loads (tvm_ffi: needs no GPU) and publishes the leaf itself."""
        from sglang.kernels.jit.utils.compile import loader

        root = Path(root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        with _session(root, arch), _ninja_on_path():
            for request in requests:
                args, kwargs = _call(request)
                try:
                    loader.load_jit(*args, **kwargs)
                except Exception as e:
                    raise BuildError(f"sglang JIT module {request.name} ({request.origin or 'load_jit'}) did not build "
                                     f"for {arch}: {e}") from e
                seen = _resolve(request)
                if seen["found"] is not None:  # whole or absent, as every file a lookup reads
                    record = Path(seen["found"]).parent / KEY_FILE
                    record.with_name(KEY_FILE + ".part").write_text(json.dumps(key_parts(seen["spec"]), indent=1))
                    os.replace(record.with_name(KEY_FILE + ".part"), record)
            return _lookups(requests)

    def lookup(self, requests: list[JitRequest], root: Path, arch: str | None = None) -> list[Lookup]:
        with _session(Path(root).resolve(), arch):
            return _lookups(requests)

    def watch_builds(self, on_build: Callable[[str, str], None]) -> None:
        """Hooks sglang's ``ninja.build`` (``load_jit`` calls it on a miss, after its locked re-check): ``on_build``
        runs before the compiler; an exception from it leaves ``load_jit`` with nothing built or published."""
        from sglang.kernels.jit.utils.compile import ninja

        build = getattr(ninja.build, "__wrapped__", ninja.build)

        def watched(*, spec, build_dir, build_file):
            on_build(spec.module_name, f"sglang load_jit: no usable build under {Path(build_dir).parent}")
            return build(spec=spec, build_dir=build_dir, build_file=build_file)

        watched.__wrapped__ = build
        ninja.build = watched
