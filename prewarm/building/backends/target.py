"""The build target interface every backend implements (like Triton's runtime/cache.py managers)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

MODES = ("offline", "device", "auto")


@dataclass
class Target(ABC):
    """One build target: a backend + arch, and how this process sees and compiles for it.

    :meth:`activate` gives the process its device view (Triton's driver, device queries): enough to plan, expand
    and compute keys, so verify and ``plan --compiles`` call only it. :meth:`prepare_build` adds what compiling
    needs (a compiler, env); build calls both, in its parent and in every worker. Workers receive the target
    pickled: plain dataclass fields only."""

    backend: str
    arch: str
    device_profile: str | None = None  # a prewarm.devices profile name: device queries answer as that device
    fingerprint: dict | None = None  # this toolchain's factors (see toolchain())
    mode: ClassVar[str] = ""

    @abstractmethod
    def activate(self) -> None:
        """Make Triton in this process see this target (install a driver, answer device queries). Idempotent."""

    def prepare_build(self) -> None:
        """Check and set what compiling for this target needs besides :meth:`activate`. Idempotent."""

    def toolchain(self) -> dict:
        """This toolchain's fingerprint factors (``fingerprint.current``), computed once: on Ascend that runs
        bishengir-compile and hashes it, so build's parent computes it and its workers receive it with the target."""
        if self.fingerprint is None:
            from ...node import fingerprint

            self.fingerprint = fingerprint.current(self.backend, self.arch)
        return self.fingerprint

    def compile(self, fn: Any, specialization_data: str) -> Any:
        """Compile one request through the real JIT path. ``fn`` is the JITFunction the data was recorded on."""
        from .. import tritoncompat

        return tritoncompat.preload(fn, specialization_data)

    def after_build(self, providers: list[Any], spec: dict, cache_dir: str, compiles: list) -> list[str]:
        """Run once in the parent after every request (``compiles``, the plan's) compiled (device mode: autotune,
        launchers; offline CUDA: the C modules a node builds at first launch).

        Returns notes for the build report. The default (no device) does nothing.
        """
        return []

    def notes(self) -> list[str]:
        """Caveats a person must know about caches built by this target (shown by plan and build)."""
        return []

    def describe(self) -> str:
        return f"{self.backend} {self.arch} ({self.mode})"
