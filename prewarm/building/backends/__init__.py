"""Backends: one module per backend (:mod:`.cuda`, :mod:`.npu`), each holding its target-only driver (installed in
one place, its ``activate_offline``), its build targets, and the C modules its runtime builds at first launch
(built and probed). A caller that needs a device view activates a target once (:func:`select`, then
``Target.activate``); a process that only plans calls :func:`activate_for_planning`. The registry below imports
both modules; neither imports it back.
"""
from __future__ import annotations

import dataclasses

from ...errors import EnvironmentProblem, ManifestError
from ...planning.manifest import Manifest
from ...planning.plan import manifest_device
from . import cuda, npu
from .cuda import CudaDeviceTarget, CudaOfflineTarget
from .target import MODES, Target

__all__ = ["MODES", "BACKENDS", "CudaDeviceTarget", "CudaOfflineTarget", "Target", "activate_for_planning",
           "get_target", "plan_targets", "probe_modules", "select"]

BACKENDS = {"cuda": cuda, "npu": npu}  # each: TARGETS, auto_mode(), activate_for_planning(), probe_modules()


def get_target(backend: str, arch: str, mode: str = "auto", device_profile: str | None = None,
               libcuda_dirs: tuple[str, ...] | None = None) -> Target:
    """The target that builds ``backend``/``arch`` in ``mode`` (offline | device | auto); it answers device queries
    as ``device_profile`` (a :mod:`prewarm.devices` name) in every process it activates offline; a CUDA target
    builds and looks up cuda_utils for nodes whose libcuda.so.1 is in ``libcuda_dirs`` (default: its own)."""
    if mode not in MODES:
        raise ManifestError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    module = BACKENDS.get(backend)
    if mode == "auto" and module is not None:
        mode = module.auto_mode()
    cls = module.TARGETS.get(mode) if module is not None else None
    if cls is None:
        have = ", ".join(f"{b}/{m}" for b, mod in sorted(BACKENDS.items()) for m in sorted(mod.TARGETS))
        raise EnvironmentProblem(f"no build target for backend {backend!r} in mode {mode!r} (available: {have})")
    options = {"libcuda_dirs": tuple(libcuda_dirs)} if libcuda_dirs else {}
    return cls(backend=backend, arch=arch, device_profile=device_profile, **options)


def select(manifest: Manifest, mode: str = "auto") -> tuple[Manifest, Target]:
    """The target that builds or checks ``manifest`` here in ``mode`` (not activated), and the manifest as this
    process serves it: on an Ascend node (device mode) narrowed to the node's own SoC, one of the manifest's
    (fails closed where it cannot tell)."""
    target = get_target(manifest.backend, manifest.arch, mode, manifest_device(manifest), manifest.libcuda_dirs)
    if manifest.backend == "npu" and target.mode == "device":
        manifest = npu.for_soc(manifest, npu.node_soc(manifest))
        target = dataclasses.replace(target, arch=manifest.arch)
    return manifest, target


def plan_targets(manifest: Manifest, mode: str = "auto") -> list[tuple[Manifest, Target]]:
    """What ``prewarm plan`` expands ``manifest`` under (not activated). Planning needs no node: an npu manifest is
    planned for every SoC it lists, each under its target-only driver (the offline target), unless ``mode`` is
    "device" (then as :func:`select`: the node's own SoC); a CUDA manifest as :func:`select`."""
    if manifest.backend == "npu" and mode != "device":
        device = manifest_device(manifest)
        return [(npu.for_soc(manifest, soc), get_target("npu", soc, "offline", device)) for soc in npu.socs(manifest)]
    return [select(manifest, mode)]


def activate_for_planning(manifest: Manifest) -> None:
    """A process that only plans (``prewarm plan``, ``lower``), before any provider is imported: device queries
    answer as the manifest's ``[target] device`` where no real device answers them, and on Ascend triton-ascend's
    target-only driver is active (triton 3.2's Autotuner asks the driver for a benchmarker at import)."""
    module = BACKENDS.get(manifest.backend)
    if module is not None:
        module.activate_for_planning(manifest.arch, manifest_device(manifest))


def probe_modules(target: Target, compiles: list, results: list, cache_dir: str) -> list:
    """The C modules ``target``'s runtime builds at first launch for the planned compiles that hit (``results``:
    prewarm.building.probe's), looked up in ``cache_dir`` through the backend's own classes (``ModuleResult`` each)."""
    return BACKENDS[target.backend].probe_modules(target, compiles, results, cache_dir)
