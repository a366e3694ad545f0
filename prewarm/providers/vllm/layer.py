"""vLLM's Kimi-Linear KDA layer driven whole: ``KimiGatedDeltaNetAttention.forward`` (the wheel's file) on fake
tensors, every Triton launch of the layer captured.

The layer runs as vLLM's model runner runs it: built from the model config (``KimiLinearConfig``) and a
``VllmConfig`` (model dtype, mamba cache dtypes, max_num_seqs, num_speculative_tokens, the compilation config's
``custom_ops``: whether ``o_norm``, a ``CustomOp``, takes its Triton ``forward_cuda``), its state bound as the runner
binds a mamba layer's (``layer.kv_cache = (conv_state, recurrent_state)``: views over one page per slot, the conv
state ``[slots, state_len, conv_dim]`` (vLLM's SD layout) first, the recurrent state ``[slots, h, V, K]`` after it,
each slot one page apart), and ``GDNAttentionMetadata`` filled as ``GDNAttentionMetadataBuilder.build``
(``vllm/v1/attention/backends/gdn_attn.py``) fills it for each batch make-up:

- ``prefill``: prefills with and without prefix state (``has_initial_state``), one or several sequences, a chunk of
  a longer prompt; decodes beside prefills (the layer then runs every non-spec token through the chunked prefill);
- ``decode``: pure decode at each batch size class, its state indices either the block table's first column (eager:
  row stride = the block table's width) or the FULL-CUDA-graph staging buffer (contiguous, padded rows pointing at
  the null block);
- ``spec_verify``: spec-only batches (uniform and ragged draft lengths), spec beside decodes (reclassified as
  prefills), spec beside prefills, for each ``num_speculative_tokens``.

Geometry (``[spec.vllm]``, derived by ``prewarm manifest --server vllm``; defaults as vLLM 0.34.0 computes them):
``mamba_page_bytes`` (the page per slot: both states, padded to the attention page on a hybrid model; the recurrent
slot stride = page / 4 for an fp32 state is a constexpr of the KDA kernels), the block table's width
(1 + num_speculative_tokens, ``mamba_cache_mode`` none or align), ``conv_kernel_size`` (Kimi-Linear's 4),
``conv_state_dtype``, ``custom_ops``; :func:`derived` says what each fixes and how to read it off a server.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from ..capture import batch_sizes, index_tensor

LAYER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
PREFIX = "model.layers.0.self_attn"  # the layer's name in the forward context (any name with one layer index)
OPS = "vllm.model_executor.layers.mamba.ops"
BY_THE_LAYER = "as the layer passes it (its forward runs)"
# The layer's forward and every entry point of another module it calls, with how the plan covers each parameter
# (module, qualified name) -> {parameter: how}. tests/test_vllm_layer.py reads the installed vLLM's signatures and
# fails on a parameter this table does not account for; the KDA core's entry points: kda.API.
LAYER_API = {
    (LAYER, "KimiGatedDeltaNetAttention.forward"): {
        "self": "built from the config as the model builds it (heads, head_dim, conv kernel, num_speculative_tokens, "
                "custom_ops), its state bound as the runner binds it (spec.vllm.mamba_page_bytes)",
        "hidden_states": "[tokens, hidden] in the model dtype, tokens of each batch make-up (batches())",
        "positions": "unused by the KDA layer"},
    (f"{OPS}.causal_conv1d", "causal_conv1d_fn"): {
        "x": BY_THE_LAYER + ": a transposed q/k/v slice of the fused projection (or of its index_select copy)",
        "weight": BY_THE_LAYER, "bias": "None (the layer's conv has no bias)",
        "conv_states": "the q/k/v split of the conv state pool, SD layout transposed, slot stride = page / size",
        "query_start_loc": "the non-spec query_start_loc (int32)", "cache_indices": "the block table's first column "
        "or a mixed batch's copy (int32)", "has_initial_state": "bool, with and without prefix state",
        "activation": "silu", "pad_slot_id": "the default", "null_block_id": "the default",
        "metadata": "compute_causal_conv1d_metadata's program tables", "validate_data": "the default"},
    (f"{OPS}.causal_conv1d", "causal_conv1d_update"): {
        "x": BY_THE_LAYER + ": the decode rows of the fused projection, or the spec rows' copy",
        "conv_state": "the whole conv state pool (transposed view)", "weight": BY_THE_LAYER,
        "bias": "None (the layer's conv has no bias)", "activation": "silu",
        "conv_state_indices": "decode: the block table's first column (eager) or the staging buffer (FULL graph); "
                              "spec: its first column", "num_accepted_tokens": "spec: int32; decode: None",
        "query_start_loc": "spec: int32; decode: None", "max_query_len": "spec: 1 + num_speculative_tokens",
        "null_block_id": "the default", "validate_data": BY_THE_LAYER, "out": "a fresh contiguous tensor"},
    (f"{OPS}.gather_initial_states", "gather_initial_states"): {
        "state": "the recurrent state pool (slot stride = page / 4)", "indices": "as causal_conv1d_fn's",
        "has_initial_state": "as causal_conv1d_fn's"},
    (f"{OPS}.scatter_states", "scatter_states"): {
        "state": "the recurrent state pool", "src": "the prefill's final states", "indices": "as the gather's"},
    ("vllm.third_party.flash_linear_attention.ops.kda", "FusedRMSNormGated.forward_cuda"): {
        "self": "the layer's o_norm (head_dim, sigmoid; forward_cuda where spec.vllm.custom_ops enables it)",
        "x": "the core output [1, tokens, h, K]", "g": "g2: g_b_proj's output viewed [tokens, h, K]",
        "residual": "never passed", "prenorm": "never passed", "residual_in_fp32": "never passed"},
}
CONV_KERNEL_SIZE = 4  # Kimi-Linear's short_conv_kernel_size
DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class LayerGeometry:
    """One deployment's layer as the runner builds it (one attention rank)."""

    heads: int  # per rank
    head_dim: int
    conv_kernel_size: int
    num_spec: int  # num_speculative_tokens (0: no speculative decoding)
    model_dtype: str
    conv_state_dtype: str
    page_bytes: int
    custom_ops: tuple
    lower_bound: float | None

    @property
    def conv_dim(self) -> int:
        return 3 * self.heads * self.head_dim

    @property
    def state_len(self) -> int:
        return self.conv_kernel_size - 1 + self.num_spec

    @property
    def block_table_width(self) -> int:
        """vLLM's mamba block table row (``MambaSpec.max_num_blocks_per_req``, cache mode none)."""
        return 1 + self.num_spec


def page_bytes(heads: int, head_dim: int, conv_kernel_size: int, num_spec: int, conv_dtype: str,
               state_dtype: str = "float32") -> int:
    """The unpadded mamba page of one slot (``MambaSpec.page_size_bytes`` with no padding, alignment 1): the conv
    state ``(K - 1 + num_spec) x 3hK`` plus the recurrent state ``h x K x K``."""
    conv = (conv_kernel_size - 1 + num_spec) * 3 * heads * head_dim * DTYPE_SIZE[conv_dtype]
    return conv + heads * head_dim * head_dim * DTYPE_SIZE[state_dtype]


def build_layer(g: LayerGeometry, device: str):
    """The wheel's ``KimiGatedDeltaNetAttention`` for ``g`` as one attention rank builds it: (layer, vllm_config).
    Parameters are made on ``device``."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from vllm.config import set_current_vllm_config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    module = _import(LAYER)
    dtype = getattr(torch, g.model_dtype)
    # one rank's layer: the rank's heads in a tensor-parallel group of one (the layer divides the model's heads by
    # the group's width; nothing else of it depends on the width)
    config = KimiLinearConfig(hidden_size=g.heads * g.head_dim, num_attention_heads=g.heads, rms_norm_eps=1e-5,
                              architectures=["KimiLinearForCausalLM"],
                              linear_attn_config={"head_dim": g.head_dim, "num_heads": g.heads,
                                                  "short_conv_kernel_size": g.conv_kernel_size, "kda_layers": [1],
                                                  "full_attn_layers": [2],
                                                  **({"gate_lower_bound": g.lower_bound} if g.lower_bound else {})})
    config_ = vllm_config(config, g.model_dtype, g.num_spec, g.conv_state_dtype, g.custom_ops)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # built on the meta device, outside a planner's fake tensors: vLLM's weight parameters are Parameter
        # subclasses carrying their loaders, which a fake tensor cannot be; then given storage on ``device``
        with set_current_vllm_config(config_), unset_fake_temporarily():
            one_rank()
            with torch.device("meta"):
                layer = module.KimiGatedDeltaNetAttention(config, config_, prefix=PREFIX)
        layer.to_empty(device=device)
    finally:
        torch.set_default_dtype(before)
    return layer, config_


def vllm_config(config, dtype: str, num_spec: int, conv_state_dtype: str | None, custom_ops, max_num_seqs: int = 256):
    """The ``VllmConfig`` a vLLM server builds for a deployment of the model ``config`` (a transformers config), with
    vLLM's own classes: its ``ModelConfig`` read from the model's ``config.json`` (``config`` written to a temporary
    directory, where a server reads its checkpoint's) in ``dtype``, the mamba conv state dtype (None: vLLM's auto),
    ``num_spec`` speculative tokens (an n-gram proposer: a speculative config that needs no draft checkpoint; the
    layer reads only the token count), the compilation config's ``custom_ops`` and ``max_num_seqs``."""
    import atexit
    import shutil
    import tempfile

    from vllm.config import (CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)

    directory = tempfile.mkdtemp(prefix="prewarm-model-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    config.save_pretrained(directory)
    model = ModelConfig(model=directory, dtype=dtype, skip_tokenizer_init=True)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec, prompt_lookup_max=num_spec,
                                    prompt_lookup_min=1, target_model_config=model,
                                    target_parallel_config=parallel) if num_spec else None
    cache = CacheConfig(**({"mamba_cache_dtype": conv_state_dtype} if conv_state_dtype else {}))
    return VllmConfig(model_config=model, cache_config=cache, parallel_config=parallel, speculative_config=speculative,
                      compilation_config=CompilationConfig(custom_ops=list(custom_ops)),
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=model.max_model_len,
                                                       is_encoder_decoder=model.is_encoder_decoder))


def one_rank() -> None:
    """vLLM's distributed state as one rank of tensor-parallel width 1 has it (``init_distributed_environment``,
    ``initialize_model_parallel``: gloo over a file store, no device), once per process; under the current vLLM
    config (the groups read it)."""
    import os
    import tempfile

    from vllm.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="prewarm-dist-"), "store")
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store}", local_rank=0,
                                 backend="gloo")
    initialize_model_parallel(1, backend="gloo")


def bind_state(layer, g: LayerGeometry, slots: int, device: str) -> None:
    """``layer.kv_cache`` as the runner binds it: both states viewed over ``slots`` pages of ``g.page_bytes``."""
    import torch

    (conv_shape, state_shape), (conv_dtype, state_dtype) = layer.get_state_shape(), layer.get_state_dtype()
    conv_size, state_size = conv_dtype.itemsize, state_dtype.itemsize
    conv_bytes = conv_size * conv_shape[0] * conv_shape[1]
    state_bytes = state_size * state_shape[0] * state_shape[1] * state_shape[2]
    if g.page_bytes < conv_bytes + state_bytes or g.page_bytes % state_size or conv_bytes % state_size:
        raise ValueError(f"spec.vllm.mamba_page_bytes: {g.page_bytes} cannot hold a slot's conv state ({conv_bytes} "
                         f"B) and recurrent state ({state_bytes} B) at their element sizes")
    raw = torch.zeros(slots * g.page_bytes, dtype=torch.uint8, device=device)
    conv = raw.view(conv_dtype).as_strided((slots, *conv_shape), (g.page_bytes // conv_size, conv_shape[1], 1))
    state = raw.view(state_dtype).as_strided(
        (slots, *state_shape), (g.page_bytes // state_size, state_shape[1] * state_shape[2], state_shape[2], 1),
        conv_bytes // state_size)
    layer.kv_cache = (conv, state)


@dataclass(frozen=True)
class Batch:
    """One step's batch for the layer, as the scheduler hands it to the builder (requests in the runner's order:
    decodes first, then prefills; spec requests flagged)."""

    query_lens: tuple  # tokens per request this step
    context_lens: tuple  # tokens already computed per request (> 0: a prefix state exists)
    spec: tuple  # per request: is a spec-decode request (draft tokens >= 0)
    staged: bool  # FULL CUDA graph decode: the builder's persistent buffers (a padded batch is one more size)


def metadata(batch: Batch, g: LayerGeometry, device: str, block_rows: int):
    """``GDNAttentionMetadata`` as ``GDNAttentionMetadataBuilder.build`` fills it for ``batch``: the state table is
    ``[requests, 1 + num_spec]`` (cache mode none: rows of the runner's ``[block_rows, width]`` table; align:
    ``mamba_get_block_table_tensor``'s fresh table of the same shape)."""
    import torch
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    i32 = torch.int32
    W = g.block_table_width
    lens = list(batch.query_lens)
    reqs = len(lens)
    table = torch.zeros(block_rows, W, dtype=i32, device=device)[:reqs]
    qsl = list(itertools.accumulate(lens, initial=0))
    query_start_loc = index_tensor(qsl, i32, device)
    spec_mask = list(batch.spec)
    num_spec_decodes = sum(spec_mask) if g.num_spec else 0
    fields = {}
    if not num_spec_decodes:
        num_decodes = sum(1 for q, c in zip(lens, batch.context_lens) if q == 1 and c > 0)
        num_prefills = reqs - num_decodes
        num_decode_tokens = num_decodes
        num_prefill_tokens = sum(lens) - num_decode_tokens
        non_spec_state = table[:, 0]
        non_spec_qsl = query_start_loc
        non_spec_qsl_values = qsl
        spec_state = spec_qsl = accepted = spec_idx = non_spec_idx = None
        num_spec_tokens = 0
        non_spec_ctx = list(batch.context_lens)
    else:
        ns_lens = [q for q, s in zip(lens, spec_mask) if not s]
        sp_lens = [q for q, s in zip(lens, spec_mask) if s]
        num_decodes = sum(1 for q in ns_lens if q == 1)
        num_prefills = len(ns_lens) - num_decodes - sum(1 for q in ns_lens if q == 0)
        num_decode_tokens = num_decodes
        num_prefill_tokens = sum(ns_lens) - num_decode_tokens
        num_spec_tokens = sum(sp_lens)
        if num_decodes and num_spec_decodes:  # the builder reclassifies them as prefills
            num_prefills, num_prefill_tokens, num_decodes, num_decode_tokens = (
                num_prefills + num_decodes, num_prefill_tokens + num_decode_tokens, 0, 0)
        if num_prefills == 0 and num_decodes == 0:
            spec_idx = torch.arange(num_spec_tokens, dtype=i32, device=device)
            non_spec_idx = torch.empty(0, dtype=i32, device=device)
            spec_state = table[:num_spec_decodes, :W]
            non_spec_state = None
            spec_qsl = index_tensor(qsl[:num_spec_decodes + 1], i32, device)
            non_spec_qsl = None
            non_spec_qsl_values = None
        else:
            # argsort of the token mask: int64 positions (index_select operands)
            non_spec_idx = torch.zeros(num_prefill_tokens + num_decode_tokens, dtype=torch.int64, device=device)
            spec_idx = torch.zeros(num_spec_tokens, dtype=torch.int64, device=device)
            spec_state = torch.zeros(num_spec_decodes, W, dtype=i32, device=device)  # table[mask, :W]: a copy
            non_spec_state = torch.zeros(reqs - num_spec_decodes, dtype=i32, device=device)
            spec_qsl = index_tensor(list(itertools.accumulate(sp_lens, initial=0)), i32, device)
            non_spec_qsl_values = list(itertools.accumulate(ns_lens, initial=0))
            non_spec_qsl = index_tensor(non_spec_qsl_values, i32, device)
        accepted = torch.ones(num_spec_decodes, dtype=i32, device=device)
        non_spec_ctx = [c for c, s in zip(batch.context_lens, spec_mask) if not s]
    if num_prefills:
        has_initial = torch.tensor([c > 0 for c in non_spec_ctx] + [False] * (len(non_spec_qsl_values) - 1
                                                                              - len(non_spec_ctx)),
                                   dtype=torch.bool, device=device)
        nums_dict, batch_ptr, offsets = _conv_metadata(non_spec_qsl_values, device)
        fields.update(has_initial_state=has_initial, nums_dict=nums_dict, batch_ptr=batch_ptr,
                      token_chunk_offset_ptr=offsets)
    if batch.staged and num_spec_decodes and not (num_prefills or num_decodes):
        buf = torch.zeros(block_rows, W, dtype=i32, device=device)
        spec_state = buf[:reqs]
        spec_qsl = index_tensor(qsl, i32, device)
        accepted = torch.ones(block_rows, dtype=i32, device=device)[:reqs]
    if batch.staged and not num_spec_decodes and not num_prefills:
        non_spec_state = torch.zeros(block_rows, dtype=i32, device=device)[:reqs]
        non_spec_qsl = torch.zeros(block_rows + 1, dtype=i32, device=device)[:reqs + 1]
    return GDNAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens, num_spec_decodes=num_spec_decodes,
        num_spec_decode_tokens=num_spec_tokens, num_actual_tokens=sum(lens),
        spec_query_start_loc=spec_qsl, non_spec_query_start_loc=non_spec_qsl,
        spec_state_indices_tensor=spec_state, non_spec_state_indices_tensor=non_spec_state,
        spec_sequence_masks=torch.tensor(spec_mask, dtype=torch.bool, device=device) if num_spec_decodes else None,
        spec_token_indx=spec_idx, non_spec_token_indx=non_spec_idx, num_accepted_tokens=accepted, **fields)


def _conv_metadata(qsl: list, device: str):
    """``compute_causal_conv1d_metadata`` (``vllm/v1/attention/backends/utils.py``): per BLOCK_M (8) the programs
    per sequence, which sequence and which chunk each program takes (host tables), and the int32 device tables the
    conv kernel reads (its grid reads the host ones when the layer runs)."""
    import torch

    seqlens = [b - a for a, b in zip(qsl, qsl[1:])]
    nums = [-(-s // 8) for s in seqlens]
    mlist = [i for i, k in enumerate(nums) for _ in range(k)]
    offsetlist = [c for k in nums for c in range(k)]
    size = max(1024, len(mlist)) * 2
    batch_ptr = torch.full((size,), -1, dtype=torch.int32, device=device)
    offsets = torch.full((size,), -1, dtype=torch.int32, device=device)
    return ({8: {"nums": torch.tensor(nums), "tot": sum(nums), "mlist": torch.tensor(mlist, dtype=torch.int64),
                 "mlist_len": len(mlist), "offsetlist": torch.tensor(offsetlist, dtype=torch.int32),
                 "batch_ptr": batch_ptr, "token_chunk_offset_ptr": offsets}}, batch_ptr, offsets)


def forward(layer, vllm_config, batch_meta, tokens: int, hidden: int, dtype, device: str):
    """One ``layer.forward`` under the runner's forward context."""
    import torch
    from vllm.forward_context import set_forward_context

    hidden_states = torch.zeros(tokens, hidden, dtype=dtype, device=device)
    positions = torch.zeros(tokens, dtype=torch.int64, device=device)
    with set_forward_context({PREFIX: batch_meta}, vllm_config, num_tokens=tokens):
        return layer.forward(hidden_states, positions)


def batches(g: LayerGeometry, paths: tuple, max_batch: int, max_tokens: int) -> Iterator[tuple[str, Batch]]:
    """The batch make-ups that stand for every step within the envelope."""
    W = 1 + g.num_spec
    if "prefill" in paths:
        for name, lens in (("T=1", [1]), ("T=17", [17]), ("T=64", [64]), ("N=3", [1, 16, 33]),
                           (f"T={max_tokens}", [max_tokens])):
            if sum(lens) > max_tokens or len(lens) > max_batch:
                continue
            for prefix in (False, True):
                yield (f"prefill[{name},prefix={prefix}]",
                       Batch(tuple(lens), tuple(5 if prefix else 0 for _ in lens), (False,) * len(lens), False))
        for decodes in batch_sizes(min(max_batch - 1, 64)) if max_batch > 1 else []:
            lens = [1] * decodes + [13]
            yield (f"mixed[decodes={decodes}]",
                   Batch(tuple(lens), tuple([9] * decodes + [0]), (False,) * len(lens), False))
    if "decode" in paths:
        for b in batch_sizes(max_batch):
            for staged in (False, True):
                yield f"decode[B={b},staged={staged}]", Batch((1,) * b, (9,) * b, (False,) * b, staged)
    if "spec_verify" in paths and g.num_spec:
        # a spec request verifies 1 + its drafts (a drafter may propose fewer than num_speculative_tokens): all at
        # W, all at 1, a mix; alone (in the FULL-graph staging buffers or not), beside a decode (reclassified as a
        # prefill) and beside prefills of each token-count class. The verify kernel specializes on the request and
        # token counts (1, multiples of 16) and switches its launch config at heads x requests.
        patterns = {"uniform": lambda n: (W,) * n, "ones": lambda n: (1,) * n,
                    "ragged": lambda n: tuple(1 + (i % W) for i in range(n))}
        for n in batch_sizes(max_batch):
            for name, lens in patterns.items():
                q = lens(n)
                for staged in (False, True):
                    yield f"spec[n={n},{name},staged={staged}]", Batch(q, (9,) * n, (True,) * n, staged)
                if n >= max_batch:
                    continue
                yield (f"spec+decode[n={n},{name}]",
                       Batch(q + (1,), (9,) * (n + 1), (True,) * n + (False,), False))
                for prompt in (1, 13, 16):
                    yield (f"spec+prefill[n={n},{name},prompt={prompt}]",
                           Batch(q + (prompt,), (9,) * n + (0,), (True,) * n + (False,), False))
        for others in (3, 16):
            if others < max_batch:
                yield (f"spec+decode[n=1,others={others}]",
                       Batch((W,) + (1,) * others, (9,) * (1 + others), (True,) + (False,) * others, False))


def layer_calls(geometries: list[LayerGeometry], paths: tuple, max_batch: int, max_tokens: int,
                device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) for each geometry and batch: one ``forward`` of the layer each."""
    import torch

    for g in geometries:
        state = {}

        def layer(g=g, state=state):
            if "layer" not in state:
                state["layer"], state["config"] = build_layer(g, device)
                bind_state(state["layer"], g, max_batch + 8, device)
            return state["layer"], state["config"]

        tag = (f"model={g.model_dtype},conv_state={g.conv_state_dtype},num_spec={g.num_spec},page={g.page_bytes},"
               f"custom_ops={'/'.join(g.custom_ops)}")
        for name, batch in batches(g, paths, max_batch, max_tokens):
            def call(batch=batch, layer=layer, g=g):
                lyr, config = layer()
                m = metadata(batch, g, device, max_batch + 8)
                return forward(lyr, config, m, m.num_actual_tokens, lyr.hidden_size, getattr(torch, g.model_dtype),
                               device)

            yield f"layer[{tag}]/{name}", call


def _import(name: str):
    import importlib

    return importlib.import_module(name)


LAYER_KEYS = ("mamba_page_bytes", "conv_kernel_size", "custom_ops", "mamba_cache_mode", "conv_state_dtype")


def geometries(spec: dict) -> tuple[list[LayerGeometry], dict]:
    """The layer geometries ``spec``'s ``[spec.vllm]`` names (every page size x speculative width), and the rest of
    the spec (for the kernel-level reading)."""
    from prewarm_kernels.spec import SpecError, read_kda

    extra = dict(spec.get("vllm") or {})
    layer = {k: extra.pop(k) for k in LAYER_KEYS if k in extra}
    read = read_kda({k: v for k, v in spec.items() if k != "vllm"})
    mode = layer.get("mamba_cache_mode", "align")
    if mode not in ("none", "align"):
        raise SpecError("vllm.mamba_cache_mode", mode, '"none" or "align" (prefix caching off / on): the layer sees '
                        "the same [requests, 1 + num_speculative_tokens] state table in both; \"all\" is not planned")
    width = layer.get("conv_kernel_size", CONV_KERNEL_SIZE)
    if not isinstance(width, int) or not 2 <= width <= 7:
        raise SpecError("vllm.conv_kernel_size", width, "an integer in 2..7 (the causal conv's widths)")
    settings = layer.get("custom_ops", [["all"]])
    if not isinstance(settings, list) or not settings or not all(
            isinstance(c, list) and all(isinstance(x, str) for x in c) for c in settings):
        raise SpecError("vllm.custom_ops", settings, "a non-empty list of vLLM custom_ops settings, each a list of "
                        "its entries (\"all\", \"none\", \"+name\", \"-name\"), e.g. [[\"none\"]]")
    # a setting that runs o_norm's Triton kernel launches everything one that runs its torch ops does, and more
    custom_ops = next((c for c in settings if o_norm_triton(c)), settings[0])
    model_dtype = read["dtypes"]["activation"][0]
    conv_dtype = layer.get("conv_state_dtype", model_dtype)
    if conv_dtype not in DTYPE_SIZE:
        raise SpecError("vllm.conv_state_dtype", conv_dtype, f"one of {sorted(DTYPE_SIZE)}")
    specs = sorted({d - 1 for d in read["draft_widths"] if d > 1}) or [0]
    out = []
    for num_spec in specs:
        pages = layer.get("mamba_page_bytes", [page_bytes(read["heads"], read["head_k_dim"], width, num_spec,
                                                          conv_dtype)])
        if not isinstance(pages, list) or not pages or not all(isinstance(p, int) and p > 0 for p in pages):
            raise SpecError("vllm.mamba_page_bytes", pages, "a non-empty list of positive integers")
        for page in pages:
            if page < page_bytes(read["heads"], read["head_k_dim"], width, num_spec, conv_dtype):
                continue  # a page for another speculative width
            out.append(LayerGeometry(heads=read["heads"],
                                     head_dim=read["head_k_dim"], conv_kernel_size=width, num_spec=num_spec,
                                     model_dtype=model_dtype, conv_state_dtype=conv_dtype, page_bytes=page,
                                     custom_ops=tuple(custom_ops), lower_bound=read["gate_lower_bound"]))
    return out, {**spec, "vllm": extra}


def derived(spec: dict) -> list[dict]:
    """The server geometry the layer is planned with, each value with what it fixes in the kernels and how to read it
    off a live server (``prewarm plan`` prints them: ``options`` rows with ``derived``)."""
    geoms, _ = geometries(spec)
    given = set(spec.get("vllm") or {})
    g0 = geoms[0]
    pages = sorted({g.page_bytes for g in geoms})
    rows = [
        ("vllm.mamba_page_bytes", pages, "mamba_page_bytes",
         "one page per state slot: conv state then fp32 recurrent state; the recurrent slot stride (page / 4 "
         "elements) is a constexpr of the packed decode and the spec verify (stride_state_token), the conv slot "
         "stride (page / 2) an int of the causal conv kernels. Check on the server: "
         "layer.kv_cache[1].stride(0) * 4 (and kv_cache[0].stride(0) * 2) for a KDA layer, or MambaSpec."
         "page_size_bytes in the KV cache config vLLM logs"),
        ("vllm.num_speculative_tokens", sorted({g.num_spec for g in geoms}), None,
         "from spec.serving.draft_widths - 1: the conv state's length (conv_kernel_size - 1 + it) and the spec "
         "verify's index row. Check: --speculative-config num_speculative_tokens"),
        ("vllm.block_table_width", sorted({g.block_table_width for g in geoms}), None,
         "1 + num_speculative_tokens (the state table's row, mamba_cache_mode none or align): the state-index "
         "stride of eager decode and prefill steps (block_table[:, 0]). Check: GDNAttentionMetadata."
         "non_spec_state_indices_tensor.stride(0) on an eager step, spec_state_indices_tensor.size(1)"),
        ("vllm.conv_kernel_size", [g0.conv_kernel_size], "conv_kernel_size",
         "config.json linear_attn_config.short_conv_kernel_size: the causal conv's KERNEL_WIDTH constexpr"),
        ("vllm.conv_state_dtype", [g0.conv_state_dtype], "conv_state_dtype",
         "--mamba-cache-dtype (auto: the model dtype). Check: layer.kv_cache[0].dtype"),
        ("vllm.custom_ops", (spec.get("vllm") or {}).get("custom_ops", [["all"]]), "custom_ops",
         "compilation_config.custom_ops, each setting a server may run with: whether o_norm (FusedRMSNormGated) takes "
         "forward_cuda (the Triton layer_norm_gated_fwd_kernel) or forward_native (torch ops); "
         f"layer_norm_gated_fwd_kernel: {'planned' if o_norm_triton(g0.custom_ops) else 'not launched'}. Check: "
         "the server's compilation_config.enabled_custom_ops holds fused_rms_norm_gated"),
        ("vllm.mamba_cache_mode", [(spec.get("vllm") or {}).get("mamba_cache_mode", "align")], "mamba_cache_mode",
         "align with prefix caching on (vLLM's default for a hybrid model), none with --no-enable-prefix-caching: "
         "the layer sees a [requests, 1 + num_speculative_tokens] state table either way. With align the runner "
         "computes it (get_aligned_state_indices_multi_group_kernel) and pre- / post-copies the states across "
         "blocks: kernels of the model runner, not of the layer, planned by the component mamba where [spec.vllm] "
         "block_size and mamba_groups are given"),
    ]
    return [{"key": f"spec.{key}", "planned": value, "accepted": None, "given": name in given, "narrowed": False,
             "derived": why} for key, value, name, why in rows]


def o_norm_triton(custom_ops) -> bool:
    """Whether vLLM's ``CustomOp.enabled`` turns ``fused_rms_norm_gated`` on for ``custom_ops`` (its own rule)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    norm = _import("vllm.third_party.flash_linear_attention.ops.kda").FusedRMSNormGated
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=list(custom_ops)))):
        return norm.enabled()


# --- the server geometry from a launch line and config.json (prewarm manifest --server vllm) ------------------------

# The KDA models among vLLM 0.34.0's DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES on CUDA (vllm/config/vllm.py): they run
# with breakable CUDA graphs, compilation mode NONE, unless VLLM_USE_BREAKABLE_CUDAGRAPH=0
BREAKABLE_CUDAGRAPH_ARCHITECTURES = frozenset({"KimiLinearForCausalLM", "KimiK3ForConditionalGeneration",
                                               "KimiK31ForConditionalGeneration"})
MLA_KERNEL_BLOCK_ALIGNMENT = 128  # Platform._align_hybrid_block_size: an MLA model's kernel block alignment floor
MLA_BACKEND_BLOCK = 64  # FlashMLA's kernel block size (its get_supported_kernel_block_sizes), the H200's MLA backend


def custom_ops_setting(architectures: list, compilation: dict, enforce_eager: bool, optimization_level: str | None,
                       environ: dict) -> tuple[list[str], str]:
    """The compilation config's ``custom_ops`` as vLLM 0.34.0 completes it (``VllmConfig.__post_init__``): the
    entries given, plus "none" where Inductor compiles (backend inductor, mode not NONE), else "all"; and why."""
    given = list(compilation.get("custom_ops") or [])
    if "all" in given or "none" in given:
        return given, "--compilation-config custom_ops"
    if enforce_eager:
        mode, why = "NONE", "--enforce-eager"
    elif str(compilation.get("mode", "")).upper() in ("0", "NONE"):
        mode, why = "NONE", "--compilation-config mode 0"
    elif environ.get("TORCH_COMPILE_DISABLE") == "1":
        mode, why = "NONE", "TORCH_COMPILE_DISABLE=1"
    elif environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1" or (
            environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") != "0" and set(architectures) & BREAKABLE_CUDAGRAPH_ARCHITECTURES):
        breakable = sorted(set(architectures) & BREAKABLE_CUDAGRAPH_ARCHITECTURES)
        mode, why = "NONE", (f"breakable CUDA graphs ({', '.join(breakable)}: vLLM's default on CUDA)" if breakable
                             else "breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1)")
    elif optimization_level == "0":
        mode, why = "NONE", "-O0"
    else:
        mode, why = "VLLM_COMPILE", "torch.compile (vLLM's default)"
    inductor = compilation.get("backend", "inductor") == "inductor" and mode != "NONE"
    base = "none" if inductor else "all"
    return given + [base], (f"vLLM completes custom_ops with {base!r}: compilation mode {mode} by {why}"
                            + (f", entries given: {given}" if given else ""))


def padded_page(mamba_page: int, attn_bytes_per_token: int, block_size: int | None) -> tuple[int, int]:
    """(the mamba page padded to the attention page, the attention block size in tokens) as
    ``Platform._align_hybrid_block_size`` sets them for an MLA hybrid model on FlashMLA."""
    align = max(MLA_BACKEND_BLOCK, block_size or MLA_BACKEND_BLOCK, MLA_KERNEL_BLOCK_ALIGNMENT)
    tokens = align * -(-mamba_page // (align * attn_bytes_per_token))
    tokens = MLA_BACKEND_BLOCK * -(-tokens // MLA_BACKEND_BLOCK)
    tokens = max(tokens, block_size or 0)
    return tokens * attn_bytes_per_token, tokens
