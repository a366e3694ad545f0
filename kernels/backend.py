"""Backend selection in one place: which kernel object, configs and constexprs a launch uses.

On Ascend (``torch_npu`` importable and an NPU present) the raw JIT kernels run with pinned configs, because
autotuning there is slow and the pinned values are the measured ones. Everywhere else the autotuned wrappers
run. The planner queries :func:`select` (nothing is launched) and overrides detection with :func:`use` when it
plans for a machine that is not this one.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from triton.runtime.autotuner import Autotuner

from .launch import launch

NPU = "npu"
DEFAULT = "default"
_ALIASES = {"npu": NPU, "ascend": NPU, "default": DEFAULT, "cuda": DEFAULT, "gpu": DEFAULT}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("prewarm_kernels_backend", default=None)


def normalize(backend: str) -> str:
    try:
        return _ALIASES[backend.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown backend {backend!r}: expected one of {sorted(_ALIASES)}") from None


@functools.cache
def _npu_present() -> bool:
    """Asked once per process (an import probe costs ~20 us, and every launch's dispatch asks)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def detect() -> str:
    """"npu" when torch_npu is importable and an NPU is present, else "default" (a :func:`use` override wins)."""
    forced = _override.get()
    if forced is not None:
        return forced
    return NPU if _npu_present() else DEFAULT


@contextlib.contextmanager
def use(backend: str) -> Iterator[str]:
    """Plan or run as if on ``backend`` ("npu", or "cuda"/"default"), whatever this machine is."""
    token = _override.set(normalize(backend))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


@dataclass(frozen=True)
class Entry:
    """One kernel as the registry knows it: the autotuned object and its pinned (NPU) config."""

    kernel: Any  # the module-level object: a triton Autotuner wrapping the JITFunction, or a bare JITFunction
    pinned: dict  # meta constexprs plus num_warps / num_stages used on the NPU
    autotune_default: bool = True  # False: launched raw with `default_config` off the NPU too
    default_config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Selection:
    """What a launch of ``name`` uses on ``backend``: the recorded kernel object, its configs, its constexprs."""

    name: str
    backend: str
    kernel: Any
    autotuned: bool
    configs: list[dict]
    constexprs: dict  # the config-chosen constexprs fixed by the selection ({} when autotune picks them)
    launch_kwargs: dict  # what the wrapper adds to the launch (constexprs + num_warps/num_stages) when not autotuned


# Filled by the kernel modules themselves as they are imported (``register`` at module level); this module imports
# none of them, so the dependency runs one way: importing a kernel package (``prewarm_kernels.kda``) registers its
# kernels.
REGISTRY: dict[str, Entry] = {}


def register(name: str, entry: Entry) -> None:
    REGISTRY[name] = entry
    _launch_selection.cache_clear()


def _config_dict(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _split(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages", "num_ctas", "maxnreg")}


def select(name: str, backend: str | None = None) -> Selection:
    """Describe the launch of kernel ``name`` on ``backend`` (default: :func:`detect`) without launching."""
    if name not in REGISTRY:
        raise KeyError(f"unknown kernel {name!r}: registered kernels are {sorted(REGISTRY)} (a kernel registers when "
                       f"its package is imported, e.g. `import prewarm_kernels.kda`)")
    entry = REGISTRY[name]
    backend = normalize(backend) if backend is not None else detect()
    jit = entry.kernel.fn if isinstance(entry.kernel, Autotuner) else entry.kernel
    if backend == NPU:
        return Selection(name, backend, jit, False, [dict(entry.pinned)], _split(entry.pinned), dict(entry.pinned))
    if not entry.autotune_default:
        cfg = entry.default_config
        return Selection(name, backend, jit, False, [dict(cfg)], _split(cfg), dict(cfg))
    configs = [_config_dict(c) for c in entry.kernel.configs]
    return Selection(name, backend, entry.kernel, True, configs, {}, {})


@functools.cache
def _launch_selection(name: str, backend: str) -> Selection:
    """:func:`select` once per (kernel, backend) for launches: a decode step is launch-bound, and an entry only
    changes by :func:`register`, which clears this."""
    return select(name, backend)


def dispatch(name: str, grid: Callable[[dict], tuple], *args, **kwargs) -> None:
    """Launch ``name`` through :func:`launch` as the current backend selects it."""
    sel = _launch_selection(name, detect())
    if sel.autotuned:
        launch(sel.kernel, grid, *args, **kwargs)
    else:
        launch(sel.kernel, tuple(grid(sel.launch_kwargs)), *args, **kwargs, **sel.launch_kwargs)
