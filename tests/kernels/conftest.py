"""Kernel tests run the real Triton kernels in the interpreter (no GPU here), in fp32.

Triton decides interpreter-or-compiler when ``@triton.jit`` decorates a function (``knobs.runtime.interpret`` at
import time), and other test directories need the compiled (non-interpreted) kernels. So the ``pk`` fixture sets
TRITON_INTERPRET=1 only while a kernel test module runs and imports a private copy of ``prewarm_kernels`` under it
(sys.modules is restored afterwards, so nobody else sees interpreted kernels).

The Triton 3.6 interpreter converts scalars with ``int(array)`` on 1-element arrays, which NumPy >= 2.4 rejects
(``for i in range(runtime_int)`` fails); the fixture makes that conversion take the single element.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch


def _fix_interpreter_index():
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    return lambda: setattr(interp, "_patch_lang_tensor", orig)


@pytest.fixture(scope="module")
def pk():
    """A fresh, interpreted import of prewarm_kernels (namespace with its modules)."""
    saved = {n: m for n, m in sys.modules.items() if n == "prewarm_kernels" or n.startswith("prewarm_kernels.")}
    for n in saved:
        del sys.modules[n]
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    undo = _fix_interpreter_index()
    try:
        mods = {name: importlib.import_module(f"prewarm_kernels.{name}") for name in
                ("backend", "launch", "index", "kda", "kda.chunk", "kda.cumsum", "kda.intra", "kda.solve",
                 "kda.recompute", "kda.state", "kda.output", "kda.recurrent", "kda.reference", "kda.l2norm",
                 "kda.serving")}
        ns = SimpleNamespace(**{k.replace("kda.", ""): v for k, v in mods.items()})
        ns.make_inputs, ns.max_err = make_inputs, max_err
        ns.one_config = lambda index: one_config(ns, index)
        yield ns
    finally:
        undo()
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
        for n in [n for n in sys.modules if n == "prewarm_kernels" or n.startswith("prewarm_kernels.")]:
            del sys.modules[n]
        sys.modules.update(saved)


@contextlib.contextmanager
def one_config(pk, index: int):
    """Autotuned path with every autotuner narrowed to its config ``index`` (the interpreter cannot benchmark)."""
    saved = {}
    for name, entry in pk.backend.REGISTRY.items():
        cfgs = getattr(entry.kernel, "configs", None)
        if cfgs is not None:
            saved[name] = cfgs
            entry.kernel.configs = [cfgs[index % len(cfgs)]]
    try:
        with pk.backend.use("default"):
            yield
    finally:
        for name, cfgs in saved.items():
            pk.backend.REGISTRY[name].kernel.configs = cfgs


def make_inputs(B, T, H, K, V, seed=0, pool=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)  # as in the model: keeps the delta rule contractive
    v = torch.randn(B, T, H, V, generator=g)
    gate = -torch.rand(B, T, H, K, generator=g) * 0.3 - 0.01
    beta = torch.rand(B, T, H, generator=g) * 0.9 + 0.05
    h0 = torch.randn(pool, H, K, V, generator=g) * 0.5 if pool else None
    return q, k, v, gate, beta, h0


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())
