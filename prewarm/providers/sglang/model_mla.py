"""Kimi-Linear's full-attention (MLA) layers as sglang 0.5.23 runs them on Hopper: the model component ``mla`` of
``prewarm.providers.sglang.cuda``.

Which backend: Kimi-Linear's ``ModelConfig`` is ``AttentionArch.MLA`` (``kv_lora_rank`` / ``qk_rope_head_dim``), and
with no ``--attention-backend`` sglang's ``get_default_attn_backend`` picks ``fa3`` for an MLA model on Hopper with
CUDA >= 12.3 (``arg_groups/model_override_base.py``; nothing Kimi-specific overrides it: ``kimi_k3_hook`` only pins
the KDA verify and DSPARK draft backends). ``FlashAttentionBackend`` runs the layer (``use_mla``); the attention
itself is FlashAttention-3 (sgl-kernel, ahead-of-time CUDA: nothing to compile). The layer is sglang's
``DeepseekV2AttentionMLA`` (``kimi_linear.py`` imports it as ``KimiMLAAttention``) with ``q_lora_rank`` None and
``skip_rope`` (``mla_use_nope``): no rotary kernel runs. --page-size is sglang's default on CUDA (1), KDA models keep
the prefill CUDA graph off (``cuda_graph_hook``: breakable graphs exclude KDA hybrids), and no KV translator
translates (a static MLA pool), so every call below takes those branches.

What the layer's path launches past FA3, per forward mode, each through sglang's own function with the tensors the
runner, the backend and the pools hand it (:func:`calls`):

- CUDA graph metadata (``_apply_cuda_graph_metadata``, the same call at capture and at every replay of a
  ``--cuda-graph-bs`` bucket: the runner pads a batch to its bucket, the buffers are the backend's
  ``init_cuda_graph_state`` ones sliced to the bucket): decode and chain target verify (EAGLE top-k 1) fill the
  page table and lengths with ``normal_decode_set_metadata`` (Triton ``_fused_decode_metadata_kernel``, its
  ``SEQ_LEN_DELTA`` constexpr 0 for decode and the draft width for verify); tree target verify (top-k > 1) builds
  its prefix page table at replay with ``build_trtllm_mha_page_table`` (``req_to_token``'s row stride, which holds
  ``context_len + 4 + draft width`` columns, is a constexpr there). Eager metadata is torch ops.
- The EAGLE draft runners' FA3 graph metadata (the draft model's attention backends, built by ``draft_utils`` for
  the same ``fa3``; its context length is the target's, it shares the target's ``req_to_token``, and its graph
  runners capture the same ``--cuda-graph-bs`` buckets, ``get_batch_sizes_to_capture``): a chain's draft graph
  (``EAGLEDraftCudaGraphRunner``, at capture and every replay) runs ``FlashAttentionMultiStepBackend``'s
  ``num_steps - 1`` backends, step ``i``'s ``_apply_cuda_graph_metadata`` filling the decode buffers with
  ``normal_decode_set_metadata`` at ``SEQ_LEN_DELTA`` = ``_spec_read_seq_len_delta`` = ``i + 1`` (a chain's
  ``num_steps`` is the width - 1: width 3 reaches delta 1, width 4 deltas 1 and 2; a tree's draft decode is
  torch); the draft-extend graph (``EAGLEDraftExtendCudaGraphRunner``, chain and tree) records FA3's
  ``init_forward_metadata_in_graph`` for ``DRAFT_EXTEND_V2``: ``draft_extend_set_metadata`` (Triton
  ``_draft_extend_metadata_kernel``) on its ``draft_extend_metadata`` buffers and the runner's int32
  ``extend_seq_lens``.
- The KV store (``MLATokenToKVPool._scatter_mla_rows`` -> ``set_mla_kv_buffer_dcp_sharded_triton``, every mode): on a
  GPU with PDL and 16-byte row widths (bf16: 1024 + 128 bytes) sglang's JIT module ``set_mla_kv_buffer`` (planned
  as a JIT request: sglang's own dispatch reaches its ``load_jit``), else the Triton ``set_mla_kv_buffer_kernel``.
- Prefill (``EXTEND``; ``handle_attention_fa3``): with no prefix, or a prefix of at least
  ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD`` tokens, the MHA path: ``_concat_and_cast_mha_k`` (Kimi-Linear's 32
  heads per rank are not DeepSeek's 128, so not ``concat_mla_k``: the power-of-two heads take
  ``concat_and_cast_mha_k_triton``; ``k_pe`` is the latent row's slice, or the cache's copy where the prefix is
  read back); with a prefix and at most ``SGLANG_MAX_KV_CHUNK_CAPACITY`` tokens in all, one shot: the prefix's KV
  indices (``create_flashinfer_kv_indices_triton`` through the translator's passthrough) and read
  (``get_mla_kv_buffer_triton``); past it, chunked: each chunk's indices (``create_chunked_prefix_cache_kv_indices``,
  whose row pointers into the ``[chunks, batch]`` tables sit at any 4-byte offset) and read. A shorter prefix takes
  the absorbed MLA path (the KV store alone). The merge of chunk states is sgl-kernel's ``merge_state_v2`` (bf16,
  head 128: CUDA).

What is not planned here, with why: :func:`coverage`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

COMPONENT = "mla"
KERNELS = ("sglang.kernels.ops.attention.metadata:_fused_decode_metadata_kernel",
           "sglang.kernels.ops.attention.metadata:_draft_extend_metadata_kernel",
           "sglang.kernels.ops.attention.trtllm_mha_page_table:create_trtllm_mha_kv_indices_triton",
           "sglang.kernels.ops.attention.mla_qk_prep:concat_and_cast_mha_k_kernel",
           "sglang.kernels.ops.attention.kv_indices:create_flashinfer_kv_indices_triton",
           "sglang.kernels.ops.attention.kv_indices:create_chunked_prefix_cache_kv_indices",
           "sglang.kernels.ops.kvcache.mla_buffer:get_mla_kv_buffer_kernel")
PAGE_SIZE = 1  # --page-size: sglang's default on CUDA (overrides._page_size_default)
ROW_OFFSETS = 4  # a chunk row's pointer offset in the [chunks, batch] int32 tables: idx x batch mod 4 (16 bytes)
NOT_PLANNED = [
    {"what": "FlashAttention-3 (sgl-kernel flash_attn_varlen_func / flash_attn_with_kvcache), its scheduler metadata, "
             "merge_state_v2",
     "why": "ahead-of-time CUDA (sgl-kernel): nothing to compile"},
    {"what": "sglang.kernels.ops.kvcache.mla_buffer:set_mla_kv_buffer_kernel (the Triton KV store)",
     "why": "on a PDL-capable GPU sglang's dispatch writes bf16 MLA rows with its JIT module set_mla_kv_buffer "
            "(planned as a JIT request); the Triton kernel serves older GPUs and 16-byte-misaligned rows"},
    {"what": "kv_a_layernorm, the q / kv_a / kv_b / o projections and the absorbed bmm",
     "why": "the norm is the 'norm' component's (an RMSNorm like the layers' others); the rest are bf16 GEMMs "
            "through torch (cuBLAS): nothing to compile"},
    {"what": "a tree's draft-decode metadata (FA3 topk > 1: draft_decode_set_expand_metadata)",
     "why": "torch.compile'd (Inductor generates its own kernels) and torch copies: no sglang Triton kernel"},
    {"what": "--page-size > 1, DCP (--dcp-size > 1), an fp8 KV cache, prefill CUDA graphs",
     "why": "not in the manifest's launch lines (page size 1, no DCP, bf16 KV; sglang keeps the prefill graph off "
            "for KDA hybrids): their metadata and KV-store variants are not planned"},
]


@dataclass(frozen=True)
class MlaSpec:
    """Kimi-Linear's MLA widths per rank (``[spec.sglang.model]``, from config.json) and the pool widths."""

    heads: int  # num_attention_heads / tensor_parallel
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    context_len: int  # sglang's model_config.context_len: the page tables' and req_to_token's widths

    @property
    def row(self) -> int:
        """One token's latent KV row (the MLA pool's ``kv_cache_dim``)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def read(spec: dict, s) -> MlaSpec | None:
    """The MLA widths of ``[spec.sglang.model]`` (None where it states no ``kv_lora_rank``: the model has no MLA
    layers, or they are not planned), ``s`` the provider's :class:`~.common.SglangSpec`. A bad value is a SpecError
    naming ``spec.sglang.model.<key>``."""
    from prewarm_kernels.spec import SpecError

    from .model_scheduler import context_length

    model = (spec.get("sglang") or {}).get("model")
    if not isinstance(model, dict) or "kv_lora_rank" not in model:
        return None
    keys = {"num_attention_heads": "config.json num_attention_heads", "kv_lora_rank": "config.json kv_lora_rank",
            "qk_nope_head_dim": "config.json qk_nope_head_dim", "qk_rope_head_dim": "config.json qk_rope_head_dim",
            "v_head_dim": "config.json v_head_dim"}
    values = {}
    for key, where in keys.items():
        v = model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpecError(f"sglang.model.{key}", v if key in model else ..., f"a positive integer: {where}")
        values[key] = v
    context = context_length(spec)
    if context is None:
        raise SpecError("sglang.model.context_length", ..., "a positive integer: sglang's context length (config.json "
                        "model_max_length for Kimi-Linear, or --context-length); the MLA graph page tables are this "
                        "wide")
    tp = s.parallel[0]
    if values["num_attention_heads"] % tp:
        raise SpecError("sglang.model.num_attention_heads", values["num_attention_heads"],
                        f"divisible by the tensor-parallel size ({tp}): each rank holds a slice of the heads")
    return MlaSpec(heads=values["num_attention_heads"] // tp, kv_lora_rank=values["kv_lora_rank"],
                   qk_nope_head_dim=values["qk_nope_head_dim"], qk_rope_head_dim=values["qk_rope_head_dim"],
                   v_head_dim=values["v_head_dim"], context_len=context)


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of every MLA-layer call past FA3 within the deployment's envelope (none without
    ``[spec.sglang.model] kv_lora_rank``): the graph metadata at every bucket (decode; chain and tree verify at every
    draft width; the EAGLE draft graph's per-step and the draft-extend graph's), the KV store of each forward mode,
    the prefill's concat, prefix indices and prefix read."""
    m = read(spec, s)
    if m is None:
        return
    layer = _Layer(m, s, device)
    deployments = s.draft_widths or (0,)  # one launch line per draft width: req_to_token is 4 + width wider
    decoding = any(p in s.paths for p in ("packed_decode", "decode"))
    for bs in s.graph_buckets:
        if decoding:
            for w in deployments:
                yield f"{COMPONENT}/graph_decode_metadata[bs={bs},w={w}]", lambda bs=bs, w=w: layer.graph_metadata(
                    bs, 0, w)
        if "target_verify" in s.paths:
            for w in s.draft_widths:
                yield f"{COMPONENT}/graph_verify_metadata[bs={bs},w={w}]", lambda bs=bs, w=w: layer.graph_metadata(
                    bs, w, w)
                if s.eagle_tree:
                    yield (f"{COMPONENT}/graph_tree_verify_page_table[bs={bs},w={w}]",
                           lambda bs=bs, w=w: layer.tree_verify_page_table(bs, w))
        for w in s.draft_widths:  # the EAGLE draft runners' graphs (the worker runs with any draft width)
            for step in range(w - 2):  # a chain's num_steps - 1 step backends (num_steps = w - 1)
                yield (f"{COMPONENT}/graph_draft_metadata[bs={bs},w={w},step={step}]",
                       lambda bs=bs, w=w, step=step: layer.graph_metadata(bs, step + 1, w))
            yield (f"{COMPONENT}/graph_draft_extend_metadata[bs={bs},w={w}]",
                   lambda bs=bs, w=w: layer.draft_extend_metadata(bs, w))
    tokens = {"extend": 7, "decode": 3}
    if "target_verify" in s.paths:
        tokens.update({f"target_verify[w={w}]": 3 * w for w in s.draft_widths})
    for mode, t in tokens.items():
        if mode == "extend" and "extend" not in s.paths or mode == "decode" and not decoding:
            continue
        yield f"{COMPONENT}/kv_store[{mode},T={t}]", lambda t=t: layer.kv_store(t)
    if "extend" in s.paths:
        yield f"{COMPONENT}/prefill_concat_k[new]", lambda: layer.concat_k(7, prefix_read=False)
        yield f"{COMPONENT}/prefill_concat_k[prefix_read]", lambda: layer.concat_k(7, prefix_read=True)
        for w in deployments:
            yield f"{COMPONENT}/prefix_one_shot[w={w}]", lambda w=w: layer.one_shot_prefix(3, w)
            for bs in range(1, ROW_OFFSETS + 1):
                for chunk in range(ROW_OFFSETS):
                    yield (f"{COMPONENT}/prefix_chunk[w={w},bs={bs},chunk={chunk}]",
                           lambda w=w, bs=bs, chunk=chunk: layer.chunk_prefix(bs, chunk, w))


class _Layer:
    """One rank's MLA layer, its pools and the FA3 backend's graph buffers, as sglang allocates them."""

    def __init__(self, m: MlaSpec, s, device: str):
        self.m, self.s, self.device = m, s, device
        self.max_bs = max(s.graph_buckets or (1,))  # init_cuda_graph_state(max_bs): the largest bucket
        self.rows = s.max_batch + 1  # the request pool's rows (any count: no launch specializes on it)

    def _empty(self, *shape, dtype):
        import torch

        return torch.zeros(*shape, dtype=dtype, device=self.device)

    def req_to_token(self, width: int):
        """``ReqToTokenPool.req_to_token``: int32 ``[rows, context_len + 4 + draft tokens]``
        (:func:`.model_scheduler.row_lengths`)."""
        import torch

        from .model_scheduler import ROW_HEADROOM

        return self._empty(self.rows, self.m.context_len + ROW_HEADROOM + width, dtype=torch.int32)

    def kv_buffer(self):
        """One layer of ``MLATokenToKVPool.kv_buffer``: bf16 ``[size + page_size, 1, kv_lora_rank + rope]``."""
        import torch

        return self._empty(4096 + PAGE_SIZE, 1, self.m.row, dtype=torch.bfloat16)

    def _graph_batch(self, bs: int):
        """The graph runner's ``req_pool_indices`` and ``seq_lens`` (int64 ``[max_bs]`` buffers) for bucket ``bs``."""
        import torch

        return (self._empty(self.max_bs, dtype=torch.int64)[:bs],
                torch.ones(self.max_bs, dtype=torch.int64, device=self.device)[:bs])

    def graph_metadata(self, bs: int, delta: int, width: int) -> None:
        """``_set_decode_page_metadata`` on the bucket's metadata (``_bind_metadata_buffers``: the decode or
        target-verify buffers sliced to ``bs``): ``seq_len_delta`` 0 (decode), the draft tokens (chain verify) or a
        draft step's id + 1 (a chain's draft graph, whose step backends each hold such buffers)."""
        import torch

        from sglang.kernels.ops.attention.metadata import normal_decode_set_metadata

        pages = (self.m.context_len + PAGE_SIZE - 1) // PAGE_SIZE  # the backend's max_num_pages
        req_pool_indices, seq_lens = self._graph_batch(bs)
        normal_decode_set_metadata(self._empty(self.max_bs, dtype=torch.int32)[:bs],
                                   self._empty(self.max_bs + 1, dtype=torch.int32)[:bs + 1],
                                   self._empty(self.max_bs, pages, dtype=torch.int32)[:bs, :],
                                   self.req_to_token(width), req_pool_indices, pages, seq_lens, delta, PAGE_SIZE,
                                   None, full_to_swa_index_mapping=None, skip_page_table=False)

    def draft_extend_metadata(self, bs: int, width: int) -> None:
        """FA3's ``init_forward_metadata_in_graph`` for ``DRAFT_EXTEND_V2`` as the draft-extend graph records it at
        bucket ``bs``: ``draft_extend_set_metadata`` on the ``draft_extend_metadata`` buffers (int32 ``[max_bs]``,
        ``[max_bs + 1]`` and ``[max_bs, max_num_pages]`` sliced to ``bs``) with the runner's int64
        ``req_pool_indices`` / ``seq_lens`` and int32 ``extend_seq_lens`` (``[max_bs]`` each, sliced), no SWA."""
        import torch

        from sglang.kernels.ops.attention.metadata import draft_extend_set_metadata

        pages = (self.m.context_len + PAGE_SIZE - 1) // PAGE_SIZE
        req_pool_indices, seq_lens = self._graph_batch(bs)
        draft_extend_set_metadata(
            cache_seqlens_int32=self._empty(self.max_bs, dtype=torch.int32)[:bs],
            cu_seqlens_k=self._empty(self.max_bs + 1, dtype=torch.int32)[:bs + 1],
            cu_seqlens_q=self._empty(self.max_bs + 1, dtype=torch.int32)[:bs + 1],
            page_table=self._empty(self.max_bs, pages, dtype=torch.int32)[:bs, :],
            req_to_token=self.req_to_token(width),
            req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            extend_seq_lens=torch.full((self.max_bs,), width, dtype=torch.int32, device=self.device)[:bs],
            page_size=PAGE_SIZE)

    def tree_verify_page_table(self, bs: int, width: int) -> None:
        """The top-k > 1 verify replay's prefix page table (``target_verify_metadata_topk_normal``: int32
        ``[max_bs, context_len]`` sliced to ``bs``) from its ``cache_seqlens``."""
        import torch

        from sglang.kernels.ops.attention.trtllm_mha_page_table import build_trtllm_mha_page_table

        req_pool_indices, _ = self._graph_batch(bs)
        build_trtllm_mha_page_table(req_to_token=self.req_to_token(width), req_pool_indices=req_pool_indices,
                                    cache_seqlens=self._empty(self.max_bs, dtype=torch.int32)[:bs],
                                    page_table=self._empty(self.max_bs, self.m.context_len,
                                                           dtype=torch.int32)[:bs, :],
                                    page_size=PAGE_SIZE)

    def _latent(self, tokens: int):
        """``kv_a_proj_with_mqa``'s output ``[T, kv_lora_rank + rope]`` unsqueezed, its normed ``kv_a`` and its
        ``k_pe`` slice, as ``forward_normal_prepare`` / ``forward_absorb_prepare`` split them."""
        import torch

        m = self.m
        latent = self._empty(tokens, m.row, dtype=torch.bfloat16).unsqueeze(1)
        kv_a = self._empty(tokens, m.kv_lora_rank, dtype=torch.bfloat16)  # kv_a_layernorm's output
        return latent, kv_a, latent[:, :, m.kv_lora_rank:]

    def kv_store(self, tokens: int) -> None:
        """``set_mla_kv_buffer`` of ``tokens`` new tokens (``KVWriteLoc``: ``out_cache_loc`` int64) through the
        pool's ``_scatter_mla_rows`` (no DCP resolution declared: the DCP-sharded entry, at DCP size 1; it reads
        this rank's DCP rank, which sglang's publish states as 0 where DCP is off)."""
        import torch
        from sglang.srt.runtime_context import get_parallel

        from sglang.kernels.ops.kvcache.mla_buffer import set_mla_kv_buffer_dcp_sharded_triton

        _, kv_a, k_pe = self._latent(tokens)
        with get_parallel().override(attn_dcp_rank=0):
            set_mla_kv_buffer_dcp_sharded_triton(self.kv_buffer(), self._empty(tokens, dtype=torch.int64),
                                                 kv_a.unsqueeze(1), k_pe)

    def concat_k(self, tokens: int, prefix_read: bool) -> None:
        """``_concat_and_cast_mha_k``: ``k_nope`` a view of ``kv_b_proj``'s ``[T, H, nope + v]``; ``k_pe`` the
        latent row's slice (new tokens) or ``get_mla_kv_buffer``'s ``[N, 1, rope]`` copy (a prefix read back)."""
        import torch

        from sglang.kernels.ops.attention.mla_qk_prep import concat_and_cast_mha_k_triton

        m = self.m
        kv = self._empty(tokens, m.heads * (m.qk_nope_head_dim + m.v_head_dim), dtype=torch.bfloat16)
        k_nope = kv.view(-1, m.heads, m.qk_nope_head_dim + m.v_head_dim)[..., :m.qk_nope_head_dim]
        k_pe = (self._empty(tokens, 1, m.qk_rope_head_dim, dtype=torch.bfloat16) if prefix_read
                else self._latent(tokens)[2])
        k = self._empty(tokens, m.heads, m.qk_nope_head_dim + m.qk_rope_head_dim, dtype=torch.bfloat16)
        concat_and_cast_mha_k_triton(k, k_nope, k_pe)

    def _read_prefix(self, loc) -> None:
        """``MLATokenToKVPool.get_mla_kv_buffer`` of ``loc`` (int32 indices) as bf16."""
        import torch

        from sglang.kernels.ops.kvcache.mla_buffer import get_mla_kv_buffer_triton

        n, m = loc.shape[0], self.m
        get_mla_kv_buffer_triton(self.kv_buffer(), loc, self._empty(n, 1, m.kv_lora_rank, dtype=torch.bfloat16),
                                 self._empty(n, 1, m.qk_rope_head_dim, dtype=torch.bfloat16))

    def one_shot_prefix(self, bs: int, width: int) -> None:
        """``fetch_mha_one_shot_kv_indices`` (the translator's passthrough: ``pack_read_stream`` gathers
        ``req_to_token`` rows, one token block) then the read of those indices."""
        import torch

        from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton

        req_to_token = self.req_to_token(width)
        kv_indices = self._empty(5 * bs, dtype=torch.int32)
        create_flashinfer_kv_indices_triton[(bs, 1)](
            req_to_token, self._empty(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.int64, device=self.device),
            self._empty(bs + 1, dtype=torch.int32), None, kv_indices, req_to_token.stride(0), ENTRY_PAGE_SIZE=1,
            TOKEN_BLOCK_PARALLEL=False, token_mapping=None)
        self._read_prefix(kv_indices)

    def chunk_prefix(self, bs: int, chunk: int, width: int) -> None:
        """``prepare_chunked_kv_indices`` for chunk ``chunk`` of a ``bs``-request batch: its rows of
        ``get_prefix_chunk_seq_lens``' int32 ``[chunks, bs]`` starts and lengths and of the ``[chunks, bs + 1]``
        prefix sums (each row's pointer at ``chunk x bs`` / ``chunk x (bs + 1)`` int32s), then the chunk's read."""
        import torch

        from sglang.kernels.ops.attention.kv_indices import create_chunked_prefix_cache_kv_indices

        chunks = chunk + 1
        req_to_token = self.req_to_token(width)
        starts = torch.arange(chunks, dtype=torch.int32, device=self.device).unsqueeze(1).expand(-1, bs) * 64
        lens = self._empty(chunks, bs, dtype=torch.int32)
        cu = self._empty(chunks, bs + 1, dtype=torch.int32)
        kv_indices = self._empty(64 * bs, dtype=torch.int32)
        create_chunked_prefix_cache_kv_indices[(bs,)](req_to_token, self._empty(bs, dtype=torch.int64),
                                                      starts[chunk], lens[chunk], cu[chunk], kv_indices,
                                                      req_to_token.shape[1])
        self._read_prefix(kv_indices)


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook."""
    model = (spec.get("sglang") or {}).get("model")
    if not isinstance(model, dict) or "kv_lora_rank" not in model:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": "the MLA layers' graph metadata, KV store and prefill kernels",
             "why": "no [spec.sglang.model] kv_lora_rank: the model's MLA widths are not stated"}]}
    return {"component": COMPONENT, "planned": list(KERNELS), "not_planned": [dict(d) for d in NOT_PLANNED]}
