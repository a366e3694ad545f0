"""Ascend (triton-ascend): targets, the runtime modules triton-ascend builds at first launch, node checks.

- :class:`NpuOfflineDriver`: the smallest driver triton-ascend's JIT needs to bind and specialize a call (target,
  device 0, stream 0) on a machine without an NPU, installed only by :func:`activate_offline`. ``plan`` and
  ``lower`` run through it.
- :class:`NpuTarget` (mode "device"): on a node with torch_npu, CANN and an NPU, one compile-only launch
  (TRITON_COMPILE_ONLY=1) per planned compile, on minimal tensors. Unlike ``preload``, a launch also builds the
  per-signature launcher ``.so``, ``npu_utils.so`` and the precompiled header into the cache dir, so the first
  real launch on a node compiles nothing. Before its first compile a worker claims the cache dir for this
  node's toolchain (``CacheDir.claim_toolchain``): Triton's key would reuse kernels of another CANN silently.
- :class:`NpuOfflineTarget` (mode "offline"): a build host with the CANN toolkit and no NPU compiles the kernel
  binaries for the manifest's SoC; the node builds launchers, npu_utils and the header.
- :func:`probe_modules`: are the launchers, ``npu_utils`` and the precompiled header in a cache dir (triton-ascend's
  own constructors asked).
- SoCs (``socs``, ``for_soc``, ``node_soc``): ``[target] arch`` may list several; every key contains the SoC.
- :func:`serving_env_mismatches` / :func:`check_serving_env`: the serving process's codegen env against the
  installed bundles' (the guard runs it when it arms).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ... import devices
from ...node import fingerprint
from .. import tritoncompat
from ...shipping.cachedir import CacheDir
from ...planning.plan import resolve
from ...errors import BuildError, EnvironmentProblem, FingerprintMismatch
from .target import Target

# Files triton-ascend writes into TRITON_CACHE_DIR besides the kernels, at the first launch of each signature:
# npu_utils.so (key: md5 of npu_utils.cpp), precompiled.h(.gch) (key: _precompile_npu_hash of the header text, the
# C++ compiler path, sys.version, torch / torch_npu versions, ASCEND_HOME_PATH's last component) and one launcher per
# kernel signature (key: sha256 of the generated wrapper source: signature, AI-core count, TRITON_DEVICE_PRINT /
# TRITON_ENABLE_TASKQUEUE / TRITON_GRID_WARN_PRINT / TRITON_ALL_BLOCKS_PARALLEL).
LAUNCHER_GLOB = "launcher_cxx11abi*"
UTILS_FILE = "npu_utils.so"
HEADER_FILES = ("precompiled.h", "precompiled.h.gch")
RUNTIME_FILES = (UTILS_FILE, HEADER_FILES[0])
TENSOR_DEVICE = "npu"  # where minimal launch tensors live (torch_npu's device)
_CLAIMED: set[str] = set()  # cache dirs this process checked against its toolchain


class NpuOfflineDriver(devices.OfflineDriver):
    """Target-only driver: lets ``warmup``/``preload`` bind, specialize and run the front end without an NPU."""

    def __init__(self, arch: str):
        super().__init__("npu", arch, 0)  # warp_size 0, as triton-ascend's NPUDriver says

    def get_benchmarker(self):
        """triton 3.2's Autotuner asks for it when decorating (at import), so a module with @autotune kernels
        imports only under an active driver; benchmarking itself needs the device."""

        def no_device(*args, **kwargs):
            raise EnvironmentProblem("autotune benchmarking needs an NPU: on Ascend, launch raw kernels with pinned "
                                     "configs (or build on a node)")

        return no_device


def activate_offline(arch: str, device_profile: str | None = None) -> None:
    """The one place an Ascend process gets its target-only driver: Triton binds and specializes for ``npu``/``arch``
    (no device needed), device queries answer as ``device_profile`` (a :mod:`prewarm.devices` name). Idempotent."""
    if tritoncompat.triton_distribution()[0] != "triton-ascend":
        raise EnvironmentProblem(
            f"backend npu needs triton-ascend (this environment's `triton` comes from "
            f"{tritoncompat.triton_distribution()[0]!r}); run it in the Ascend env (.ci/ascend-env)"
        )
    from triton.runtime.driver import driver

    current = tritoncompat.chosen_driver()
    if not (isinstance(current, NpuOfflineDriver) and current.target.arch == arch):
        driver.set_active(NpuOfflineDriver(arch))
    if device_profile:
        devices.activate(devices.lookup(device_profile, "target"))


def activate_for_planning(arch: str, device_profile: str | None) -> None:
    """A process that only plans: under triton-ascend the target-only driver (triton 3.2's Autotuner asks the
    active driver for a benchmarker when a kernel module is imported); elsewhere nothing (it cannot bind)."""
    if tritoncompat.triton_distribution()[0] == "triton-ascend":
        activate_offline(arch, device_profile)


def auto_mode() -> str:
    return "device"


@contextlib.contextmanager
def prints_to_stderr():
    """triton-ascend prints advice to stdout whenever it binds a call ("[WARNING] Please DO NOT tune args..."):
    within the block it goes to stderr, so a command's stdout stays one JSON document."""
    if tritoncompat.triton_distribution()[0] != "triton-ascend":
        yield
        return
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        yield


def ub_size(arch: str) -> int:
    """Bytes of unified buffer (UB) per core on ``arch``, as triton-ascend's own tile generator takes it
    (third_party/ascend/backend/runtime/utils.py on its main branch: 192 KB, 256 KB on Ascend910_95* / Ascend950*)."""
    return (256 if arch.startswith(("Ascend910_95", "Ascend950")) else 192) * 1024


def socs(manifest) -> tuple[str, ...]:
    """The SoCs an npu manifest targets: ``[target] arch`` may list several (an A3 fleet mixes SKUs)."""
    return tuple(getattr(manifest, "archs", None) or (manifest.arch,))


def for_soc(manifest, soc: str):
    """``manifest`` narrowed to one of its SoCs: what one cache dir (and bundle) is built for. Where the manifest
    lists several, the name says the SoC: each SoC's bundle has its own name in a store."""
    import dataclasses

    narrowed = {"arch": soc, **({"archs": (soc,)} if hasattr(manifest, "archs") else {})}
    if len(socs(manifest)) > 1:
        narrowed["name"] = f"{manifest.name}-{soc}"
    return dataclasses.replace(manifest, **narrowed)


def node_soc(manifest) -> str:
    """The SoC this node compiles for as triton-ascend's own driver says (TRITON_ASCEND_ARCH, else the device),
    which must be one of the manifest's. Fails closed (FingerprintMismatch) where the node cannot tell: every key
    contains the SoC, so a guess would check the wrong keys."""
    from triton.runtime.driver import driver

    try:
        soc = driver.active.get_current_target().arch
    except Exception as e:
        soc, why = fingerprint.UNKNOWN, f"{type(e).__name__}: {e}"
    else:
        why = "the driver reports no SoC"
    if not soc or soc == fingerprint.UNKNOWN:
        raise FingerprintMismatch(
            f"target.arch: this node's Ascend SoC is unknown ({why}): every cache key contains it, so which kernels "
            f"the node would look up cannot be checked: {fingerprint.NODE_CAN_STATE['npu', 'target.arch']}")
    if soc not in socs(manifest):
        raise FingerprintMismatch(f"target.arch: this node's SoC is {soc}, which {manifest.path} does not target "
                                  f"({', '.join(socs(manifest))}): every kernel would miss")
    return soc


# --- compile-only launches ---------------------------------------------------------------------------------------

_TORCH_DTYPES = {
    "fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i1": "bool", "i8": "int8",
    "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "fp8e5": "float8_e5m2",
    "fp8e4nv": "float8_e4m3fn",
}  # fmt: skip
# Scalar values that reproduce each specialization ('D': multiple of 16, 'N': neither; 1 is compiled in).
_INTS = {"i32": {"D": 16, "N": 3}, "i64": {"D": 2**32, "N": 2**32 + 3}, "u64": {"D": 2**63, "N": 2**63 + 3}}
_FLOATS = ("fp16", "bf16", "fp32", "fp64")
# Fields of the specialization data that make up the on-disk cache key (besides the kernel's source).
KEY_FIELDS = ("signature", "constants", "attrs", "options")


def launch_arguments(fn, specialization_data: str, device: str) -> tuple[list, dict]:
    """Minimal positional args + keyword args whose launch makes exactly the compile ``specialization_data``
    describes (either layout: tritoncompat.parse_specialization)."""
    import torch
    import triton.language as tl

    spec = tritoncompat.parse_specialization(specialization_data, fn.arg_names)
    args, kwargs = [], {}
    for p in fn.params:
        arg = spec.args[p.name]
        value = tl.dtype(arg.value) if isinstance(arg.value, str) and tl.dtype.is_dtype(arg.value) else arg.value
        if p.is_constexpr:
            kwargs[p.name] = value
            continue
        if arg.type == "constexpr":  # an int specialized to 1, or None: the value is compiled in
            args.append(value)
            continue
        ty = "*" + arg.type[2:] if arg.type.startswith("*k") else arg.type  # "*k": const pointer
        divisible = ("tt.divisibility", 16) in arg.attrs
        if ty.startswith("*"):
            base = torch.empty(32, dtype=getattr(torch, _TORCH_DTYPES[ty[1:]]), device=device)  # 512-byte aligned
            args.append(base if divisible else base[1:])  # one element in: not 16-byte aligned
        elif ty == "i1":
            args.append(not divisible)
        elif ty in _INTS:
            args.append(_INTS[ty]["D" if divisible else "N"])
        elif ty in _FLOATS:
            args.append(0.5)
        else:
            raise BuildError(f"{spec.name}: argument {p.name} has type {arg.type!r}, which a compile-only launch "
                             f"cannot stand in for")
    return args, kwargs


def option_kwargs(options: dict) -> dict:
    """The launch keywords that reproduce ``options``: every field that differs from triton-ascend's default."""
    from triton.backends.ascend.compiler import NPUOptions

    defaults = json.loads(json.dumps(NPUOptions().__dict__))
    out = {}
    for key, value in options.items():
        if key in ("debug", "stream") or defaults.get(key) == value:
            continue
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _check_build_host(advice: str) -> None:
    """What an Ascend build needs before any compile: the .npubin kept, and CANN's compiler (``advice``: how)."""
    if os.environ.get("TRITON_STORE_BINARY_ONLY"):
        raise EnvironmentProblem("TRITON_STORE_BINARY_ONLY is set: on Ascend it drops the .npubin; unset it")
    if fingerprint.bishengir_path() is None:
        raise EnvironmentProblem(f"bishengir-compile not found (PATH, then $TRITON_NPU_COMPILER_PATH/npuc): {advice}")


def _claim_once(target: Target) -> None:
    """Before this process's first compile into the active cache dir: never add to a dir of another toolchain."""
    cache_dir = tritoncompat.cache_dir()
    if cache_dir not in _CLAIMED:
        CacheDir(cache_dir).claim_toolchain(target.toolchain())
        _CLAIMED.add(cache_dir)


@dataclass
class NpuTarget(Target):
    """An Ascend node: TRITON_COMPILE_ONLY launches through triton-ascend's own driver (launchers included)."""

    mode: ClassVar[str] = "device"

    def activate(self) -> None:
        """The node's own driver: it must compile for the manifest's SoC."""
        from triton.runtime.driver import driver

        try:
            arch = driver.active.get_current_target().arch
        except Exception as e:
            raise EnvironmentProblem(f"npu device mode: no usable NPU driver ({type(e).__name__}: {e})") from e
        if arch != self.arch:
            raise EnvironmentProblem(f"npu device mode: the manifest targets {self.arch} but this node's NPU "
                                     f"compiles for {arch} (device SoC or TRITON_ASCEND_ARCH)")

    def prepare_build(self) -> None:
        _check_build_host("source the CANN toolkit's set_env.sh first")
        os.environ["TRITON_COMPILE_ONLY"] = "1"

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """One compile-only launch that must reproduce ``specialization_data`` exactly (checked via the hook)."""
        _claim_once(self)
        jit = tritoncompat.jit_function(fn)
        wanted = json.loads(specialization_data)
        args, kwargs = launch_arguments(jit, specialization_data, TENSOR_DEVICE)
        with tritoncompat.compile_requests(skip=False) as seen:
            kernel = jit[(1, 1, 1)](*args, **kwargs, **option_kwargs(wanted["options"]))
        got = json.loads(seen[-1]) if seen else None
        differs = [f for f in KEY_FIELDS if got is None or got[f] != wanted[f]]
        if differs:
            raise BuildError(f"{wanted['name']}: the compile-only launch made a different request than planned "
                             f"({', '.join(differs)} differ): planned {wanted}, launched {got}")
        return kernel

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str, compiles: list) -> list[str]:
        """Check the runtime files the first real launch would otherwise build are in the cache dir; record the
        toolchain the dir now belongs to."""
        CacheDir(cache_dir).claim_toolchain(self.toolchain())
        root = Path(cache_dir)
        launchers = sorted(root.glob(f"*/{LAUNCHER_GLOB}"))
        missing = [name for name in RUNTIME_FILES if not any(root.glob(f"*/{name}"))]
        if not launchers:
            missing.append(LAUNCHER_GLOB)
        if missing:
            raise BuildError(f"{cache_dir}: compile-only launches left no {', '.join(missing)}: the first real "
                             f"launch on a node would build them (needs a C++ compiler and CANN headers there)")
        return [f"compile-only launches: {len(launchers)} launcher(s), npu_utils.so and precompiled.h cached"]

    def notes(self) -> list[str]:
        return ["Ascend device build: kernels, launchers, npu_utils.so and the precompiled header are compiled on "
                "this node; the bundle only fits nodes with the same CANN, bishengir-compile and torch_npu"]


# --- offline: kernel binaries on a build host with CANN and no NPU ----------------------------------------------


class SocAnswer:
    """Stands in for triton-ascend's NPUUtils where its compiler asks it: the npubin stage passes
    ``--target=<NPUUtils().get_arch()>`` to bishengir-compile, which on a node asks the device; here the answer is
    the manifest's SoC."""

    def __init__(self, soc: str):
        self.soc = soc

    def __call__(self) -> "SocAnswer":  # the compiler calls NPUUtils() for an instance
        return self

    def get_arch(self) -> str:
        return self.soc


def _answer_soc(soc: str) -> None:
    """Make every loaded copy of triton-ascend's compiler module (triton imports each backend twice: by name, and
    by path from triton.backends) give bishengir-compile ``soc``."""
    import sys

    from triton.backends import backends

    named = sys.modules.get("triton.backends.ascend.compiler")
    for namespace in ([vars(named)] if named else []) + [backends["ascend"].compiler.add_stages.__globals__]:
        namespace["NPUUtils"] = SocAnswer(soc)


@dataclass
class NpuOfflineTarget(Target):
    """A container build step with the CANN toolkit and no NPU: every planned kernel compiled to its .npubin (the
    expensive part) through the real JIT, the target-only driver giving the manifest's SoC to bishengir-compile.
    Launchers, npu_utils.so and the precompiled header need torch_npu's headers and the node's AI-core count: the
    node builds them at first launch (``verify --require-launchers`` lists them)."""

    mode: ClassVar[str] = "offline"

    def activate(self) -> None:
        activate_offline(self.arch, self.device_profile)

    def prepare_build(self) -> None:
        _check_build_host("an offline NPU build needs the CANN toolkit (source its set_env.sh); `prewarm lower` "
                          "checks the front end without it")
        _answer_soc(self.arch)

    def compile(self, fn: Any, specialization_data: str) -> Any:
        _claim_once(self)
        return super().compile(fn, specialization_data)

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str, compiles: list) -> list[str]:
        CacheDir(cache_dir).claim_toolchain(self.toolchain())
        return []

    def notes(self) -> list[str]:
        return [f"offline Ascend build for {self.arch}: kernel binaries only, compiled by this host's bishengir-compile "
                f"for the manifest's SoC; each node builds the launchers, npu_utils.so and the precompiled header at "
                f"first launch (needs g++ and torch_npu's headers there; verify --require-launchers lists them). "
                f"Unverified on a real CANN toolkit until the runbook has been run"]


TARGETS: dict[str, type[Target]] = {"offline": NpuOfflineTarget, "device": NpuTarget}


# --- the runtime modules (built at first launch on the node) -------------------------------------------------------
# Both constructors below are triton-ascend's own; the active cache manager sees every lookup they make.


def launcher(kernel) -> None:
    """Construct the launcher of a loaded kernel (``preload``'s result) as the NPU driver does at its first launch
    (its class, whatever driver is active here: plan processes run a target-only one)."""
    from triton.backends.ascend.driver import NPULauncher

    NPULauncher(kernel.src, kernel.metadata)


def utils_loaded() -> str | None:
    """The npu_utils.so this process's NPU driver loaded when it started (None: no NPU driver started here)."""
    import sys

    from triton.backends import backends

    named = sys.modules.get("triton.backends.ascend.driver")  # triton also loads the backend by path: two copies
    for namespace in ([vars(named)] if named else []) + [backends["ascend"].driver.__init__.__globals__]:
        mod = getattr(getattr(namespace.get("NPUUtils"), "instance", None), "npu_utils_mod", None)
        if getattr(mod, "__file__", None):
            return mod.__file__
    return None


def construct_utils() -> None:
    """Construct NPUUtils as the NPU driver does when a process starts it (not the driver's singleton instance)."""
    from triton.backends.ascend.driver import NPUUtils

    NPUUtils.__init__(object.__new__(NPUUtils))


def _answer_lookup(filename: str, path: str, present: bool) -> str | None:
    """What a runtime-module lookup is answered with while probing: a present header or npu_utils its path
    (npu_utils is then loaded, as the node does), an absent header the path it would have, an absent npu_utils the
    one this process's driver loaded (the launcher source needs its AI-core count); None (a launcher): stop there."""
    if filename in HEADER_FILES or filename == UTILS_FILE and present:
        return path
    return utils_loaded() if filename == UTILS_FILE else None


def probe_modules(target: Target, compiles: list, results: list, cache_dir: str) -> list:
    """What triton-ascend builds with g++ at a node's first launch, for every planned compile that hits
    (``results``: prewarm.building.probe's): its launcher, the precompiled header (a missing one is built even when
    every launcher is there) and npu_utils. Keys computed by triton-ascend's own constructors under the active
    ``target``; one ``ModuleResult`` per key."""
    from ..probe import ModuleResult, Probe, ReadOnlyCacheManager, RecordingCacheManager

    with tritoncompat.cache_scope(os.path.abspath(cache_dir), ReadOnlyCacheManager):
        kernels = [tritoncompat.load_compiled(resolve(c.kernel), c.specialization)
                   for c, r in zip(compiles, results) if r.hit]  # disk hits: loaded, nothing compiled
    found: dict[str, ModuleResult] = {}

    def lookups(run, users: int) -> None:
        """Run one construction; record each key it looked up (``users``: planned compiles launching through it)."""
        RecordingCacheManager.seen.clear()
        try:
            run()
        except Probe:
            pass
        by_key: dict[str, list[tuple[str, bool]]] = {}
        for key, filename, present in RecordingCacheManager.seen:
            by_key.setdefault(key, []).append((filename, present))
        for key, files in by_key.items():
            name = ("npu_utils" if files[0][0] == UTILS_FILE else
                    "precompiled.h" if files[0][0] in HEADER_FILES else "launcher")
            m = found.setdefault(key, ModuleResult(name, key, any(present for _, present in files), 0))
            m.kernels += users if name != "npu_utils" else 0

    RecordingCacheManager.answer = staticmethod(_answer_lookup)
    with tritoncompat.cache_scope(os.path.abspath(cache_dir), RecordingCacheManager):
        lookups(construct_utils, 0)
        for kernel in kernels:
            lookups(lambda: launcher(kernel), 1)
    return list(found.values())


# --- the serving process's codegen env ----------------------------------------------------------------------------
# fingerprint.ASCEND_CODEGEN_ENV change the code triton-ascend generates (or the launcher it builds on the node) but
# not the cache key, and they are read in the serving process, where deployments export them or libraries set them
# at import: install and verify comparing their own env is not enough. Example: TRITON_ALL_BLOCKS_PARALLEL=1 makes
# the node's launcher clamp the block count to the physical core count (driver.py, generate_npu_wrapper_src), so a
# kernel compiled without auto-blockify silently skips the programs past it.


def serving_env_mismatches(cache_dir: str | os.PathLike | None = None,
                           environ: dict | None = None) -> list[fingerprint.Mismatch]:
    """This process's Ascend codegen env (``fingerprint.ASCEND_CODEGEN_ENV``) against the values each Ascend bundle installed in
    ``cache_dir`` (default: this process's TRITON_CACHE_DIR) was built with, read from the install receipts.

    prewarm.node.guard calls this when it arms in a serving process (PREWARM_GUARD=warn|error): each mismatch names the
    variable, the bundle's value and this process's. A bundle that did not record a variable (built before it was a
    factor) is a mismatch only where this process sets it."""
    environ = os.environ if environ is None else environ
    cache_dir = Path(cache_dir or tritoncompat.cache_dir())
    out: list[fingerprint.Mismatch] = []
    seen: list[dict] = []
    for receipt in CacheDir(cache_dir).receipts():
        built = receipt.index.fingerprint
        if built.get("target.backend") != "npu" or built in seen:
            continue
        seen.append(built)
        for name in fingerprint.ASCEND_CODEGEN_ENV:
            factor = f"ascend.env.{name}"
            ours = environ.get(name, fingerprint.UNSET)
            theirs = built.get(factor)
            if theirs is None and ours == fingerprint.UNSET or theirs == ours:
                continue
            out.append(fingerprint.Mismatch(
                factor, theirs or fingerprint.MISSING, ours, True,
                f"this serving process's {name} differs from the bundle's build: the cached binaries (or the "
                f"launchers this process builds) do not match what it would compile; set it as the build did or "
                f"rebuild under this value"))
    return out


def check_serving_env(mode: str, cache_dir: str | os.PathLike | None = None) -> list[fingerprint.Mismatch]:
    """:func:`serving_env_mismatches`, acted on as PREWARM_GUARD says: "error" raises FingerprintMismatch (the
    process refuses to serve), "warn" writes one line per mismatch to stderr. prewarm.node.guard calls it when it arms."""
    import sys

    found = serving_env_mismatches(cache_dir)
    if found and mode == "error":
        raise FingerprintMismatch(
            "this serving process's Ascend codegen env differs from the installed bundle's build (the cache key "
            "does not cover it): " + "; ".join(map(str, found)))
    for m in found:
        print(f"prewarm guard: warning: {m}", file=sys.stderr)
    return found
