"""Kernel tests run the real Triton kernels in the interpreter (no GPU here), in fp32.

Triton decides interpreter-or-compiler when ``@triton.jit`` decorates a function (``knobs.runtime.interpret`` at
decoration time), and other test directories, in the same pytest process, need compiled kernels. So:
- triton itself (whose standard library, tl.sum, tl.cumsum..., is made of @jit functions) is always imported in
  compiled mode, before TRITON_INTERPRET is set;
- the ``pk`` fixture sets TRITON_INTERPRET=1 only while a kernel test module runs and imports a private copy of
  ``prewarm_kernels`` under it (sys.modules and the environment are restored afterwards: nobody else sees
  interpreted kernels, whichever order the directories run in);
- meanwhile a call of a compiled standard-library function from interpreted code (which Triton refuses: "Cannot
  call @triton.jit'd outside of the scope of a kernel") is interpreted too. Compiling never calls a JITFunction,
  so this changes nothing for compiled kernels.
The Triton 3.6 interpreter also converts scalars with ``int(array)`` on 1-element arrays, which NumPy >= 2.4
rejects (``for i in range(runtime_int)`` fails); the fixture makes that conversion take the single element.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import triton  # noqa: F401  (compiled mode: see above)
import triton.language  # noqa: F401


def _interpreter_patches():
    """Apply the two interpreter fixes described above; returns the function that undoes them."""
    import triton.runtime.interpreter as interp
    from triton.runtime.jit import JITFunction

    orig_patch, orig_call = interp._patch_lang_tensor, JITFunction.__call__
    interpreted: dict = {}

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def call(self, *args, **kwargs):
        fn = interpreted.get(self.fn)
        if fn is None:
            fn = interpreted[self.fn] = interp.InterpretedFunction(self.fn)
        # as InterpretedFunction.__call__, but undo the patching of triton.language.core afterwards (upstream
        # leaves it patched, which breaks every later compile in the process)
        scope = interp._patch_lang(self.fn)
        try:
            return fn.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    interp._patch_lang_tensor = patch_lang_tensor
    JITFunction.__call__ = call

    def undo():
        interp._patch_lang_tensor = orig_patch
        JITFunction.__call__ = orig_call

    return undo


@pytest.fixture(scope="module")
def pk():
    """A fresh, interpreted import of prewarm_kernels (namespace with its modules)."""
    saved = {n: m for n, m in sys.modules.items() if n == "prewarm_kernels" or n.startswith("prewarm_kernels.")}
    for n in saved:
        del sys.modules[n]
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    undo = _interpreter_patches()
    try:
        mods = {name: importlib.import_module(f"prewarm_kernels.{name}") for name in
                ("backend", "launch", "index", "kda", "kda.chunk", "kda.cumsum", "kda.intra",
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
