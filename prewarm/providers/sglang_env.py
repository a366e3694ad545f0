"""Running sglang's KDA kernels where there is no device: what the sglang provider and the sglang traffic share.

sglang 0.5.23 makes host-side decisions from the tensors it is given, and planning must make each as the node does:

- ``fused_sigmoid_gating_delta_rule_update`` derives the constexpr ``SPLIT_N_HV_GRID`` from ``q.device.type``
  (``"cuda"`` on the H200, ``"npu"`` on Ascend): on ``meta`` tensors it would plan a variant no server compiles.
  :func:`fake_device` makes the tensors created inside live on the target's device type, faked by torch's
  ``FakeTensorMode`` (shapes, strides, storage offsets; no memory, no device, nothing runs).
- ``chunk_kda`` counts chunks on the host (``prepare_chunk_indices``: ``.tolist()`` of ``cu_seqlens``), which a fake
  tensor cannot answer. :func:`index_tensor` keeps the values beside a fake index tensor, and inside
  :func:`fake_device` sglang's ``prepare_chunk_indices`` computes from them with sglang's own function on the CPU.
- ``fused_recurrent_kda_packed_decode`` hands bf16 batches of 8 or more to a CUDA JIT kernel (tvm_ffi + nvcc,
  ``kda_packed_decode``), which is not a Triton kernel: prewarm cannot build it and a planner must not call it.
  Inside :func:`fake_device` that call does nothing and is counted (:attr:`FakeDevice.jit_calls`).

:func:`launches_of` runs one call with every ``kernel[grid](...)`` captured (``prewarm.providers.fla_kda``'s
interception), never launched; :func:`as_meta` turns a fake tensor into a ``meta`` tensor of the same layout, which
Triton's JIT can bind (its alignment class included) where it cannot bind a fake one. :func:`read_spec` is the
manifest's envelope as both see it.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prewarm_kernels.spec import FLA_CALL_OPTIONS, SpecError, read_kda

VALUES = "_prewarm_values"  # attribute of a fake index tensor: its values, for host code that reads them
FLA_PACKAGE = "sglang.kernels.ops.attention.fla"
# What each backend's sglang KDA backend runs through Triton (kda_backend.py; on Ascend ascend_kda_backend.py)
PATHS = {"cuda": ("extend", "packed_decode", "decode", "target_verify"),
         "npu": ("ascend_extend", "decode", "target_verify")}
# TritonKDAKernel's API reaches it there, the backend does not, and a plan cannot hold it yet: on npu chunk_kda runs
# recompute_w_u_fwd_kernel, an Autotuner bound to a module name its function does not have (prewarm.plan refers to
# kernels by their function's name), where the H200 takes the raw kernel with a static config
NOT_PLANNABLE = {"npu": ("extend",)}
ROLES = ("activation", "gate", "beta", "gate_params", "state", "index")  # [spec.dtypes] roles, in label order
MAX_PREFILL_TOKENS = 16384  # a prefill batch's token budget when the spec gives none (sglang's chunked prefill)


@dataclass(frozen=True)
class SglangSpec:
    """The envelope of one sglang KDA deployment (one attention rank), as both the provider and the traffic read it."""

    backend: str  # the target's: "cuda" | "npu"
    heads: int  # KDA heads per attention rank
    head_k_dim: int
    head_v_dim: int
    lower_bound: float | None  # the model's gate lower bound (safe gate), or None
    dtypes: dict  # role (ROLES) -> dtype names
    paths: tuple  # TritonKDAKernel paths the deployment reaches (PATHS)
    max_batch: int  # the largest decode batch: max(largest graph bucket, max_running_requests)
    draft_widths: tuple  # speculative draft token counts > 1
    max_prefill_tokens: int
    beta_row_strides: tuple  # per-token strides of raw beta as the model hands it over
    eagle_tree: bool  # tree verify (--speculative-eagle-topk > 1: retrieve_parent_token)
    track_state: bool  # the prefix cache's per-chunk state snapshot in prefill (track_state)

    @property
    def device(self) -> str:
        """The torch device type sglang's tensors live on there (the backend's name: cuda, npu)."""
        return self.backend

    def dtype_combos(self) -> list[dict]:
        """Every combination of one dtype per role (the cross product the plan covers)."""
        return [dict(zip(ROLES, combo)) for combo in itertools.product(*(self.dtypes[r] for r in ROLES))]


def read_spec(spec: dict) -> SglangSpec:
    """The KDA serving spec (``read_kda``: model, parallel, dtypes, serving) plus the ``[spec.sglang]`` table:

        paths = every path the backend reaches (PATHS)
        beta_row_strides = [heads, 3*heads*head_k_dim + heads + 2*head_k_dim]: raw beta as its own tensor and as a
                           view of Kimi-Linear's fused q/k/v/beta/f_a/g_a projection (both rows per rank)
        eagle_tree = true, track_state = true

    A bad value is a SpecError naming ``spec.<key>``."""
    extra = spec.get("sglang", {})
    read = read_kda({k: v for k, v in spec.items() if k != "sglang"})
    backend = read["backend"]
    if backend not in PATHS:
        raise SpecError("backend", backend, f"one of {', '.join(PATHS)} ([target] backend): sglang's KDA kernels")
    fla_only = sorted(set(spec.get("serving", {})) & set(FLA_CALL_OPTIONS))  # read_kda's; not silently ignored
    if fla_only:
        raise SpecError(f"serving.{fla_only[0]}", spec["serving"][fla_only[0]], "absent: an option of fla-core's "
                        "KDA (prewarm.providers.fla_kda); sglang's are under [spec.sglang]")
    for key, why in (("qk_l2norm", "TritonKDAKernel always L2-normalises q and k in-kernel"),
                     ("fused_gate", "sglang's KDA backend always hands the raw gate with A_log and dt_bias")):
        if not read[key]:
            raise SpecError(f"serving.{key}", False, f"true (or absent): {why}")
    if not isinstance(extra, dict):
        raise SpecError("sglang", extra, "a table")
    unknown = sorted(set(extra) - {"paths", "beta_row_strides", "eagle_tree", "track_state"})
    if unknown:
        raise SpecError(f"sglang.{unknown[0]}", extra[unknown[0]],
                        "no such key here (known: beta_row_strides, eagle_tree, paths, track_state)")
    h, K = read["heads"], read["head_k_dim"]
    paths = extra.get("paths", list(PATHS[backend]))
    if not isinstance(paths, list) or not paths or len(set(paths)) != len(paths) or \
            any(p not in PATHS[backend] for p in paths):
        unplannable = [p for p in paths if p in NOT_PLANNABLE.get(backend, ())] if isinstance(paths, list) else []
        why = (f" ({unplannable[0]} on {backend}: sglang's chunk_kda there launches an autotuned kernel bound under "
               f"another name, which a plan cannot refer to yet)") if unplannable else f" (on {backend})"
        raise SpecError("sglang.paths", paths, f"a non-empty list of distinct paths out of {list(PATHS[backend])}{why}")
    rows = extra.get("beta_row_strides", [h, 3 * h * K + h + 2 * K])
    if not isinstance(rows, list) or not rows or len(set(rows)) != len(rows) or \
            any(not isinstance(r, int) or isinstance(r, bool) or r < h for r in rows):
        raise SpecError("sglang.beta_row_strides", rows, f"a non-empty list of distinct integers >= the heads per "
                        f"rank ({h}): beta's per-token stride in each layout the model hands it over")
    switches = {}
    for key in ("eagle_tree", "track_state"):
        switches[key] = extra.get(key, True)
        if not isinstance(switches[key], bool):
            raise SpecError(f"sglang.{key}", switches[key], "true or false")
    decoding = any(p in paths for p in ("packed_decode", "decode", "target_verify"))
    max_batch = max([*read["decode_batch_buckets"], read["max_running_requests"] or 0])
    if decoding and not max_batch:
        raise SpecError("serving.max_running_requests", ..., "the largest decode batch (or decode_batch_buckets): "
                        "sglang runs eager decode batches of any size up to it")
    return SglangSpec(backend=backend, heads=h, head_k_dim=K, head_v_dim=read["head_v_dim"],
                      lower_bound=read["gate_lower_bound"], dtypes={r: read["dtypes"][r] for r in ROLES},
                      paths=tuple(paths), max_batch=max(max_batch, 1),
                      draft_widths=tuple(sorted(d for d in read["draft_widths"] if d > 1)),
                      max_prefill_tokens=read["max_prefill_tokens"] or MAX_PREFILL_TOKENS,
                      beta_row_strides=tuple(rows), **switches)


@dataclass
class FakeDevice:
    """The device a :func:`fake_device` block creates tensors on, and what sglang did there outside Triton."""

    device: str  # "cuda" | "npu"
    jit_calls: list[str] = field(default_factory=list)  # one entry per call of sglang's CUDA JIT packed decode


def index_tensor(values: list[int], dtype, device) -> Any:
    """``torch.tensor(values, dtype, device)``; on a fake device also the values, for sglang's host code."""
    import torch

    t = torch.tensor(values, dtype=dtype, device=device)
    if _is_fake(t):
        setattr(t, VALUES, list(values))
    return t


@contextlib.contextmanager
def fake_device(device: str) -> Iterator[FakeDevice]:
    """Within the block, tensors made on ``device`` (``"cuda"`` or ``"npu"``, whose queries a device profile answers)
    are fake; sglang's chunk counting reads :func:`index_tensor` values; its CUDA JIT packed decode is not called."""
    from torch._subclasses import fake_tensor

    import sglang.srt.layers.attention.linear.kernels.kda_triton  # noqa: F401  (every kernel module, imported)
    from sglang.kernels.ops.attention.fla import index

    state = FakeDevice(device)

    def chunk_indices(cu_seqlens, chunk_size: int):
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if not _is_fake(cu_seqlens):
            return original(cu_seqlens, chunk_size)
        values = getattr(cu_seqlens, VALUES, None)
        if values is None:
            raise ValueError("sglang reads cu_seqlens on the host (prepare_chunk_indices), but this fake tensor's "
                             "values are unknown: make it with prewarm.providers.sglang_env.index_tensor")
        with unset_fake_temporarily():
            real = original(torch.tensor(values, dtype=cu_seqlens.dtype), chunk_size)
        return torch.empty(tuple(real.shape), dtype=real.dtype, device=cu_seqlens.device)

    original = index.prepare_chunk_indices
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith(FLA_PACKAGE) and getattr(m, "prepare_chunk_indices", None) is original]
    mode = _deviceless_fake_mode()(allow_non_fake_inputs=True)
    for module in patched:
        module.prepare_chunk_indices = chunk_indices
    # a FakeTensor on a GPU first makes one real tensor there (for autograd) when torch.cuda says a GPU is present,
    # as a device profile does: nothing here needs it
    gpu_context, fake_tensor.init_gpu_context = fake_tensor.init_gpu_context, lambda device: None
    try:
        with jit_skipped() as state.jit_calls, mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            yield state
    finally:
        fake_tensor.init_gpu_context = gpu_context
        for module in patched:
            module.prepare_chunk_indices = original


def _deviceless_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class DevicelessFakeMode(FakeTensorMode):
        """FakeTensorMode that never materializes a tensor on the device: torch's own mode does for
        ``torch.tensor(...)`` and indexing when ``torch.cuda.is_available()``, which a device profile answers True."""

        avoid_device_init = True

    return DevicelessFakeMode


@contextlib.contextmanager
def jit_skipped() -> Iterator[list[str]]:
    """Within the block sglang's CUDA JIT packed decode (``kda_packed_decode.kda_packed_decode``, called by
    ``fused_recurrent_kda_packed_decode`` where ``covered()``) does nothing; each call is listed (its batch size)."""
    import sglang.kernels.ops.attention.kda_packed_decode as jit

    calls: list[str] = []
    original = jit.kda_packed_decode

    def skipped(mixed_qkv, *args, **kwargs) -> None:
        calls.append(f"kda_packed_decode(batch={mixed_qkv.shape[0]})")

    jit.kda_packed_decode = skipped
    try:
        yield calls
    finally:
        jit.kda_packed_decode = original


def launches_of(call: Callable[[], object]) -> list:
    """The kernel launches ``call`` makes (``prewarm.providers.fla_kda.Launch`` each), captured, none launched."""
    from .fla_kda import intercepted

    with intercepted() as records:
        call()
    return records


def as_meta(value: Any) -> Any:
    """A fake (or real) tensor as a ``meta`` tensor of the same dtype, shape, strides and storage offset (so the
    same pointer alignment); anything else as it is."""
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    extent = 1 + value.storage_offset() + sum((n - 1) * s for n, s in zip(value.shape, value.stride()) if n)
    base = torch.empty(extent, dtype=value.dtype, device="meta")
    return base.as_strided(tuple(value.shape), tuple(value.stride()), value.storage_offset())


def misaligned(value: Any) -> bool:
    """A tensor whose data pointer is not 16-byte aligned (what Triton specializes pointers on)."""
    import torch

    return isinstance(value, torch.Tensor) and value.storage_offset() * value.element_size() % 16 != 0


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
