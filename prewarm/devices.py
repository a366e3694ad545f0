"""Device profiles: the properties a library reads from the accelerator, for planning and building without one.

Libraries pick kernels, block sizes and autotune lists from the device (fla-core asks ``torch.cuda`` for the name,
capability and opt-in shared memory at import, and Triton's ``driver.active.utils.get_device_properties`` for
the SM count). A manifest's ``[target] device = "H200"`` names a profile; :func:`activate` makes this process
answer those queries with it, so a library imports and plans as it would on the node. Only plan and build
processes call it (the CLI's, and each build worker through its target); nothing else in the project does, so a
node's runtime, ``prewarm record`` and ``verify`` see the real device or none.

Every figure names its source: ``measured`` (on the device, with :data:`MEASURE_COMMAND`) or ``documented``
(the vendor's public specification). Replace documented figures by measured ones when a device is at hand.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ManifestError

# Run on the device (one line); paste its output into the profile and mark the fields measured (with the date).
MEASURE_COMMAND = (
    "python -c \"import json,torch,triton; p=torch.cuda.get_device_properties(0); "
    "print(json.dumps({'torch': {a: getattr(p, a) for a in dir(p) if not a.startswith('_')}, "
    "'capability': torch.cuda.get_device_capability(0), "
    "'triton': triton.runtime.driver.active.utils.get_device_properties(0)}, default=str))\""
)

# The same on an Ascend node (torch_npu and CANN installed): triton-ascend's own answer.
NPU_MEASURE_COMMAND = (
    "python -c \"import json,torch,torch_npu,triton; "
    "print(json.dumps({'soc': torch.npu.get_device_name(0), "
    "'triton': triton.runtime.driver.active.utils.get_device_properties(0)}))\""
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """What a device answers to the queries libraries make when they choose kernels. CUDA fields follow
    ``torch.cuda.get_device_properties``; Ascend's follow triton-ascend's ``get_device_properties``."""

    name: str  # torch.cuda.get_device_name (CUDA) / the SoC name (Ascend)
    backend: str  # "cuda" | "npu"
    arch: str  # what the manifest's [target] arch must say: "sm_90", "Ascend910_9391"
    sources: dict[str, str]  # field -> "documented: ..." / "measured: ..."
    capability: tuple[int, int] = (0, 0)
    multi_processor_count: int = 0
    shared_memory_per_block: int = 0
    shared_memory_per_block_optin: int = 0
    shared_memory_per_multiprocessor: int = 0
    L2_cache_size: int = 0
    regs_per_multiprocessor: int = 0
    max_registers_per_block: int = 0
    max_threads_per_multi_processor: int = 0
    max_threads_per_block: int = 0
    warp_size: int = 0
    total_memory: int = 0
    clock_rate: int = 0  # kHz, as CUDA reports it
    memory_clock_rate: int = 0  # kHz
    memory_bus_width: int = 0  # bits
    num_aicore: int = 0  # Ascend: AI (cube) cores
    num_vectorcore: int = 0  # Ascend: vector cores
    ub_size: int = 0  # Ascend: unified buffer per core, bytes

    def torch_properties(self) -> "CudaProperties":
        return CudaProperties(
            name=self.name, major=self.capability[0], minor=self.capability[1], total_memory=self.total_memory,
            multi_processor_count=self.multi_processor_count, shared_memory_per_block=self.shared_memory_per_block,
            shared_memory_per_block_optin=self.shared_memory_per_block_optin,
            shared_memory_per_multiprocessor=self.shared_memory_per_multiprocessor, L2_cache_size=self.L2_cache_size,
            regs_per_multiprocessor=self.regs_per_multiprocessor, warp_size=self.warp_size,
            max_threads_per_multi_processor=self.max_threads_per_multi_processor,
            max_threads_per_block=self.max_threads_per_block, clock_rate=self.clock_rate // 1000,
            memory_clock_rate=self.memory_clock_rate // 1000, memory_bus_width=self.memory_bus_width,
        )  # fmt: skip

    def triton_properties(self) -> dict[str, int]:
        """What Triton's driver ``utils.get_device_properties(device)`` returns on this device."""
        if self.backend == "npu":  # triton-ascend 3.2's NPUUtils.get_device_properties
            return {"max_shared_mem": 1, "num_aicore": self.num_aicore, "num_vectorcore": self.num_vectorcore}
        return {"max_shared_mem": self.shared_memory_per_block_optin, "max_num_regs": self.max_registers_per_block,
                "multiprocessor_count": self.multi_processor_count, "warpSize": self.warp_size,
                "sm_clock_rate": self.clock_rate, "mem_clock_rate": self.memory_clock_rate,
                "mem_bus_width": self.memory_bus_width}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CudaProperties:
    """Stands in for ``torch._C._CudaDeviceProperties`` (same attribute names; clock rates in MHz as torch's)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    L2_cache_size: int
    regs_per_multiprocessor: int
    warp_size: int
    max_threads_per_multi_processor: int
    max_threads_per_block: int
    clock_rate: int
    memory_clock_rate: int
    memory_bus_width: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    gcnArchName: str = "NVIDIA"
    uuid: str = field(default="00000000-0000-0000-0000-000000000000")


_HOPPER_GUIDE = "documented: NVIDIA Hopper Tuning Guide (cc 9.0: 228 KB smem/SM, 227 KB opt-in per block)"
_CUDA_GUIDE = "documented: CUDA C Programming Guide, technical specifications per compute capability"
_CC = "documented: NVIDIA CUDA GPUs compute capability table"
_CUDA_SOURCES = {
    "capability": _CC, "arch": _CC, "shared_memory_per_block": _CUDA_GUIDE, "regs_per_multiprocessor": _CUDA_GUIDE,
    "max_registers_per_block": _CUDA_GUIDE, "max_threads_per_multi_processor": _CUDA_GUIDE,
    "max_threads_per_block": _CUDA_GUIDE, "warp_size": _CUDA_GUIDE, "shared_memory_per_block_optin": _HOPPER_GUIDE,
    "shared_memory_per_multiprocessor": _HOPPER_GUIDE,
}  # fmt: skip
_CUDA_COMMON = dict(shared_memory_per_block=48 * KiB, regs_per_multiprocessor=64 * KiB, max_registers_per_block=64 * KiB,
                    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)  # fmt: skip

# H100 and H200 SXM5: the same GH100 configuration, different memory
_HOPPER_SXM5 = dict(backend="cuda", arch="sm_90", capability=(9, 0), multi_processor_count=132,
                    shared_memory_per_block_optin=227 * KiB, shared_memory_per_multiprocessor=228 * KiB,
                    L2_cache_size=50 * MiB, clock_rate=1_980_000, **_CUDA_COMMON)  # fmt: skip
_HOPPER_SXM5_SOURCES = {
    **_CUDA_SOURCES,
    "multi_processor_count": "documented: Hopper whitepaper, GH100 SXM5 132 SMs (H100 SXM5; the H200 is the same part)",
    "L2_cache_size": "documented: Hopper whitepaper, 50 MB L2 (SXM5)",
    "clock_rate": "documented: H100/H200 SXM5 max boost 1980 MHz",
}

_H200_MEASURED = ("measured: torch.cuda.get_device_properties(0) and Triton's get_device_properties(0) on the "
                  "H200 device machine, 2026-11-30 (bench/results/h200_properties.json; MEASURE_COMMAND)")

PROFILES: dict[str, DeviceProfile] = {
    "H200": DeviceProfile(
        name="NVIDIA H200", **{**_HOPPER_SXM5, "L2_cache_size": 60 * MiB}, total_memory=150_109_880_320,
        memory_clock_rate=3_201_000, memory_bus_width=6016,
        sources={
            **_HOPPER_SXM5_SOURCES,
            **{k: _H200_MEASURED for k in ("name", "capability", "multi_processor_count", "shared_memory_per_block",
                                           "shared_memory_per_block_optin", "shared_memory_per_multiprocessor",
                                           "L2_cache_size", "regs_per_multiprocessor", "warp_size", "clock_rate",
                                           "total_memory", "memory_clock_rate", "memory_bus_width",
                                           "max_threads_per_multi_processor", "max_threads_per_block")},
        },
    ),
    "H100": DeviceProfile(
        name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, memory_clock_rate=2_619_000, memory_bus_width=5120,
        **_HOPPER_SXM5,
        sources={
            **_HOPPER_SXM5_SOURCES,
            "name": "documented: the SXM5 80 GB board's device name",
            "total_memory": "documented: H100 SXM5 datasheet, 80 GB HBM3",
            "memory_clock_rate": "documented: Hopper whitepaper, HBM3 at 2619 MHz (3.35 TB/s)",
            "memory_bus_width": "documented: Hopper whitepaper, 5 HBM3 stacks, 5120-bit",
        },
    ),
    "A100": DeviceProfile(
        name="NVIDIA A100-SXM4-80GB", backend="cuda", arch="sm_80", capability=(8, 0), multi_processor_count=108,
        shared_memory_per_block_optin=163 * KiB, shared_memory_per_multiprocessor=164 * KiB, L2_cache_size=40 * MiB,
        total_memory=80 * GiB, clock_rate=1_410_000, memory_clock_rate=1_593_000, memory_bus_width=5120,
        **_CUDA_COMMON,
        sources={
            **_CUDA_SOURCES,
            "shared_memory_per_block_optin": "documented: Ampere Tuning Guide (cc 8.0: 163 KB opt-in per block)",
            "shared_memory_per_multiprocessor": "documented: Ampere Tuning Guide (cc 8.0: 164 KB per SM)",
            "name": "documented: the SXM4 80 GB board's device name",
            "multi_processor_count": "documented: Ampere whitepaper, A100 108 SMs",
            "L2_cache_size": "documented: Ampere whitepaper, 40 MB L2",
            "total_memory": "documented: A100 80GB datasheet",
            "clock_rate": "documented: A100 boost 1410 MHz",
            "memory_clock_rate": "documented: A100 80GB HBM2e, 2.0 TB/s over 5120 bits",
            "memory_bus_width": "documented: Ampere whitepaper, 5120-bit",
        },
    ),
    "B200": DeviceProfile(
        name="NVIDIA B200", backend="cuda", arch="sm_100", capability=(10, 0), multi_processor_count=148,
        shared_memory_per_block_optin=227 * KiB, shared_memory_per_multiprocessor=228 * KiB, L2_cache_size=126 * MiB,
        total_memory=180 * 10**9, clock_rate=1_965_000, memory_clock_rate=3_996_000, memory_bus_width=8192,
        **_CUDA_COMMON,
        sources={
            **_CUDA_SOURCES,
            "shared_memory_per_block_optin": "documented: Blackwell Tuning Guide (cc 10.0: 227 KB opt-in per block)",
            "shared_memory_per_multiprocessor": "documented: Blackwell Tuning Guide (cc 10.0: 228 KB per SM)",
            "name": "documented: HGX B200 device name",
            "multi_processor_count": "documented: Blackwell B200, 148 SMs (2 dies x 74)",
            "L2_cache_size": "unverified: 126 MB as reported for B200; measure",
            "total_memory": "documented: HGX B200, 180 GB HBM3e per GPU",
            "clock_rate": "unverified: boost clock; measure",
            "memory_clock_rate": "unverified: derived from 8 TB/s over 8192 bits; measure",
            "memory_bus_width": "unverified: 8 HBM3e stacks x 1024 bits; measure",
        },
    ),
    "Ascend910B": DeviceProfile(
        name="Ascend910B2", backend="npu", arch="Ascend910B2", num_aicore=24, num_vectorcore=48, ub_size=192 * KiB,
        sources={
            "name": "documented: CANN SoC name", "arch": "documented: CANN SoC name",
            "num_aicore": "unverified: 24 AI (cube) cores as reported for the 910B2; measure (NPU_MEASURE_COMMAND)",
            "num_vectorcore": "documented: 2 vector cores per AI core (triton-ascend: num_aicore * 2)",
            "ub_size": "documented: CANN Ascend C docs, 192 KB unified buffer per core on A2",
        },
    ),
    "Ascend910_93": DeviceProfile(
        name="Ascend910_9391", backend="npu", arch="Ascend910_9391", num_aicore=24, num_vectorcore=48,
        ub_size=192 * KiB,
        sources={
            "name": "documented: CANN SoC name of the A3 (Atlas 800T A3) die",
            "arch": "documented: CANN SoC name",
            "num_aicore": "unverified: 24 AI (cube) cores per A3 die as reported; measure (NPU_MEASURE_COMMAND)",
            "num_vectorcore": "documented: 2 vector cores per AI core (triton-ascend: num_aicore * 2)",
            "ub_size": "documented: CANN Ascend C docs, 192 KB unified buffer per core on A3",
        },
    ),
}
ALIASES = {"A3": "Ascend910_93", "Ascend910_9391": "Ascend910_93", "910B": "Ascend910B", "Ascend910B2": "Ascend910B"}


def lookup(name: str, where: str) -> DeviceProfile:
    """The profile ``name`` names (or an alias of it), or a ManifestError naming ``where`` and the known names."""
    profile = PROFILES.get(ALIASES.get(name, name))
    if profile is None:
        known = ", ".join(sorted({*PROFILES, *ALIASES}))
        raise ManifestError(f"{where}: device = {name!r}: expected one of {known}")
    return profile


def arch_name(arch: str) -> str:
    """An arch as profiles spell it ("sm_90", a SoC name), for comparing a manifest's with a profile's."""
    return arch.lower().removesuffix("a").replace("sm", "sm_").replace("__", "_")


# --- the device a recording ran on -------------------------------------------------------------------------------
# `prewarm record` stores with each request the device it ran on, as torch and Triton's driver answered in that
# process (:func:`observe`); a manifest without ``[target] device`` plans and builds as that device.

# What a library chooses kernels by: a recorded device must agree with its profile on these
LIBRARY_FIELDS = ("capability", "multi_processor_count", "shared_memory_per_block_optin",
                  "shared_memory_per_multiprocessor", "warp_size", "num_aicore", "num_vectorcore")  # fmt: skip
_TORCH_FIELDS = ("multi_processor_count", "shared_memory_per_block", "shared_memory_per_block_optin",
                 "shared_memory_per_multiprocessor", "L2_cache_size", "regs_per_multiprocessor", "warp_size",
                 "max_threads_per_multi_processor", "max_threads_per_block", "total_memory")  # fmt: skip


def observe(device: int = 0) -> dict | None:
    """The device this process's Triton compiles for, as the libraries see it: torch's name and properties (CUDA:
    ``torch.cuda``; Ascend: ``torch.npu``'s name) under :class:`DeviceProfile`'s field names, and Triton's own
    ``utils.get_device_properties`` (``"triton"``). None where neither torch nor the driver names a device (no
    device, or torch not imported: asking would import or initialise it in the recorded process)."""
    import sys

    from triton.runtime.driver import driver

    backend = driver.active.get_current_target().backend
    torch = sys.modules.get("torch")
    out: dict[str, Any] = {"backend": backend}
    if backend == "cuda" and torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, capability=[props.major, props.minor])
        out.update({f: int(getattr(props, f)) for f in _TORCH_FIELDS if hasattr(props, f)})
    elif backend == "npu" and torch is not None and hasattr(torch, "npu"):
        out["name"] = torch.npu.get_device_name(device)
    else:
        return None
    utils = getattr(driver.active, "utils", None)
    triton_props = utils.get_device_properties(device) if utils is not None else {}
    out["triton"] = {k: v for k, v in dict(triton_props).items() if isinstance(v, (int, float, str))}
    for field_name in ("num_aicore", "num_vectorcore"):
        if field_name in out["triton"]:
            out[field_name] = out["triton"][field_name]
    return out


def matching_profile(observed: dict, where: str) -> str:
    """The profile a recorded device is (by name, then checked on :data:`LIBRARY_FIELDS`), or a ManifestError
    naming ``where``, the device and what to add."""
    name = observed["name"]
    found = next((k for k, p in PROFILES.items() if p.name == name and p.backend == observed.get("backend")), None)
    found = found or (ALIASES.get(name, name) if ALIASES.get(name, name) in PROFILES else None)
    seen = ", ".join(f"{f} {observed[f]}" for f in LIBRARY_FIELDS if f in observed)
    if found is None:
        known = ", ".join(f"{k} ({p.name})" for k, p in PROFILES.items())
        raise ManifestError(f"{where}: recorded on device {name!r} ({seen}), which no prewarm.devices profile "
                            f"describes (known: {known}): add a DeviceProfile for it to prewarm/devices.py PROFILES "
                            f"(its figures from MEASURE_COMMAND on that device), or name the profile to plan for "
                            f"with [target] device")
    profile = asdict(PROFILES[found])
    for f in LIBRARY_FIELDS:
        want = list(profile[f]) if isinstance(profile[f], tuple) else profile[f]
        if f in observed and observed[f] != want:
            raise ManifestError(f"{where}: recorded on {name!r} with {f} = {observed[f]!r}, but profile {found} says "
                                f"{want!r} (libraries choose kernels by it): expected a profile with the device's "
                                f"figures; correct or add one in prewarm/devices.py (MEASURE_COMMAND)")
    return found


# --- answering the queries in this process -----------------------------------------------------------------------

_SAVED: dict[str, Any] = {}  # torch.cuda attribute -> the function activate() replaced
_ACTIVE: list[DeviceProfile] = []


class ProfileUtils:
    """The part of a Triton driver's ``utils`` that libraries query for device properties."""

    def __init__(self, profile: DeviceProfile):
        self.profile = profile

    def get_device_properties(self, device=0) -> dict[str, int]:
        return self.profile.triton_properties()


class OfflineDriver:
    """The smallest driver Triton's JIT needs to compile (no launch): a target, device 0, stream 0. Each backend
    installs its own (prewarm.building.backends); :func:`activate` gives it a profile's ``utils``."""

    def __init__(self, backend: str, arch: int | str, warp_size: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(backend, arch, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def active() -> DeviceProfile | None:
    """The profile this process answers device queries with (None: the real device, or none)."""
    return _ACTIVE[0] if _ACTIVE else None


def activate(profile: DeviceProfile) -> None:
    """From now on, in this process: torch.cuda's device queries (CUDA profiles, with stand-ins for the driver's
    libcuda.so.1 and libnvidia-ml.so.1 where it is not installed: :func:`provide_driver_library`), torch.npu's (Ascend
    profiles: :func:`_answer_npu`) and the active target-only Triton driver's ``utils.get_device_properties`` answer
    as ``profile``. Idempotent; :func:`deactivate` undoes.
    Call only where a target-only driver is active (plan and build processes), never on a node."""
    from .building.tritoncompat import chosen_driver

    current = chosen_driver()
    if not isinstance(current, OfflineDriver):
        raise RuntimeError("a device profile answers only under a target-only driver (none is active)")
    current.utils = ProfileUtils(profile)
    _ACTIVE[:] = [profile]
    if profile.backend == "npu":
        _answer_npu(profile)
    if profile.backend != "cuda":
        return
    provide_driver_library(profile)
    import torch

    props = profile.torch_properties()
    answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_name": lambda device=None: profile.name,
        "get_device_capability": lambda device=None: profile.capability,
        "get_device_properties": lambda device=None: props,
        # torch.cuda.device(i), which libraries enter around a launch (sglang's fla utils, on a tensor's device):
        # selecting the one device there is changes nothing and needs no driver
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
    }
    for name, fn in answers.items():
        _SAVED.setdefault(name, getattr(torch.cuda, name))
        setattr(torch.cuda, name, fn)


def deactivate() -> None:
    """Put back what :func:`activate` replaced (the driver's ``utils`` goes with the driver)."""
    import torch

    for name, fn in _SAVED.items():
        setattr(torch.cuda, name, fn)
    _SAVED.clear()
    _ACTIVE.clear()
    if _NPU_MODULE:
        delattr(torch, "npu")
        sys.modules.pop("torch.npu", None)
        _NPU_MODULE.clear()


# What torch_npu adds to torch, answering as an Ascend profile (plan and build processes only)
_NPU_MODULE: list[types.ModuleType] = []  # the torch.npu module _answer_npu registered (none: torch_npu's, or none)


class _NpuDeviceContext:
    """``torch.npu.device(index)``: the context manager libraries enter around a launch (one device here)."""

    def __init__(self, device=None):
        index = getattr(device, "index", device)
        if index not in (None, 0, -1):
            raise RuntimeError(f"torch.npu.device({device!r}): this profile has one device, npu:0")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _answer_npu(profile: DeviceProfile) -> None:
    """``torch.npu`` and the ``npu`` device type as torch_npu registers them (``rename_privateuse1_backend``,
    ``_register_device_module``), answering the queries kernel modules make at import and when they choose kernels:
    sglang's fla utils take ``getattr(torch, <triton backend>)`` and ask ``device_count()`` and
    ``torch.npu.device(i)``, its ``is_npu()`` asks ``is_available()``, torch's FakeTensorMode ``is_initialized()`` and
    ``current_device()`` for tensors on ``npu``. Anything that needs the device (streams, synchronize, memory) is
    absent (AttributeError). Where torch_npu itself is loaded, its answers stand. The ``npu`` device type, its device
    guard and hooks stay registered after :func:`deactivate` (torch cannot undo them; torch_npu never does either)."""
    import torch

    if hasattr(torch, "npu") and not _NPU_MODULE:
        return
    if torch._C._get_privateuse1_backend_name() != "npu":
        from torch.utils import backend_registration as registration

        torch.utils.rename_privateuse1_backend("npu")
        # torch's own stand-ins for what torch_npu registers in C++: a device guard (ops on an npu tensor, fake
        # ones included, enter one) and the backend hooks; a python backend's, as torch documents it
        torch._C._acc.register_python_privateuseone_hook(registration._DummyPrivateUse1Hook())
        torch._C._acc.register_python_privateuseone_device_guard(registration._DummyDeviceGuard())
    if _NPU_MODULE:
        delattr(torch, "npu")
    module = types.ModuleType("torch.npu", f"prewarm.devices: torch.npu answering as {profile.name} (no device)")
    answers = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": _NpuDeviceContext,  # checks the index; selecting npu:0 changes nothing here
        "get_device_name": lambda device=None: profile.name,
        "device": _NpuDeviceContext,
    }
    for name, fn in answers.items():
        setattr(module, name, fn)
    torch._register_device_module("npu", module)
    _NPU_MODULE[:] = [module]


# --- the NVIDIA driver library and NVML, where no driver is installed ---------------------------------------------
# A server's compiled extensions (sgl_kernel's common_ops, vllm._C) list libcuda.so.1 as needed and reference driver
# entry points (``nm -D --undefined-only``: cuGetProcAddress_v2, cuPointerGetAttribute, ...); Python loads
# extensions with RTLD_NOW, so on a box without the driver ``import sglang...`` / ``import vllm._C`` fails before a
# kernel is planned. A server may also choose its platform by NVML (vLLM asks nvmlInit and the device count, then the
# capability and name). A CUDA profile (plan and build processes only) loads stand-ins for both driver libraries
# into its own process first (RTLD_GLOBAL): the dynamic loader then satisfies any later need of libcuda.so.1 or
# libnvidia-ml.so.1 with them (by soname). Every CUDA entry point answers CUDA_ERROR_NO_DEVICE (or
# CUDA_ERROR_STUB_LIBRARY: CUDA's own stub); NVML answers as the profile's one device. Nothing else on the machine
# sees them; torch.cuda's queries are answered above, not through them.

DRIVER_LIBRARY = "libcuda.so.1"
NVML_LIBRARY = "libnvidia-ml.so.1"
CUDA_ERROR_NO_DEVICE = 100
# CUDA's own stub in a toolkit (a CUDA devel image has it), under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda
CUDA_STUBS = ("lib64/stubs/libcuda.so", "targets/x86_64-linux/lib/stubs/libcuda.so",
              "targets/sbsa-linux/lib/stubs/libcuda.so")
_DRIVER: dict[str, str] = {}  # library -> what this process got (installed / the stand-in's path) or "missing: why"


def provide_driver_library(profile: DeviceProfile) -> None:
    """Make ``libcuda.so.1`` and ``libnvidia-ml.so.1`` loadable in this process: the installed driver's where there
    is one; else for libcuda CUDA's own stub (:data:`CUDA_STUBS`) or :func:`driver_stub`, for NVML
    :func:`nvml_stub` answering as ``profile``, each loaded RTLD_GLOBAL. What could not be provided is recorded
    (:func:`unprovided` names it)."""
    import ctypes
    import shutil

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    # a stub that exports the driver's entry points (a placeholder made only for linking exports none)
    toolkit = [str(Path(r, s)) for r in roots if r for s in CUDA_STUBS
               if Path(r, s).is_file() and b"\0cuInit\0" in Path(r, s).read_bytes()]
    builds = {DRIVER_LIBRARY: (toolkit[0] if toolkit else None, lambda: driver_stub(cc)),
              NVML_LIBRARY: (None, lambda: nvml_stub(profile, cc))}
    for library, (found, build) in builds.items():
        if library in _DRIVER:
            continue
        try:
            ctypes.CDLL(library)
            _DRIVER[library] = "installed"
            continue
        except OSError:
            pass
        try:
            if found is None and cc is None:
                raise RuntimeError("no C compiler (gcc, clang or $CC) to build one"
                                   + ("" if library == NVML_LIBRARY else f" and no CUDA stub ({', '.join(CUDA_STUBS)} "
                                                                          f"under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda)"))
            path = found or os.path.join(build(), library)
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _DRIVER[library] = path
        except Exception as e:
            _DRIVER[library] = f"missing: {e}"


def driver_entry_points(header: Path) -> list[str]:
    """Every driver API function ``header`` (a ``cuda.h``) declares, under each name the driver library exports for
    it: as declared, and the versioned / per-thread-stream names its macros select (``cuMemAlloc_v2``,
    ``cuMemcpyHtoD_v2_ptds``)."""
    text = header.read_text()
    names = set(re.findall(r"CUDAAPI\s+(cu[A-Z]\w*)\s*\(", text))
    for wrap, target in re.findall(r"#define\s+cu[A-Z]\w*\s+(?:__CUDA_API_(PTDS|PTSZ)\(\s*)?(cu[A-Z]\w*)", text):
        names.update({target, target + (f"_{wrap.lower()}" if wrap else "")})
    return sorted(names)


@functools.lru_cache()
def driver_stub(cc: str) -> str:
    """A dir (one per process and compiler, removed at exit) holding a stand-in ``libcuda.so.1`` built with ``cc``:
    every entry point of Triton's copy of ``cuda.h`` (:func:`driver_entry_points`), each returning
    CUDA_ERROR_NO_DEVICE. A library linked against the driver loads against it and finds no device."""
    import triton.backends.nvidia

    header = Path(triton.backends.nvidia.__file__).parent / "include" / "cuda.h"
    source = "".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n"
                     for name in driver_entry_points(header))
    return _shared_library(cc, DRIVER_LIBRARY, source)


def nvml_stub(profile: DeviceProfile, cc: str) -> str:
    """A dir (removed at exit) holding a stand-in ``libnvidia-ml.so.1`` built with ``cc`` that answers NVML's device
    queries as ``profile``'s one device: init and shutdown, the device count, its handle and index, name, UUID,
    compute capability and memory. Any other NVML function is absent (pynvml: NVMLError_FunctionNotFound)."""
    import json

    props = profile.torch_properties()
    name, uuid = json.dumps(profile.name), json.dumps(f"GPU-{props.uuid}")
    source = f"""#include <string.h>
typedef struct {{ unsigned long long total, free, used; }} memory_t;
static int copy(char *out, unsigned size, const char *s) {{
    if (strlen(s) + 1 > size) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(out, s); return 0; }}
int nvmlInit_v2(void) {{ return 0; }}
int nvmlInit(void) {{ return 0; }}
int nvmlInitWithFlags(unsigned flags) {{ return 0; }}
int nvmlShutdown(void) {{ return 0; }}
int nvmlDeviceGetCount_v2(unsigned *n) {{ *n = 1; return 0; }}
int nvmlDeviceGetCount(unsigned *n) {{ *n = 1; return 0; }}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) {{ if (i) return 2; *h = (void *)copy; return 0; }}
int nvmlDeviceGetHandleByIndex(unsigned i, void **h) {{ return nvmlDeviceGetHandleByIndex_v2(i, h); }}
int nvmlDeviceGetHandleByUUID(const char *u, void **h) {{ *h = (void *)copy; return 0; }}
int nvmlDeviceGetIndex(void *h, unsigned *i) {{ *i = 0; return 0; }}
int nvmlDeviceGetName(void *h, char *out, unsigned size) {{ return copy(out, size, {name}); }}
int nvmlDeviceGetUUID(void *h, char *out, unsigned size) {{ return copy(out, size, {uuid}); }}
int nvmlDeviceGetCudaComputeCapability(void *h, int *major, int *minor) {{
    *major = {profile.capability[0]}; *minor = {profile.capability[1]}; return 0; }}
int nvmlDeviceGetMemoryInfo(void *h, memory_t *m) {{
    m->total = {profile.total_memory}ULL; m->free = m->total; m->used = 0; return 0; }}
const char *nvmlErrorString(int r) {{ return "not answered by prewarm's device profile (no NVIDIA driver here)"; }}
"""
    return _shared_library(cc, NVML_LIBRARY, source)


def _shared_library(cc: str, soname: str, source: str) -> str:
    """A fresh dir (removed at exit) holding ``soname`` compiled from the C ``source`` with ``cc``."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    out = tempfile.mkdtemp(prefix="prewarm-driver-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", os.path.join(out, soname), "-x", "c", "-"],
                   input=source.encode(), check=True, capture_output=True)
    return out


def unprovided(error: BaseException) -> str | None:
    """Where ``error`` (or an exception it was raised from) is a shared library that could not be loaded (not found,
    or a symbol it needs missing): the library and what this process's device view did or did not provide for it;
    None for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = re.search(r"([\w.+-]+\.so[\w.]*): cannot open shared object file|undefined symbol: (\w+)", str(error))
        if found:
            library = found.group(1) or ""
            what = f"{library} could not be loaded" if library else \
                f"a library needs the symbol {found.group(2)}, which no loaded library defines"
            ours = next((lib for lib in (DRIVER_LIBRARY, NVML_LIBRARY) if library and library.split(".so")[0] ==
                         lib.split(".so")[0]), None)
            if ours is None and not library and found.group(2).startswith("cu"):
                ours = DRIVER_LIBRARY
            if ours:
                have = _DRIVER.get(ours) or "no CUDA device profile was active"
                return (f"{what}: the NVIDIA driver's {ours}, which prewarm's device profile provides on a build box "
                        f"without the driver ({have}); fix: install a C compiler (gcc) or the CUDA toolkit's stubs "
                        f"(CUDA_HOME), or plan where the driver is installed")
            return f"{what}: prewarm's device profile does not provide it; install the package that ships it"
        error = error.__cause__ or error.__context__
    return None
