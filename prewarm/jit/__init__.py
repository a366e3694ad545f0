"""JIT modules past Triton: the C++/CUDA modules a serving library builds with nvcc at first use, into a cache dir of
its own (sglang's ``load_jit`` modules, FlashInfer's JIT modules). prewarm plans them (the planner records each
``JitRequest`` a provider's calls reach), builds them without an accelerator through the library's own build code for
the manifest's arch and this image's toolchain, packs them as bundles of their cache's layout (prewarm.shipping.layouts),
installs them into the dir the server reads, and asks the library's own lookup whether a node would find each one.

One small interface (:class:`JitLibrary`), one implementation per library, in its integration's folder
(``prewarm/providers/sglang/jit.py``, ``prewarm/providers/flashinfer/jit.py``), found through prewarm.providers'
registry: :func:`library` gives a request's, :func:`for_layout` a cache dir's.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class JitRequest:
    """One module a server's call reaches, as the library would be asked for it.

    ``library``: its integration's name in prewarm.providers' registry ("sglang", "flashinfer"). ``name``: the module
    as the library names it (sglang: ``BuildSpec.module_name``, e.g. ``sgl_kernel_jit_kda_packed_decode_8_8_true``;
    flashinfer: ``JitSpec.name``, e.g. ``sampling``). ``call``: JSON-able, what the library needs to ask for it again
    (sglang: ``load_jit``'s positional args and keyword args as the call site passed them; flashinfer: the dotted path
    of the ``gen_*_module`` function and its args).
    ``origin``: the planned call that reached it (for messages)."""
    library: str
    name: str
    call: Mapping = field(default_factory=dict, hash=False, compare=False)
    origin: str = field(default="", compare=False)

    def to_json(self) -> dict:
        return {"library": self.library, "name": self.name, "call": dict(self.call), "origin": self.origin}


@dataclass(frozen=True)
class Lookup:
    """The library's own answer for one request in one cache dir: hit (the path it would load) or why it would build."""
    request: JitRequest
    hit: bool
    path: str | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return {**self.request.to_json(), "hit": self.hit, "path": self.path, "reason": self.reason}


class JitLibrary(abc.ABC):
    name: str  # the request's library: its integration's name in prewarm.providers' registry
    cache_layout: Any  # the prewarm.shipping.layouts.Layout its cache dir has (not imported: layouts reads this registry)
    env_var: str  # the variable that moves the dir the server reads
    hook_module: str  # the library's module whose import lets ``watch_builds`` hook it (the guard waits for it)
    target_factor: str  # the factor of ``toolchain`` that names the GPU target (a device factor: prewarm.node.fingerprint)
    # what prewarm.nodestamp watches to reuse ``toolchain``'s factors without importing the library: its packages
    # whose code computes them (walked, not imported), the variables only it reads (never learnt as ignorable)
    stamp_code: tuple[str, ...] = ()
    env_prefixes: tuple[str, ...] = ()

    def compilers(self, environ: Mapping[str, str]) -> list[str]:
        """The compilers ``toolchain`` runs for their ``--version``, found as the library finds them (no import)."""
        return [nvcc_path(environ)]

    @property
    def layout(self) -> str:
        """The name of :attr:`cache_layout`."""
        return self.cache_layout.name

    @abc.abstractmethod
    def node_dir(self, environ: Mapping[str, str] = os.environ) -> Path:
        """The dir this library in a server process with ``environ`` reads its built modules from."""

    @abc.abstractmethod
    def toolchain(self, arch: str) -> dict[str, str]:
        """The factors the library's cache keys on besides the sources (compiler versions, package versions,
        target): the bundle's fingerprint; a node differing in one would rebuild."""

    @abc.abstractmethod
    def build(self, requests: list[JitRequest], root: Path, arch: str) -> list[Lookup]:
        """Build each request into ``root`` (a dir of this library's layout) for ``arch`` (e.g. "90" / "9.0a"),
        without an accelerator, through the library's own build code; then each one's lookup (all must hit)."""

    @abc.abstractmethod
    def lookup(self, requests: list[JitRequest], root: Path, arch: str | None = None) -> list[Lookup]:
        """Would this environment's library load each request from ``root`` without building? Its own lookup,
        stopped before any compile, for ``arch`` (None: the GPU this process's torch reports, as in the server)."""

    def where_to_point(self, installed: str) -> str:
        """What makes a server process read ``installed`` (a fix, for messages)."""
        return f"set {self.env_var}={installed} in the server's environment"

    @abc.abstractmethod
    def watch_builds(self, on_build: Callable[[str, str], None]) -> None:
        """In a serving process: call ``on_build(module, detail)`` when the library is about to build a module
        (a cache miss); an exception raised by ``on_build`` refuses the build (the guard's error mode)."""


def nvcc_path(environ: Mapping[str, str]) -> str:
    """The nvcc sglang, FlashInfer and tvm-ffi compile with: $CUDA_HOME or $CUDA_PATH, else the nvcc on PATH, else
    /usr/local/cuda's."""
    import shutil

    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if home is None:
        found = shutil.which("nvcc", path=environ.get("PATH"))
        home = os.path.dirname(os.path.dirname(found)) if found else "/usr/local/cuda"
    return os.path.join(home, "bin", "nvcc")


def parse_arch(arch: str) -> tuple[int, int, str]:
    """A CUDA arch as a manifest or a user writes it ("90", "9.0", "9.0a", "sm_90a", "100a") -> (major, minor, suffix);
    suffix "" where none is given (each library then picks its own, as for its detected GPU)."""
    import re

    m = re.fullmatch(r"(?:sm_?|compute_)?(\d+)\.?(\d)([a-z]?)", arch.strip().lower())
    if not m:
        raise ValueError(f"CUDA arch {arch!r}: expected e.g. 90, 9.0, 9.0a or sm_90a")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def library_names() -> tuple[str, ...]:
    """The integrations with a JIT library (prewarm.providers' registry), in registry order."""
    from ..providers import jit_libraries

    return tuple(jit_libraries())


def library(name: str) -> JitLibrary:
    """The implementation for a request's ``library``, as its integration names it in prewarm.providers' registry
    (imported on first use: each imports its library lazily)."""
    import importlib

    from ..providers import jit_libraries

    module, cls = jit_libraries()[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def for_layout(layout: str) -> JitLibrary:
    """The library whose built modules a dir of ``layout`` holds."""
    for name in library_names():
        lib = library(name)
        if lib.layout == layout:
            return lib
    raise KeyError(layout)


def by_library(requests: list[JitRequest]) -> dict[str, list[JitRequest]]:
    """The requests grouped by library, in first-seen order."""
    out: dict[str, list[JitRequest]] = {}
    for r in requests:
        out.setdefault(r.library, []).append(r)
    return out
