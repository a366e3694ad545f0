"""vLLM 0.34.0's mamba bookkeeping for Kimi-Linear's KDA states in the V2 model runner
(``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``, ``vllm/v1/worker/mamba_utils.py``): the component ``mamba``
of ``prewarm.providers.vllm.kda``.

``MambaHybridModelState`` runs, each step:

- ``postprocess_state``: ``_scatter_num_accepted_kernel`` (the sampled counts into the per-request accepted counts
  the KDA layer reads next step), in every cache mode;
- with prefix caching (``mamba_cache_mode`` align, vLLM's default for a hybrid model), ``preprocess_state``
  (``preprocess_mamba_align_fused_kernel``, then ``MambaSpecDecodeGPUContext.run_fused_precopy``:
  ``precopy_mamba_align_fused_kernel``), ``prepare_attn`` (``compute_aligned_state_indices``:
  ``get_aligned_state_indices_multi_group_kernel``, whose indices Kimi-Linear's KDA metadata builder takes) and
  ``postprocess_state``'s ``run_fused_postprocess_align`` (``postprocess_mamba_fused_kernel``).

Planned here with vLLM's own code: the KDA groups' ``MambaSpec`` (shapes and dtypes from vLLM's
``MambaStateShapeCalculator.kda_state_shape`` / ``MambaStateDtypeCalculator.kda_state_dtype``, the attention block,
the padded page, the speculative blocks), a ``KVCacheConfig`` of the deployment's KV-cache groups (``[spec.vllm]
mamba_groups``: vLLM's hybrid allocator splits the KDA layers into groups of the smallest layer type's count), the
context made by ``MambaSpecDecodeGPUContext.create`` and ``initialize_from_forward_context`` over one KDA layer's
bound states per group (conv state then recurrent state, one page per block) and each group's block table (its
width ``MambaSpec.max_num_blocks_per_req``: ``cdiv(max_model_len, block) + num_speculative_blocks``); the kernels
launched as ``preprocess_state`` / ``prepare_attn`` / ``postprocess_state`` launch them, on the runner's buffers
(``idx_mapping`` int64, counts and columns int32).

What specializes them: the attention block (``MAMBA_BLOCK_SIZE`` / ``CACHE_BLOCK_SIZE`` / ``block_size``), the group
count (``NUM_GROUPS``, ``BLOCK_GROUPS``), the state slots (``1 + num_speculative_tokens``), the block table's row
stride (an int); the request count is not specialized (``do_not_specialize``) and sizes the grid only.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

from prewarm_kernels.spec import SpecError

from ..capture import batch_sizes

MAMBA_HYBRID = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
KEYS = ("block_size", "mamba_groups")  # [spec.vllm]: the attention block (tokens), the KDA layers' KV-cache groups
PLANNED = [f"{MAMBA_HYBRID}:_scatter_num_accepted_kernel"]
ALIGN_PLANNED = [f"{MAMBA_UTILS}:{k}" for k in ("preprocess_mamba_align_fused_kernel",
                                                 "precopy_mamba_align_fused_kernel",
                                                 "get_aligned_state_indices_multi_group_kernel",
                                                 "postprocess_mamba_fused_kernel")]
NOT_PLANNED = [
    {"what": f"{MAMBA_HYBRID}:_fill_num_accepted_kernel",
     "why": "postprocess_state with an int count: pipeline parallelism only (a non-final prefill chunk's rank)"},
    {"what": f"{MAMBA_UTILS}: the align kernels with CONV_STATE_DIM_FIRST (VLLM_SSM_CONV_STATE_LAYOUT=DS)",
     "why": "the conv state's dim-first layout is an environment setting; the default (SD) is planned"},
    {"what": "vllm.v1.worker.replayssm_utils (ReplaySSM ring trackers), vllm.v1.worker.gpu.model_states.recoverssm",
     "why": "FlashInfer ReplaySSM (Mamba2 layers) or --use-kda-recoverssm: not Kimi-Linear's default path"},
    {"what": "vllm.v1.attention.backends.utils:_mamba_align_block_table_kernel",
     "why": "GDN's and the other mamba builders' align gather; Kimi-Linear's KDA builder takes the runner's "
            "precomputed indices (get_aligned_state_indices_multi_group_kernel, planned) instead"},
]


@dataclass(frozen=True)
class MambaSpec:
    """The KDA groups' geometry on one rank."""

    block_size: int  # the attention block (mamba_block_size under align)
    groups: int  # KV-cache groups of KDA layers
    align: bool  # mamba_cache_mode align (prefix caching)


def read_spec(table: dict) -> MambaSpec | None:
    """``[spec.vllm]`` ``block_size`` (the attention block vLLM sets for the hybrid page, in tokens) and
    ``mamba_groups`` (the KV-cache groups of KDA layers); None where neither is given (not planned)."""
    if not any(k in table for k in KEYS):
        return None
    for key in KEYS:
        value = table.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"vllm.{key}", value if key in table else ..., "a positive integer: block_size (vLLM "
                            "logs 'Setting attention block size to N tokens') and mamba_groups (the KV-cache "
                            "groups of KDA layers) are given together")
    return MambaSpec(block_size=table["block_size"], groups=table["mamba_groups"],
                     align=table.get("mamba_cache_mode", "align") == "align")


def planned(m: MambaSpec) -> list[str]:
    return PLANNED + (ALIGN_PLANNED if m.align else [])


def calls(m: MambaSpec, r, g, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): one step's mamba bookkeeping per request count (``r``: the runner's spec, ``g``: the KDA
    layer's :class:`prewarm.providers.vllm.layer.LayerGeometry`)."""
    import torch

    made = {}

    def context():
        if "ctx" not in made:
            made["ctx"] = _context(m, r, g, device)
        return made["ctx"]

    mh = importlib.import_module(MAMBA_HYBRID)
    mu = importlib.import_module(MAMBA_UTILS)
    for reqs in batch_sizes(r.max_num_reqs):
        def call(reqs=reqs):
            i32 = torch.int32
            idx_mapping = torch.zeros(reqs, dtype=torch.int64, device=device)  # async_tensor_h2d(..., int64)
            num_sampled = torch.ones(reqs, dtype=i32, device=device)  # seq_lens.new_ones / the rejection sampler's
            if not m.align:
                accepted = torch.ones(r.max_num_reqs, dtype=i32, device=device)
                mh._scatter_num_accepted_kernel[(reqs,)](idx_mapping, num_sampled, accepted)
                return
            ctx, b, block = context()
            # preprocess_state
            mu.preprocess_mamba_align_fused_kernel[(-(-reqs // 256),)](
                idx_mapping, b["state_idx"], b["num_computed_tokens"], b["query_start_loc"][:reqs + 1],
                b["num_accepted"], b["src_col"], b["src_off"], reqs, BLOCK_SIZE=256, MAMBA_BLOCK_SIZE=block)
            ctx.run_fused_precopy(reqs, b["state_idx"], b["src_col"], b["src_off"], idx_mapping)
            # prepare_attn
            ctx.compute_aligned_state_indices(b["seq_lens"], reqs)
            # postprocess_state
            mh._scatter_num_accepted_kernel[(reqs,)](idx_mapping, num_sampled, b["num_accepted"])
            ctx.run_fused_postprocess_align(reqs, b["num_accepted"], b["state_idx"], b["num_computed_tokens"],
                                            idx_mapping)

        yield f"mamba[groups={m.groups},block={m.block_size},align={m.align},reqs={reqs}]", call


def _context(m: MambaSpec, r, g, device: str):
    """(``MambaSpecDecodeGPUContext`` initialized as ``MambaHybridModelState.initialize_kv_cache`` does, the hybrid
    state's buffers, the mamba block size)."""
    import types

    import torch

    ki = importlib.import_module("vllm.v1.kv_cache_interface")
    mu = importlib.import_module(MAMBA_UTILS)
    calc = importlib.import_module("vllm.model_executor.layers.mamba.mamba_utils")
    registry = importlib.import_module("vllm.v1.attention.backends.registry")
    shapes = calc.MambaStateShapeCalculator.kda_state_shape(1, g.heads, g.head_dim,
                                                            conv_kernel_size=g.conv_kernel_size, num_spec=g.num_spec)
    dtypes = calc.MambaStateDtypeCalculator.kda_state_dtype(getattr(torch, g.model_dtype), g.conv_state_dtype)
    spec = ki.MambaSpec(shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=m.block_size,
                        page_size_padded=g.page_bytes, mamba_type=registry.MambaAttentionBackendEnum.GDN_ATTN,
                        mamba_cache_mode="align", num_speculative_blocks=g.num_spec)
    groups = [ki.KVCacheGroupSpec([f"kda.{i}"], spec) for i in range(m.groups)]
    kv = ki.KVCacheConfig(num_blocks=r.max_num_reqs + 1, kv_cache_tensors=[], kv_cache_groups=groups)
    slots = 2  # the tables' entries are block 0: two pages per layer (a device build allocates them)
    forward_context = {}
    for group in groups:  # each layer's states over its pages, as the runner binds them
        (conv_shape, state_shape), (conv_dtype, state_dtype) = spec.shapes, spec.dtypes
        raw = torch.zeros(slots * g.page_bytes, dtype=torch.uint8, device=device)
        conv = raw.view(conv_dtype).as_strided((slots, *conv_shape),
                                               (g.page_bytes // conv_dtype.itemsize, conv_shape[1], 1))
        conv_bytes = conv_dtype.itemsize * conv_shape[0] * conv_shape[1]
        state = raw.view(state_dtype).as_strided(
            (slots, *state_shape), (g.page_bytes // state_dtype.itemsize, state_shape[1] * state_shape[2],
                                    state_shape[2], 1), conv_bytes // state_dtype.itemsize)
        forward_context[group.layer_names[0]] = types.SimpleNamespace(kv_cache=[conv, state])
    copy_funcs = {spec.mamba_type: calc.MambaStateCopyFuncCalculator.kda_state_copy_func()}
    ctx = mu.MambaSpecDecodeGPUContext.create(max_num_reqs=r.max_num_reqs, kv_cache_config=kv, copy_funcs=copy_funcs,
                                              forward_context=forward_context, device=torch.device(device))
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode="align"))
    width = ki.get_block_table_width(spec.max_num_blocks_per_req(config, r.max_model_len), spec.block_size,
                                     token_alignment=spec.block_table_token_alignment)
    # the runner's per-request-slot tables and its batch-ordered input tables (BlockTables), one per group
    tables = [torch.zeros(r.max_num_reqs, width, dtype=torch.int32, device=device) for _ in groups]
    inputs = [torch.zeros(r.max_num_reqs, width, dtype=torch.int32, device=device) for _ in groups]
    ctx.initialize_from_forward_context(kv, forward_context, copy_funcs, tables, inputs)
    i32 = torch.int32
    z = lambda: torch.zeros(r.max_num_reqs, dtype=i32, device=device)  # noqa: E731
    buffers = dict(num_accepted=z(), state_idx=z(), src_col=z(), src_off=z(), num_computed_tokens=z(), seq_lens=z(),
                   query_start_loc=torch.zeros(r.max_num_reqs + 1, dtype=i32, device=device))
    return ctx, buffers, spec.block_size
