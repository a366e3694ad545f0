"""vLLM 0.34.0's staged writes in the V2 model runner (``vllm/v1/worker/gpu/buffer_utils.py``): the component
``staged`` of ``prewarm.providers.vllm.kda``.

Each step ``GPUModelRunner`` stages what changed on the host (new requests' prompts, lengths and computed counts:
``RequestState.add_request``; new blocks in every KV-cache group: ``BlockTables.append_block_ids``) and applies it
with one ``_apply_write_kernel`` launch per tensor (``StagedWriteTensor.apply_write``: ``total_len``,
``all_token_ids``, ``num_computed_tokens``) and one for all block-table groups (``FusedStagedWriter.apply``, the
multi-group variant: a hybrid model has several groups). Planned here by building ``RequestState`` and
``BlockTables`` with their own ``__init__`` and calling ``add_request`` / ``append_block_ids`` /
``apply_staged_writes`` as the runner does.

vLLM stages through UVA views of pinned host buffers (its C op maps pinned memory into the device's address space;
``UvaBuffer``): here each host buffer is a real CPU array (what the staging fills) beside a device tensor of its size
and dtype (what the kernel reads: a pointer either way, 16-byte aligned as every allocation). What specializes the
kernel is the written tensor's dtype and row stride (1 for a 1-D tensor, ``max_model_len`` for the token history)
and the multi-group variant; the request and block counts size the grid only.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Iterator

BUFFER_UTILS = "vllm.v1.worker.gpu.buffer_utils"
STATES = "vllm.v1.worker.gpu.states"
BLOCK_TABLE = "vllm.v1.worker.gpu.block_table"
PLANNED = [f"{BUFFER_UTILS}:_apply_write_kernel"]
NOT_PLANNED = [
    {"what": f"{BUFFER_UTILS}:_apply_write_kernel on trace replay's tables, multimodal rope positions",
     "why": "trace replay is the runner's enable_trace_replay (off by default); Kimi-Linear takes no multimodal input "
            "(the sampler's option tables: component sampler_options)"},
    {"what": f"{BUFFER_UTILS}:_apply_write_kernel on one KV-cache group's block table (MULTI_GROUP off)",
     "why": "a model with one KV-cache group: Kimi-Linear's hybrid cache has an MLA group and KDA groups"},
]


@contextlib.contextmanager
def pageable_h2d(*modules) -> Iterator[None]:
    """Within the block each of ``modules``' ``async_tensor_h2d`` (vLLM's host-to-device copy, staged through pinned
    memory: a driver's) copies from pageable memory, into ``out`` where given: the copy's source is no part of a
    launch's key."""
    import torch

    def h2d(data, device=None, dtype=None, out=None):
        t = torch.as_tensor(data, dtype=dtype or (out.dtype if out is not None else None))
        return out.copy_(t) if out is not None else t.to(device)

    saved = [(module, module.async_tensor_h2d) for module in modules]
    for module, _ in saved:
        module.async_tensor_h2d = h2d
    try:
        yield
    finally:
        for module, original in saved:
            module.async_tensor_h2d = original


@contextlib.contextmanager
def host_buffers(device: str) -> Iterator[None]:
    """Within the block vLLM's ``UvaBuffer`` is a real CPU array beside a ``device`` tensor of its size and dtype,
    and a ``UvaBackedTensor``'s host copy (its numpy source of truth) is real under fake tensors: the runner's
    buffers build and stage as on a node, the kernels read device tensors."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    bu = importlib.import_module(BUFFER_UTILS)
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    class HostBuffer:
        """``UvaBuffer``'s interface: ``cpu``, ``np``, ``uva(n)``."""

        def __init__(self, size, dtype):
            with unset_fake_temporarily():  # filled before it is read (the pools copy into it): left unpaged
                self.cpu = torch.empty(size, dtype=dtype)
                self.np = self.cpu.numpy()
            with fake if fake is not None else contextlib.nullcontext():
                self.device = torch.zeros(size, dtype=dtype, device=device)

        def uva(self, n: int | None = None):
            return self.device if n is None else self.device[:n]

    backed_init = bu.UvaBackedTensor.__init__

    def host_backed_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            backed_init(self, *args, **kwargs)

    saved = (bu.UvaBuffer, bu.is_uva_available)
    bu.UvaBuffer, bu.is_uva_available = HostBuffer, lambda: True
    bu.UvaBackedTensor.__init__ = host_backed_init
    try:
        yield
    finally:
        bu.UvaBuffer, bu.is_uva_available = saved
        bu.UvaBackedTensor.__init__ = backed_init


def calls(r, groups: int, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): one step's staged writes of the request state and of ``groups`` KV-cache groups' block tables
    (``r``: :class:`prewarm.providers.vllm.runner.RunnerSpec`)."""
    import torch

    states = importlib.import_module(STATES)
    block_table = importlib.import_module(BLOCK_TABLE)

    def call():
        with host_buffers(device):
            rs = states.RequestState(max_num_reqs=r.max_num_reqs, max_model_len=r.max_model_len,
                                     max_num_batched_tokens=r.max_num_tokens, num_speculative_steps=r.num_spec,
                                     vocab_size=r.vocab_size, device=torch.device(device))
            # the widths size the tables only: the fused writer reads each group's row stride from a table
            tables = block_table.BlockTables(block_sizes=[1] * groups, max_num_reqs=r.max_num_reqs,
                                             max_num_batched_tokens=r.max_num_tokens,
                                             max_num_blocks_per_group=[2] * groups, device=torch.device(device))
            rs.add_request("prewarm", 2, [0, 0], 0, 1)
            tables.append_block_ids(0, tuple([0] for _ in range(groups)), overwrite=True)
            rs.apply_staged_writes()
            tables.apply_staged_writes()

    yield f"staged[groups={groups},max_model_len={r.max_model_len}]", call
