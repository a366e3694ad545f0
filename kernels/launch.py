"""One place where kernels are launched, so a launch can be captured instead of run.

Wrappers never call ``kernel[grid](...)`` themselves: they call :func:`launch`. Inside :func:`capture` the
launch is recorded (kernel object, grid, arguments) and nothing runs, so calling the real wrapper on ``meta``
tensors yields exactly the compile requests the runtime will make. A planner (prewarm, or anything else) reads
the records by duck typing; this package never imports it.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Launch:
    kernel: Any  # a triton JITFunction, or an Autotuner / Heuristics wrapping one
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""  # what call produced it (set by the caller of capture)


_sink: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("kernels_launch_sink", default=None)


def launch(kernel, grid, *args, **kwargs) -> None:
    sink = _sink.get()
    if sink is not None:
        sink.append(Launch(kernel, tuple(grid) if not callable(grid) else grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record launches instead of running them (for planning on ``meta`` tensors)."""
    records: list[Launch] = []
    token = _sink.set(records)
    try:
        yield records
    finally:
        _sink.reset(token)
