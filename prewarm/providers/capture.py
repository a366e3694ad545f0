"""Running a library's kernel wrappers where there is no device, every launch captured: what the third-party
providers (sglang's, vLLM's) and their independent traffic share.

- :func:`fake_tensors`: tensors made on a device type (``cuda``, ``npu``: a device profile answers its queries) are
  fake (torch's ``FakeTensorMode``: shapes, strides, storage offsets; no memory, nothing runs), so device-typed
  choices a wrapper makes come out as on the node. Data-dependent shapes (a ``nonzero()`` over valid rows) get
  unbacked sizes from a shape environment; no Triton launch receives one.
- Wrappers count chunks on the host (``prepare_chunk_indices``: ``.tolist()`` of ``cu_seqlens``), which a fake tensor
  cannot answer: :func:`index_tensor` keeps the values beside a fake index tensor, and inside :func:`fake_tensors`
  each library's own ``prepare_chunk_indices`` (named by its home module) computes from them on the CPU (its pinned
  host staging on plain host memory: pinning needs the driver).
- :func:`launches_of` runs one call with every ``kernel[grid](...)`` captured (``prewarm.providers.fla.kda``'s
  interception), never launched; :func:`as_meta` turns a fake tensor into a ``meta`` tensor of the same layout,
  which Triton's JIT can bind (its alignment class included) where it cannot bind a fake one.
- :func:`batch_sizes`: the batch sizes whose launches stand for every size up to a maximum; :class:`TensorCache`,
  what a provider's call builder makes once.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from typing import Any, Callable, Iterator

VALUES = "_prewarm_values"  # attribute of a fake index tensor: its values, for host code that reads them


def index_tensor(values: list[int], dtype, device) -> Any:
    """``torch.tensor(values, dtype, device)``; on a fake device also the values, for the library's host code."""
    import torch

    t = torch.tensor(values, dtype=dtype, device=device)
    if _is_fake(t):
        setattr(t, VALUES, list(values))
    return t


@contextlib.contextmanager
def fake_tensors(chunk_index_homes: dict[str, str]) -> Iterator[None]:
    """Within the block tensors are fake, and for each ``package -> home module`` whose home is imported, every
    module of the package that uses the home's ``prepare_chunk_indices`` reads :func:`index_tensor` values."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    patches = []  # (module, original)
    for package, home in chunk_index_homes.items():
        if home not in sys.modules:
            continue  # not imported by whoever plans: nothing of it runs
        original = importlib.import_module(home).prepare_chunk_indices
        replacement = _host_chunk_indices(original)
        for name, module in list(sys.modules.items()):
            if name.startswith(package) and getattr(module, "prepare_chunk_indices", None) is original:
                module.prepare_chunk_indices = replacement
                patches.append((module, original))
    mode = _deviceless_fake_mode()(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    # a FakeTensor on a GPU first makes one real tensor there (for autograd) when torch.cuda says a GPU is present,
    # as a device profile does: nothing here needs it
    gpu_context, fake_tensor.init_gpu_context = fake_tensor.init_gpu_context, lambda device: None
    try:
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            yield
    finally:
        fake_tensor.init_gpu_context = gpu_context
        for module, original in patches:
            module.prepare_chunk_indices = original


def _host_chunk_indices(original: Callable) -> Callable:
    """``prepare_chunk_indices`` that, on a fake ``cu_seqlens``, computes from its :func:`index_tensor` values with
    the library's own function on the CPU (it reads the lengths on the host: ``.tolist()``)."""
    def chunk_indices(cu_seqlens, chunk_size: int):
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if not _is_fake(cu_seqlens):
            return original(cu_seqlens, chunk_size)
        values = getattr(cu_seqlens, VALUES, None)
        if values is None:
            raise ValueError("the library reads cu_seqlens on the host (prepare_chunk_indices), but this fake "
                             "tensor's values are unknown: make it with prewarm.providers.capture.index_tensor")
        with unset_fake_temporarily(), _pageable_host():
            real = original(torch.tensor(values, dtype=cu_seqlens.dtype), chunk_size)
        return torch.empty(tuple(real.shape), dtype=real.dtype, device=cu_seqlens.device)

    return chunk_indices


@contextlib.contextmanager
def _pageable_host() -> Iterator[None]:
    """Within the block host memory asked for pinned (page-locked by the driver: a library stages index values there
    before copying them to the device, vLLM's ``async_tensor_h2d``) is plain host memory: a factory's
    ``pin_memory=True`` is dropped and pinning returns the tensor. The values are the same; no driver is asked."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    pin = {torch.ops.aten._pin_memory.default, torch.ops.aten.pin_memory.default}

    class Pageable(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in pin:
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return func(*args, **kwargs)

    with Pageable():
        yield


def _deviceless_fake_mode():
    import torch
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    like = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
            aten.clone.default}
    views = {aten.view.default, aten._unsafe_view.default}

    class DevicelessFakeMode(FakeTensorMode):
        """FakeTensorMode that never materializes a tensor on the device: torch's own mode does for
        ``torch.tensor(...)`` and indexing when ``torch.cuda.is_available()``, which a device profile answers True.

        Strides of size-1 dims come out as eager torch gives them, where torch's fake kernels give others (a
        wrapper hands them to kernels that take strides as constexprs; a one-row batch has such dims):
        ``*_like`` and ``clone`` keep the input's strides where eager does (an input that is non-overlapping and
        dense, ``preserve_format``), and ``view`` / ``reshape`` compute them as eager's ``computeStride`` does
        (:func:`_eager_view_strides`)."""

        avoid_device_init = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            src = args[0] if args else None
            if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
                return out
            if func in like and (kwargs or {}).get("memory_format", torch.preserve_format) == torch.preserve_format \
                    and out.shape == src.shape and out.stride() != src.stride() and is_non_overlapping_and_dense(src):
                return out.as_strided(src.shape, src.stride())
            if func in views:
                strides = _eager_view_strides(tuple(src.shape), tuple(src.stride()), tuple(out.shape))
                if strides is not None and strides != tuple(out.stride()):
                    return out.as_strided(out.shape, strides, out.storage_offset())
            return out

    return DevicelessFakeMode


def _eager_view_strides(shape: tuple, strides: tuple, new_shape: tuple) -> tuple | None:
    """The strides eager torch gives ``view(new_shape)`` of a tensor (ATen's ``computeStride``: size-1 dims take
    the stride of the chunk they sit in); None where it cannot tell (symbolic sizes, an empty tensor, no view)."""
    if not all(isinstance(n, int) for n in (*shape, *strides, *new_shape)) or 0 in shape or not shape:
        return None
    out = [0] * len(new_shape)
    view_d, chunk_base = len(new_shape) - 1, strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[tensor_d]
        if tensor_d == 0 or (shape[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                out[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base, tensor_numel, view_numel = strides[tensor_d - 1], 1, 1
    return tuple(out) if view_d == -1 else None


def launches_of(call: Callable[[], object]) -> list:
    """The kernel launches ``call`` makes (``prewarm.providers.fla.kda.Launch`` each), captured, none launched."""
    from .fla.kda import intercepted

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
    """A tensor whose data pointer is not 16-byte aligned (what Triton specializes pointers on): a view whose storage
    offset is not a multiple of 16 bytes (every allocation is aligned). The plan encodes it (``"aligned": false``,
    :func:`prewarm.planning.plan.decode` gives a meta view Triton binds in the same class)."""
    import torch

    return isinstance(value, torch.Tensor) and value.storage_offset() * value.element_size() % 16 != 0


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes that stand for 1..``max_batch``: 1, 2, 3 (a one-row view's strides can differ from a
    many-row one's), each power of two and the one after it (every ``next_pow2`` of the tokens, dense or ragged: any
    interval (x, 2x] holds a power of two), and the largest. The providers' tests check that every batch size adds
    nothing to them."""
    sizes = {1, 2, 3, max_batch, *(p + d for p in (1 << k for k in range(max_batch.bit_length())) for d in (0, 1))}
    return sorted(b for b in sizes if 1 <= b <= max_batch)


class TensorCache:
    """Tensors made once per key on the subclass's ``device`` (a fake op costs about a millisecond)."""

    device: str

    def once(self, key, make):
        made = self.__dict__.setdefault("_made", {})
        if key not in made:
            made[key] = make()
        return made[key]

    def zeros(self, *shape, dtype):
        import torch

        return torch.zeros(*shape, dtype=dtype, device=self.device)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
