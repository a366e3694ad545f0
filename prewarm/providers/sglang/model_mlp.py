"""Kimi-Linear's gated-SiLU activations as sglang 0.5.23 runs them on CUDA: the model component ``dense_mlp`` of
``prewarm.providers.sglang.cuda`` (and the MoE's activations, which reach the same module).

The dense MLP (the first ``first_k_dense_replace`` layers) and each MoE layer's shared experts are ``KimiMLP``
(``LlamaMLP``): ``gate_up_proj`` (cuBLAS), ``SiluAndMul``, ``down_proj``. On CUDA ``SiluAndMul.forward_cuda`` calls
``srt/layers/activation.py``'s ``silu_and_mul``, which takes sglang's JIT ``silu_and_mul``
(``sglang.kernels.ops.activation.activation``) where the per-rank width is a multiple of the vector width
(``_jit_act_supported``: 16 bytes below sm_100, 32 from it, over the dtype's size) and sgl-kernel's ahead-of-time op
otherwise. The routed experts' activation between the two ``fused_moe_kernel`` GEMMs (``_fused_moe_kernel_sequence``,
activation ``silu``, no clamp: Kimi-Linear has no ``activation_situ_*``) is the same JIT function on
``intermediate_cache1.view(-1, N)``. Every one of these loads one module per dtype, ``activation_module(dtype)``:
``load_jit("activation", <dtype>, <PDL>)`` (PDL: sm_90 and above), built with ``--use_fast_math``; the module's
wrappers (plain, filtered, sorted-filtered) are one build, so a row filter changes nothing that is compiled.

``silu_and_mul`` enters the JIT module through sglang's ``register_custom_op`` ops, which on a GPU run their body in
eager (``_call_directly_in_eager``) but under a fake-tensor mode dispatch to their fake implementation, whose
``load_jit`` never runs: :func:`eager_custom_ops` makes them run their body within the block, as a server's eager
call does, so the module sglang loads is the one recorded (:func:`prewarm.providers.sglang.jit.capture_requests`).
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

COMPONENT = "dense_mlp"
KERNELS = ()  # no Triton kernel: the component's activation is sglang's JIT module 'activation'
ACTIVATION = "sglang.kernels.ops.activation.activation"  # sglang's JIT activation functions
NOT_PLANNED = [
    {"what": "gate_up_proj / down_proj", "why": "bf16 GEMMs through torch (cuBLAS): nothing to compile"},
]


@dataclass(frozen=True)
class MlpSpec:
    """The gated MLP widths per rank that reach ``silu_and_mul`` (``[spec.sglang.model]``)."""

    dense: int  # intermediate_size / tensor_parallel: the dense MLP's activation width
    shared: int  # moe_intermediate_size x num_shared_experts / tensor_parallel (0: no shared experts)
    routed: int  # moe_intermediate_size / tensor_parallel: one routed expert's activation width
    dtypes: tuple  # the model's activation dtypes ([spec.dtypes] activation)


def read(spec: dict, s) -> MlpSpec | None:
    """The widths of ``[spec.sglang.model]`` (None where the manifest has no such table, or no ``intermediate_size``:
    the MLPs are not planned). A bad value is a SpecError naming ``spec.sglang.model.<key>``."""
    from prewarm_kernels.spec import SpecError

    model = (spec.get("sglang") or {}).get("model")
    if not isinstance(model, dict) or "intermediate_size" not in model:
        return None
    values = {}
    for key, where, least in (("intermediate_size", "config.json intermediate_size (the dense MLP)", 1),
                              ("moe_intermediate_size", "config.json moe_intermediate_size", 1),
                              ("num_shared_experts", "config.json num_shared_experts", 0)):
        v = model.get(key, 0 if key == "num_shared_experts" else None)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise SpecError(f"sglang.model.{key}", v if key in model else ..., f"an integer >= {least}: {where}")
        values[key] = v
    tp = s.parallel[0]
    for key in ("intermediate_size", "moe_intermediate_size"):
        if values[key] % tp:
            raise SpecError(f"sglang.model.{key}", values[key], f"divisible by the tensor-parallel size ({tp}): "
                            f"each rank holds a slice of the MLP")
    return MlpSpec(dense=values["intermediate_size"] // tp,
                   shared=values["moe_intermediate_size"] * values["num_shared_experts"] // tp,
                   routed=values["moe_intermediate_size"] // tp, dtypes=tuple(s.dtypes["activation"]))


def jit_width(width: int, dtype) -> bool:
    """``srt/layers/activation.py``'s ``_jit_act_supported`` for an output ``width`` wide: sglang's JIT kernel where the
    width is a multiple of its vector (16 bytes below sm_100, 32 from it), sgl-kernel's ahead-of-time op otherwise
    (the device profile answers the capability)."""
    import torch

    major, _ = torch.cuda.get_device_capability()
    return width % ((32 if major >= 10 else 16) // dtype.itemsize) == 0


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of each gated activation the model runs at each activation dtype: the dense MLP's and the
    shared experts' (``SiluAndMul.forward_cuda``), the routed experts' (between the MoE GEMMs); none without
    ``[spec.sglang.model] intermediate_size``. One token: the module does not depend on the batch."""
    import torch

    m = read(spec, s)
    if m is None:
        return
    for name in m.dtypes:
        dtype = getattr(torch, name)
        for label, width in (("dense_mlp/silu_and_mul", m.dense), ("moe/shared_experts.silu_and_mul", m.shared),
                             ("moe/experts.silu_and_mul", m.routed)):
            if width and jit_width(width, dtype):
                yield (f"{label}[I={width},{name}]",
                       lambda width=width, dtype=dtype: _silu_and_mul(width, dtype, device))


def _silu_and_mul(width: int, dtype, device: str) -> None:
    """``SiluAndMul.forward_cuda`` (and the MoE's call on its gate/up cache): ``[tokens, 2 x width]`` in, a fresh
    ``[tokens, width]`` out."""
    import torch

    activation = importlib.import_module(ACTIVATION)
    x = torch.empty(1, 2 * width, dtype=dtype, device=device)
    out = torch.empty(1, width, dtype=dtype, device=device)
    with eager_custom_ops(activation):
        activation.silu_and_mul(x, out)


@contextlib.contextmanager
def eager_custom_ops(module) -> Iterator[None]:
    """Within the block each of ``module``'s functions registered by sglang's ``register_custom_op`` (its eager
    fast path, ``_call_directly_in_eager``) is its own body, as a GPU's eager call runs it: under a fake-tensor mode
    the registered op would run its fake implementation and never load the module."""
    from sglang.srt.utils import custom_op

    fast_path = custom_op._call_directly_in_eager(lambda: None, None).__code__
    saved = {name: fn for name, fn in vars(module).items()
             if getattr(fn, "__code__", None) is fast_path and hasattr(fn, "__wrapped__")}
    if not saved:
        from ...errors import EnvironmentProblem

        raise EnvironmentProblem(f"{module.__name__}: no function registered through sglang's register_custom_op "
                                 f"eager fast path (SGLANG_KERNEL_API_LOGLEVEL set? it keeps every call on the "
                                 f"dispatcher): the JIT modules its functions load cannot be planned")
    for name, fn in saved.items():
        setattr(module, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook (its JIT module is listed with the plan's JIT
    modules, not here: the hook counts Triton kernels)."""
    model = (spec.get("sglang") or {}).get("model") or {}
    if "intermediate_size" not in model:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": f"{ACTIVATION}:silu_and_mul (sglang JIT module 'activation')",
             "why": "no [spec.sglang.model] intermediate_size: the MLP widths are not stated"}]}
    return {"component": COMPONENT, "planned": [], "not_planned": [dict(d) for d in NOT_PLANNED]}
