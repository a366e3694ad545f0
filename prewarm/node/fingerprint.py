"""The environment fingerprint: every factor that can make a cached binary a miss or, worse, silently wrong.

Triton's own key covers its version and sources, the Python ABI (through libtriton), the backend target, ptxas
(CUDA) and a fixed list of env vars. It does NOT cover, among others, the Ascend CANN / bishengir-compile
version, several Ascend codegen env vars, or torch. A bundle carries the fingerprint it was built under; install
and verify compare it with the node's and refuse where a factor that changes code or keys differs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..building import tritoncompat

UNKNOWN = "unknown"

# Factors whose difference means the cache would miss (a compile on the node) or hold wrong code: refuse.
# Every other factor is informational: shown, never refused on.
BLOCKING_PREFIXES = ("triton.", "python.", "target.", "cuda.ptxas", "env.", "ascend.",
                     "sglang.jit.", "flashinfer.")  # the last two: a JIT bundle's factors (prewarm.jit)

WHY = {
    "sglang.jit.target": "sglang builds its JIT modules for the GPU's exact target: another is another build key",
    "sglang.jit.nvcc": "sglang keys its JIT modules on nvcc --version: the node would rebuild every one",
    "sglang.jit.cxx": "sglang keys its JIT modules on the host compiler's --version ($CXX, else c++; its binary name "
                      "included): the node would rebuild every one. Build them in the node's image",
    "flashinfer.archs": "FlashInfer loads an AOT module without checking its target: on another GPU it fails at launch",
    "flashinfer.version": "an AOT module is built from one FlashInfer's sources and bindings",
    "flashinfer.apache-tvm-ffi": "an AOT module is a tvm-ffi module: another tvm-ffi may not load it",
    "flashinfer.nvcc": "an AOT module links the libcudart of the CUDA it was built with",
    "triton.distribution": "a different Triton build produces different keys and code",
    "triton.version": "Triton's version is the first part of every cache key",
    "triton.key": "Triton's compiler/language sources or libtriton differ: every key differs",
    "python.abi": "libtriton differs per Python minor version, so every key differs",
    "target.backend": "kernels compiled for another backend cannot run here",
    "target.arch": "kernels compiled for another architecture are a miss (or cannot load)",
    "cuda.ptxas": "ptxas --version is part of Triton's CUDA backend hash",
    "torch.version": "not part of Triton's key; shown for the record",
}


# Factors read from a visible device: UNKNOWN where there is none (a build box, a CI machine); not compared then.
DEVICE_FACTORS = ("target.arch", "ascend.soc", "sglang.jit.target", "flashinfer.archs")
# How a node without a visible device states a device factor anyway, by (backend, factor). Such a factor is never
# left unchecked: triton-ascend's driver takes the SoC from TRITON_ASCEND_ARCH before the device, as detect_arch
# does, and every Ascend key contains it, so a node that cannot tell it cannot be checked and is refused.
NODE_CAN_STATE = {
    ("npu", "target.arch"): "run where torch_npu sees the NPU, or set TRITON_ASCEND_ARCH to this node's SoC (what "
                            "torch.npu.get_device_name(0) says with torch_npu, e.g. Ascend910_9391)",
}
MISSING = "(not recorded)"  # a side has no value at all for the factor


@dataclass(frozen=True)
class Mismatch:
    factor: str
    built: str
    node: str
    blocking: bool
    why: str
    gap: bool = False  # not a difference of values: a side does not know the factor (--allow-missing-factors)

    def __str__(self) -> str:
        return f"{self.factor}: bundle has {self.built!r}, this node has {self.node!r} ({self.why})"


def is_blocking(factor: str) -> bool:
    return factor.startswith(BLOCKING_PREFIXES)


def _ptxas_version() -> str:
    try:
        path = tritoncompat.ptxas_path()
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        return text.strip().splitlines()[-1] if text.strip() else UNKNOWN
    except Exception:
        return UNKNOWN


def _torch_version() -> str:
    import importlib.metadata  # here: a repeated install compares fingerprints without it (prewarm.shipping.nodestamp)

    try:  # the installed distribution's version: no `import torch` in a pre-launch job
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def current(backend: str | None = None, arch: str | None = None) -> dict[str, str]:
    """This environment's factors. ``backend``/``arch`` are the build target (from a manifest), else detected."""
    dist, version = tritoncompat.triton_distribution()
    factors = {
        "triton.distribution": dist,
        "triton.version": version,
        "triton.key": tritoncompat.triton_key(),
        "python.abi": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "torch.version": _torch_version(),
    }
    backend = backend or detect_backend()
    factors["target.backend"] = backend
    factors["target.arch"] = arch or detect_arch(backend)
    if backend == "cuda":
        factors["cuda.ptxas"] = _ptxas_version()
    if backend == "npu":
        factors.update(ascend_factors())
    for name, value in sorted(tritoncompat.cache_invalidating_env_vars().items()):
        factors[f"env.{name}"] = str(value)
    return factors


def detect_backend() -> str:
    """The backend this node runs: npu where torch_npu sees a device, cuda where the triton dist is upstream."""
    dist, _ = tritoncompat.triton_distribution()
    return "npu" if dist == "triton-ascend" else "cuda"


def detect_arch(backend: str) -> str:
    """The node's architecture, or UNKNOWN where no device is visible (a build box, a CI machine)."""
    if backend == "cuda":
        return _cuda_arch()
    if backend == "npu":  # as triton-ascend's NPUDriver.get_current_target: the env var wins, else the device
        return os.environ.get("TRITON_ASCEND_ARCH") or _ascend_device_soc()
    return UNKNOWN


def _cuda_arch() -> str:
    """GPU 0's compute capability: nvidia-smi (milliseconds), else torch where a device node exists."""
    try:
        cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        if cap:
            major, minor = cap.split(".")
            return f"sm_{major}{minor}"
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    if "torch" in sys.modules or os.path.exists("/dev/nvidia0"):
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                return f"sm_{major}{minor}"
        except Exception:
            pass
    return UNKNOWN


def _how_to_state(factor: str, built: dict[str, str], node: dict[str, str]) -> str | None:
    """How a node states ``factor`` without a visible device, where either side's backend allows it."""
    return next(filter(None, (NODE_CAN_STATE.get((fp.get("target.backend"), factor)) for fp in (node, built))), None)


def compare(built: dict[str, str], node: dict[str, str]) -> list[Mismatch]:
    """Each factor that differs, failing closed: a blocking factor the bundle lacks or records as UNKNOWN, one this
    node cannot determine, and a factor this node does not know at all are blocking gaps. Only a device factor
    (``DEVICE_FACTORS``) UNKNOWN on a side is not compared, unless either side's backend lets a node state it
    (``NODE_CAN_STATE``: an Ascend node's SoC; UNKNOWN there is a gap, even on both sides); an unset ``env.*`` var
    is simply absent."""
    out = []
    for factor in sorted(set(built) | set(node)):
        unset = UNSET if factor.startswith("env.") else MISSING
        b, n = built.get(factor, unset), node.get(factor, unset)
        how = _how_to_state(factor, built, node)
        if b == n and not (how and n == UNKNOWN):
            continue
        if n == MISSING:
            out.append(Mismatch(factor, b, n, True, "a factor this node does not have: cannot be checked", gap=True))
        elif UNKNOWN in (b, n) and factor in DEVICE_FACTORS and not how or not is_blocking(factor) and (
                b == MISSING or UNKNOWN in (b, n)):
            continue
        elif b in (MISSING, UNKNOWN) or n == UNKNOWN:
            side = "this node cannot determine it" if n == UNKNOWN else "the bundle does not record it"
            fix = f": {how}" if how and n == UNKNOWN else ""
            out.append(Mismatch(factor, b, n, True,
                                f"{side}, and it decides whether the cache is right for this node{fix}", gap=True))
        else:
            why = WHY.get(factor) or (
                "a codegen env var: Triton folds it into its key" if factor.startswith("env.")
                else ASCEND_ENV_WHY if factor.startswith("ascend.env.") else "differs"
            )
            out.append(Mismatch(factor, b, n, is_blocking(factor), why))
    return out


# --- Ascend: the toolchain Triton's key does not see ------------------------------------------------------------
# triton-ascend's backend hash is str(target) only ("TODO fetch compiler version"): a binary compiled under one
# CANN / bishengir-compile is silently reused under another. These factors close that hole. They are computed
# from the local toolchain only (same code on the build node and the serving node), so compare() sees the truth.

ABSENT = "absent"  # the tool or file is not there (differs from UNKNOWN: absent vs present is a real difference)
UNSET = "unset"

# Codegen env vars triton-ascend reads while compiling that are NOT in Triton's key (raw values: triton-ascend
# parses some of them two ways). TRITON_ENABLE_LIBDEVICE_SIMT is read by later triton-ascend releases.
# Not here, on purpose: TRITON_NPU_COMPILER_PATH only picks the compiler, whose identity is ascend.bishengir.*
# (so the same compiler installed under another path still matches), and TRITON_ASCEND_ARCH only sets the key's
# arch, which is target.arch (detect_arch honours it, as triton-ascend's driver does).
ASCEND_CODEGEN_ENV = (
    "TRITON_ENABLE_SANITIZER",
    "TRITON_DISABLE_FFTS",
    "TRITON_ALL_BLOCKS_PARALLEL",
    "TRITON_ENABLE_LIBDEVICE_SIMT",
    "ENABLE_PRINT_UB_BITS",
    "TRITON_F32_DEFAULT",  # tl.dot's default fp32 precision: "hf32" turns an ieee dot into hf32, same key
)
# Read only by later triton-ascend releases: "n/a (<version>)" where the installed one does not read it.
ASCEND_LATER_ENV = ("TRITON_ENABLE_UBTUNER",)  # UB tuner: rescues configs that would not fit, changing which win
ASCEND_DEFAULT_HOMES = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
ASCEND_ENV_WHY = "an Ascend codegen env var that Triton's key misses: the cached binary may differ from this node's"

WHY.update({
    "ascend.cann.version": "the CANN toolkit is not in Triton's key: binaries and launchers from another CANN "
                           "would be silently reused",
    "ascend.bishengir.version": "bishengir-compile turns linalg into the NPU binary; Triton's key ignores it",
    "ascend.bishengir.sha256": "a different bishengir-compile binary (even with the same --version) can emit "
                               "different code; Triton's key ignores it",
    "ascend.bishengir.name": "triton-ascend passes bishengir-compile-only flags; 'npuc' "
                             "(TRITON_NPU_COMPILER_PATH) is driven differently",
    "ascend.soc": "bishengir-compile targets the device's SoC whatever the key's arch says",
    "ascend.torch_npu.version": "launcher .so files link torch_npu, and their cache key does not include it",
    "ascend.compile_on_910_95": "triton-ascend 3.5+ picks the 910_95 pipeline and options from the node's devices",
    "ascend.install_path": "triton-ascend 3.5+ puts its install path (libdevice) in the options: another path, "
                           "another key",
    "npu.precompiled_header": "the node will not find the bundle's precompiled launcher header: its first launch "
                              "runs g++ with CANN headers (same C++ compiler path, Python build, torch / torch_npu "
                              "and ASCEND_HOME_PATH basename avoid it)",
})  # fmt: skip


def ascend_home() -> Path | None:
    """The CANN toolkit root as triton-ascend and set_env.sh name it (ASCEND_HOME_PATH first), else a default."""
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return next((Path(p) for p in ASCEND_DEFAULT_HOMES if Path(p).is_dir()), None)


def _cann_version(home: Path | None) -> str:
    """``version`` (and ``innerversion``) from the toolkit's own <arch>-linux/ascend_toolkit_install.info."""
    if home is None:
        return ABSENT
    candidates = [home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"]
    candidates += sorted(home.glob("*-linux/ascend_toolkit_install.info"))
    for info in candidates:
        if info.is_file():
            fields = dict(
                line.split("=", 1) for line in info.read_text(errors="replace").splitlines() if "=" in line
            )
            version = fields.get("version", "").strip()
            inner = fields.get("innerversion", "").strip()
            if version:
                return f"{version} ({inner})" if inner else version
    return ABSENT


def bishengir_path() -> str | None:
    """The compiler triton-ascend runs (utils._get_npucompiler_path; on 3.5+ the wheel's own first): PATH, then
    $TRITON_NPU_COMPILER_PATH/npuc. None where that file does not exist."""
    return tritoncompat.ascend_compiler_path()


def _bishengir_factors() -> dict[str, str]:
    path = bishengir_path()
    if path is None:
        return {"ascend.bishengir.name": ABSENT, "ascend.bishengir.version": ABSENT, "ascend.bishengir.sha256": ABSENT}
    digest = hashlib.sha256()
    with open(os.path.realpath(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    try:
        run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        version = " | ".join(line.strip() for line in (run.stdout + run.stderr).splitlines() if line.strip())
        version = version or f"(no output, exit {run.returncode})"
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"(cannot run: {e})"
    return {
        "ascend.bishengir.name": os.path.basename(path),
        "ascend.bishengir.version": version,
        "ascend.bishengir.sha256": digest.hexdigest(),
    }


def _ascend_device_soc() -> str:
    """The SoC of NPU 0 as torch_npu reports it; UNKNOWN without torch_npu or a device (never imports torch_npu
    where it is not installed: without CANN it breaks ``import torch``)."""
    if importlib.util.find_spec("torch_npu") is None:
        return UNKNOWN
    try:
        import torch
        import torch_npu  # noqa: F401

        return torch.npu.get_device_name(0) if torch.npu.is_available() else UNKNOWN
    except Exception:
        return UNKNOWN


def _dist_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ABSENT


def _precompiled_header_key() -> str:
    """The key dir of triton-ascend's precompiled launcher header here, computed by triton-ascend itself (C++
    compiler path, Python build, torch / torch_npu git versions, ASCEND_HOME_PATH's last component)."""
    if tritoncompat.triton_distribution()[0] != "triton-ascend":
        return ABSENT
    try:
        from triton.backends.ascend.driver import _precompile_npu_hash, generate_npu_header_src

        return tritoncompat.ascend_key_dir(_precompile_npu_hash(generate_npu_header_src()))
    except ImportError:  # no torch_npu: not a node that launches
        return ABSENT
    except Exception:
        return UNKNOWN


def ascend_factors() -> dict[str, str]:
    """The Ascend toolchain factors: "ascend.*" block an install, "npu.*" are shown."""
    factors = {
        "ascend.cann.version": _cann_version(ascend_home()),
        **_bishengir_factors(),
        "ascend.soc": _ascend_device_soc(),
        "ascend.torch_npu.version": _dist_version("torch_npu"),
        "npu.precompiled_header": _precompiled_header_key(),
    }
    for name in ASCEND_CODEGEN_ENV:
        factors[f"ascend.env.{name}"] = os.environ.get(name, UNSET)
    factors.update(_ascend_release_factors())
    return factors


def _ascend_release_factors() -> dict[str, str]:
    """What only some triton-ascend releases read: "n/a (<version>)" where the installed one does not."""
    na = f"n/a ({tritoncompat.triton_distribution()[1]})"
    factors = {f"ascend.env.{name}": os.environ.get(name, UNSET) if tritoncompat.ascend_reads_env(name) else na
               for name in ASCEND_LATER_ENV}
    flag = tritoncompat.ascend_compile_on_910_95()
    factors["ascend.compile_on_910_95"] = na if flag is None else str(flag)
    factors["ascend.install_path"] = tritoncompat.ascend_install_path_in_key() or na
    return factors


def toolchain_factors(fp: dict[str, str]) -> dict[str, str]:
    """The factors a cache dir must agree on: those Triton's own key misses (Ascend only; CUDA keys cover them)."""
    return {k: v for k, v in fp.items() if k.startswith("ascend.")}
