"""Seeded, server-like steps of vLLM 0.34.0's V2 model runner serving Kimi-Linear with MTP (the H200 vLLM manifest):
an independent check, written only from vLLM's own sources (``vllm/v1/worker/gpu/``: ``model_runner.py``,
``input_batch.py``, ``block_table.py``, ``states.py``, ``buffer_utils.py``, ``sample/``, ``spec_decode/``,
``model_states/mamba_hybrid.py``; ``vllm/v1/worker/mamba_utils.py`` and ``utils.py``), never from the provider
(``prewarm.providers.vllm``) or the other model-level traffic (``vllm_model``, ``vllm_step``). ``tests/
test_vllm_runner_step.py`` runs it on fake tensors under Triton's real key computation against the manifest's plan.

One ``Call`` is one engine step as ``GPUModelRunner.execute_model`` + ``sample_tokens`` run it (the deployment:
``--max-num-seqs``, ``--max-num-batched-tokens``, MTP with ``num_speculative_tokens`` = draft width - 1, prefix
caching in mamba ``align`` mode, hybrid pages of ``block_size`` tokens, CUDA graphs at the manifest's
``decode_batch_buckets``), in the runner's order:

- ``add_requests``: vLLM's ``RequestState.add_request`` / ``BlockTables.append_block_ids`` (overwrite) / the mamba
  model state's ``add_request`` lines / ``PenaltiesState.add_request``, then ``RequestState.apply_staged_writes``
  (``StagedWriteTensor.apply_write``: ``_apply_write_kernel`` on ``all_token_ids`` (2-D), ``total_len`` and
  ``num_computed_tokens`` (1-D, row stride 1)) and the sampler's ``apply_staged_writes`` (``PenaltiesState``: the
  prompt / output ``bincount`` of each new request with penalties). New requests may hit the prefix cache (whole
  blocks computed) and arrive as chunks of a longer prompt.
- ``update_requests``: new blocks of running requests (``append_block_ids``), the zeroing of every newly allocated
  attention block (``KVBlockZeroer.zero_block_ids``: Kimi-Linear has mamba layers, so
  ``KVCacheConfig.needs_kv_cache_zeroing`` is on and the scheduler sends ``new_block_ids_to_zero`` each step it
  allocates MLA blocks), ``BlockTables.apply_staged_writes`` (the fused multi-group writer: 1 MLA + ``mamba_groups``
  KDA groups, ``MULTI_GROUP=True``).
- ``prepare_inputs`` (transcribed from ``GPUModelRunner.prepare_inputs``; the real ``expand_idx_mapping``,
  ``prepare_prefill_inputs``, ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``), ``prepare_attn``
  (the real ``BlockTables.gather_block_tables`` / ``compute_slot_mappings``), the real
  ``MambaHybridModelState.preprocess_state`` (align pre-copy), the aligned state indices its ``prepare_attn`` computes
  (the real ``MambaSpecDecodeGPUContext.compute_aligned_state_indices``, at the graph's padded request count).
- ``sample``: a batch without drafts -> the ``Sampler`` (transcribed from ``sample/sampler.py``: fp32 copy when a
  request needs processing, ``apply_penalties``, ``apply_temperature``, ``apply_min_p``, ``gumbel_sample``,
  ``get_num_sampled_and_rejected``); with drafts -> the ``RejectionSampler`` (transcribed from
  ``spec_decode/rejection_sampler.py``: ``gather_draft_sampled``, the same sampling params, ``rejection_sample``
  with ``skip_masked_vocab_blocks``, ``get_num_sampled_and_rejected``). Requests draw temperature 0 / 1 / other,
  min-p, repetition / frequency / presence penalties and explicit seeds; the logits are bf16 (the model's dtype)
  unless a request needs processing.
- ``postprocess_sampled``: the real ``post_update`` (output bin counts, the drafts' ``draft_tokens_out``) and the
  real ``MambaHybridModelState.postprocess_state`` (``_scatter_num_accepted_kernel``, the align post-copy).
- ``propose`` (transcribed from ``TargetDependentARSpeculator.propose`` / ``AutoRegressiveSpeculator``'s multi-step
  decode for ``MTPSpeculator``, greedy drafts: vLLM's default ``draft_sample_method``): the real
  ``prepare_prefill_inputs`` and ``update_draft_inputs`` of ``target_dependent_ar/speculator.py``, its
  ``_prepare_decode_inputs_kernel`` launch (``_prepare_decode_inputs``), ``greedy_argmax`` on the draft logits,
  ``compute_slot_mappings`` per draft step; under a decode CUDA graph the launches are the capture's, at the
  bucket's request count.

Kinds: ``prefill`` (new requests only: the plain sampler), ``decode`` (running requests with drafts: the rejection
sampler; up to the largest bucket padded to a CUDA-graph bucket, above it eager), ``mixed`` (prefill chunks beside
drafted decodes: eager/piecewise, the rejection sampler). Batch sizes run 1..``max_running_requests`` (each once
before any twice), prompts cross block boundaries.

Where vLLM's class cannot be built without the serving stack or a driver, its state is built as its ``__init__``
builds it (named at each place): UVA buffers (``UvaBufferPool``: pinned host memory mapped into the device, which
needs a driver) are device buffers of the same dtype and shape, as vLLM's own ``NonUvaBuffer`` fallback makes them
(:func:`_device_pools`); the model's KV pages are allocated as the hybrid allocator shares them (one page tensor per
layer position, the MLA layer's view and each KDA layer's conv / recurrent views on it).

Not driven here (each named under "not planned" by ``prewarm plan`` for the vLLM manifest, with its reason; the test
cites them): the Triton top-k / top-p masking (``apply_top_k_top_p``: requests with top-k / top-p beside a greedy or
seeded one) and FlashInfer's fused sampler; logit bias / allowed / bad words / min-tokens / thinking budget /
logprobs and their staged tables; ``--use-fp64-gumbel``; the structured-output bitmask
(``_apply_grammar_bitmask_kernel``); ``VLLM_COMPUTE_NANS_IN_LOGITS``; probabilistic drafts (``DraftLogitsCache``);
adaptive verification; other speculators; DCP / PCP / multimodal / prompt embeds; the DS conv layout; ReplaySSM /
RecoverSSM. Not driven because this deployment never reaches them: ``post_update_num_computed_tokens`` and
``_fill_num_accepted_kernel`` (a non-last pipeline-parallel rank only, ``sample_tokens``; TP 1, no PP), the
rejection sampler's chunking (``MAX_CHUNK_BYTES`` / (vocab x 4) = 1638 logits rows > 256 x 4), the prefix cache's
block copies (``copy_kv_cache_blocks_inplace``: torch indexing, no Triton). The model's forward (KDA, MoE, MLA, the
draft model's layers) is other traffic's.

Each call's options: ``kind``, ``reqs``, ``graph`` (the bucket a FULL decode graph pads to, else None), ``sampler``
(``sampler`` / ``rejection``), ``logits`` (the dtype the sampling kernels see: ``bfloat16`` unless a request needs
processing), the prefill tokens and temperatures drawn. Steps alternate (seeded) a ``plain`` profile (new and picked
requests greedy or temperature 1, no min-p, no penalty) with ``any``, so both logits dtypes reach both samplers.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

from traffic import Call, cycle, short

KINDS = ("prefill", "decode", "mixed")
NUM_BLOCKS = 1024  # the KV pool's blocks (any count the node's memory gives; block ids are drawn below it)


@dataclass(frozen=True)
class Deployment:
    """What the manifest's [spec] says the server runs, read here on its own."""

    max_reqs: int
    max_tokens: int
    num_spec: int
    buckets: tuple[int, ...]  # the decode CUDA graphs' request counts
    vocab: int
    max_model_len: int
    block_size: int
    mamba_groups: int
    kda_layers: int
    hidden: int
    conv_width: int
    heads: int
    head_k: int
    head_v: int
    page_bytes: int

    @classmethod
    def of(cls, spec: dict) -> "Deployment":
        serving, vllm, model = spec["serving"], spec["vllm"], spec["model"]
        (width,) = serving["draft_widths"]
        (page,) = vllm["mamba_page_bytes"]
        return cls(max_reqs=serving["max_running_requests"], max_tokens=serving["max_prefill_tokens"],
                   num_spec=width - 1, buckets=tuple(sorted(serving["decode_batch_buckets"])),
                   vocab=vllm["vocab_size"], max_model_len=vllm["max_model_len"], block_size=vllm["block_size"],
                   mamba_groups=vllm["mamba_groups"], kda_layers=model["layers"], hidden=vllm["draft_hidden_size"],
                   conv_width=vllm["conv_kernel_size"], heads=model["kda_heads"], head_k=model["head_k_dim"],
                   head_v=model["head_v_dim"], page_bytes=page)

    @property
    def layers_per_group(self) -> int:
        return -(-self.kda_layers // self.mamba_groups)  # the hybrid allocator's group size (7: the MLA layers)

    @property
    def attn_width(self) -> int:  # FullAttentionSpec.max_num_blocks_per_req, get_block_table_width (token align 128)
        return -(-self.max_model_len // self.block_size)

    @property
    def mamba_width(self) -> int:  # MambaSpec.max_num_blocks_per_req in align mode: + num_speculative_blocks
        return -(-self.max_model_len // self.block_size) + self.num_spec


def kinds(spec: dict) -> list[str]:
    return list(KINDS)


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    t = _Traffic(Deployment.of(spec), random.Random(seed), device)
    for i in range(n):
        yield t.draw(i)


# --- the sampling parameters a request draws (vllm.sampling_params.SamplingParams' fields the runner reads) -------

def _sampling(rng: random.Random, plain: bool) -> dict:
    """A request's options; ``plain``: one the sampler leaves unprocessed (greedy or temperature 1, no min-p, no
    penalty: the logits stay in the model's dtype when every request of a batch is plain)."""
    temperature = rng.choice([0.0, 1.0] if plain else [0.0, 1.0, 0.7, 1.3])
    penalties = (1.0, 0.0, 0.0) if plain else rng.choice(
        [(1.0, 0.0, 0.0), (1.1, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.3)])
    return {"temperature": temperature, "min_p": 0.0 if plain else rng.choice([0.0, 0.05]), "top_k": 0,
            "top_p": 1.0, "repetition_penalty": penalties[0], "frequency_penalty": penalties[1],
            "presence_penalty": penalties[2], "seed": rng.choice([None, None, rng.randrange(1 << 31)])}


def _processed(p: dict) -> bool:
    """``Sampler.needs_logits_processing`` of a request (SamplingStates.add_request, the penalties' add_request)."""
    penalty = p["repetition_penalty"] != 1.0 or p["frequency_penalty"] != 0.0 or p["presence_penalty"] != 0.0
    return penalty or (p["temperature"] != 0.0 and (p["temperature"] != 1.0 or p["min_p"] != 0.0))


class _Traffic:
    def __init__(self, d: Deployment, rng: random.Random, device: str):
        self.d, self.rng, self.device = d, rng, device
        self.kinds = cycle(rng, KINDS)
        self.profiles = cycle(rng, ["plain", "any"])
        self.batches = cycle(rng, range(1, d.max_reqs + 1))
        self.free = list(range(d.max_reqs))  # request-state slots (RequestState.free_indices)
        rng.shuffle(self.free)
        self.running: dict[int, dict] = {}  # slot -> the host's view of a request the runner holds
        self.next_block = 1  # block 0 is the null block
        self.state = None  # built at the first run (inside whatever fake mode runs the calls)

    # ---- drawing (pure Python: the calls are drawn before they run) ----------------------------------------------

    def blocks(self, n: int) -> list[int]:
        out = [(self.next_block + i - 1) % (NUM_BLOCKS - 1) + 1 for i in range(n)]
        self.next_block += n
        return out

    def new_request(self, budget: int, plain: bool) -> dict:
        """A new request (scheduler: ``NewRequestData``): a prompt, maybe a prefix-cache hit of whole blocks, the
        first chunk of at most ``budget`` tokens."""
        d, rng = self.d, self.rng
        prompt = rng.choice([rng.randint(1, 64), rng.randint(d.block_size - 8, d.block_size + 8),
                             rng.randint(2, 3 * d.block_size), rng.randint(3 * d.block_size, 6 * d.block_size)])
        hit = rng.choice([0, 0, (prompt - 1) // d.block_size * d.block_size])  # whole blocks, never the last token
        chunk = min(prompt - hit, budget)
        slot = self.free.pop()
        blocks = -(-(hit + chunk) // d.block_size)
        r = {"slot": slot, "prompt": prompt, "computed": hit, "params": _sampling(rng, plain), "blocks": blocks}
        return {**r, "chunk": chunk, "new_blocks": [self.blocks(blocks) for _ in range(1 + d.mamba_groups)]}

    def decoding(self, count: int, plain: bool) -> list[dict]:
        """``count`` running requests in decode (each scheduled 1 + num_spec tokens: its last sample and drafts);
        requests first met here join as a prompt whose prefill the runner finished in an earlier step."""
        d = self.d
        have = [r for r in self.running.values()
                if r["computed"] >= r["prompt"] and not (plain and _processed(r["params"]))]
        self.rng.shuffle(have)
        out = have[:count]
        while len(out) < count and self.free:
            r = self.new_request(d.max_tokens, plain)
            r = {**r, "computed": r["prompt"], "chunk": 0, "joined": True}
            out.append(r)
        return out

    def draw(self, i: int) -> Call:
        d, rng = self.d, self.rng
        kind, plain = next(self.kinds), next(self.profiles) == "plain"
        new, running, decodes = [], [], []
        chunked = [r for r in self.running.values()
                   if r["computed"] < r["prompt"] and not (plain and _processed(r["params"]))]
        if kind == "prefill":
            budget = d.max_tokens
            for _ in range(rng.choice([1, 1, 2, 3, rng.randint(4, 16)])):
                if budget <= 0 or not self.free:
                    break
                r = self.new_request(budget, plain)
                budget -= r["chunk"]
                new.append(r)
            if chunked and budget > 0:  # a running request's next prefill chunk
                r = chunked[0]
                running.append({**r, "chunk": min(r["prompt"] - r["computed"], budget)})
        elif kind == "decode":
            decodes = self.decoding(min(next(self.batches), d.max_reqs), plain)
        else:
            decodes = self.decoding(rng.randint(1, max(1, d.max_reqs // 2)), plain)
            budget = d.max_tokens - len(decodes) * (1 + d.num_spec)
            if self.free and budget > 0:
                new.append(self.new_request(budget, plain))
            elif chunked:
                running.append({**chunked[0], "chunk": 1})
        joined = [r for r in decodes if r.get("joined")]
        decodes = [dict(r) for r in decodes if not r.get("joined")]  # as scheduled (the host's view moves on)
        # the host's view after this step (the scheduler's bookkeeping)
        for r in new + running:
            self.running[r["slot"]] = {**r, "computed": r["computed"] + r["chunk"]}
        for r in joined:
            self.running[r["slot"]] = {k: v for k, v in r.items() if k != "joined"}
        for r in decodes:
            self.running[r["slot"]]["computed"] += 1
        # retire some requests (their slots are reused by later new requests)
        for slot in [s for s in self.running if rng.random() < 0.05]:
            del self.running[slot]
            self.free.insert(0, slot)
        num_reqs = len(new) + len(running) + len(joined) + len(decodes)
        uniform = not new and not running
        bucket = next((b for b in d.buckets if b >= num_reqs), None) if uniform else None
        step = {"kind": kind, "new": new + joined, "running": running, "decodes": decodes + joined,
                "graph": bucket}
        rows = new + running + decodes + joined
        opts = {"kind": kind, "reqs": num_reqs, "graph": bucket,
                "sampler": "rejection" if decodes or joined else "sampler",
                "logits": "float32" if any(_processed(r["params"]) for r in rows) else "bfloat16",
                "prefill_tokens": sum(r["chunk"] for r in new + running),
                "temperatures": sorted({r["params"]["temperature"] for r in rows})}
        label = f"vllm-runner-step[{i}:{kind},reqs={num_reqs},graph={bucket},logits={opts['logits']}," \
                f"prefill={short([r['chunk'] for r in new + running])}]"
        return Call(label, lambda: self.step(step), opts)

    # ---- running one step -------------------------------------------------------------------------------------

    def step(self, st: dict) -> None:
        if self.state is None:
            self.state = _State(self.d, self.device)
        self.state.step(st)


@contextlib.contextmanager
def _device_pools(device: str):
    """vLLM's ``UvaBufferPool`` (``buffer_utils.py``) maps pinned host memory into the device (UVA), which needs a
    driver: within the block every pool vLLM's classes build hands out device tensors of the pool's dtype, shape
    and offset, as vLLM's own ``NonUvaBuffer`` fallback does (an explicit host-to-device copy), and a large
    ``StagedWriteTensor`` asked for on UVA lives on the device (``is_uva_available`` False). The kernels see the
    same dtypes, shapes and alignments."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu import buffer_utils

    class DevicePool:
        def __init__(self, size, dtype, max_concurrency=None):
            self.dtype = dtype

        def _device(self, host: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.ascontiguousarray(host)).to(dtype=self.dtype, device=device)

        def copy_to_uva(self, x):
            if isinstance(x, torch.Tensor):
                return x.to(dtype=self.dtype, device=device)
            return self._device(np.asarray(x))

        def copy_chunks_to_uva(self, chunks, n: int):
            return self._device(np.concatenate([np.asarray(c) for c in chunks])[:n])

        def copy_to_gpu(self, x, out=None):
            uva = self.copy_to_uva(x)
            return uva.clone() if out is None else out.copy_(uva, non_blocking=True)

    original = buffer_utils.UvaBackedTensor

    class HostBackedTensor(original):
        """``UvaBackedTensor.__init__`` line by line; its host copy (the source of truth the runner's numpy reads)
        is a real host tensor even where the device's tensors are fake."""

        def __init__(self, size, dtype, max_concurrency=None):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            self.dtype = dtype
            with unset_fake_temporarily():
                self.cpu = torch.zeros(size, dtype=dtype, device="cpu", pin_memory=False)
            self.np = self.cpu.numpy()
            self.pool = DevicePool(size, dtype, max_concurrency)
            self.gpu = self.pool.copy_to_uva(self.np)

    from vllm.v1.worker.gpu import block_table, states
    from vllm.v1.worker.gpu.sample import penalties

    homes = [m for m in (buffer_utils, states, block_table, penalties) if m.UvaBackedTensor is original]
    saved = buffer_utils.UvaBufferPool, buffer_utils.is_uva_available
    buffer_utils.UvaBufferPool, buffer_utils.is_uva_available = DevicePool, lambda: False
    for m in homes:
        m.UvaBackedTensor = HostBackedTensor
    try:
        yield
    finally:
        buffer_utils.UvaBufferPool, buffer_utils.is_uva_available = saved
        for m in homes:
            m.UvaBackedTensor = original


class _State:
    """The runner's state for the deployment, built as ``GPUModelRunner.__init__`` / ``initialize_kv_cache`` build
    it (each piece names its vLLM home)."""

    def __init__(self, d: Deployment, device: str):
        import numpy as np
        import torch
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState
        from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
        from vllm.v1.worker.gpu.states import RequestState

        self.d, self.device, self.np, self.torch = d, device, np, torch
        dev = torch.device(device)
        with _device_pools(device):
            # model_runner.py GPUModelRunner.__init__: RequestState (num_prefill_lookahead 1), InputBuffers
            self.req_states = RequestState(d.max_reqs, d.max_model_len, d.max_tokens, d.num_spec, d.vocab, dev)
            self.input_buffers = InputBuffers(d.max_reqs, d.max_tokens, dev)
            # initialize_kv_cache: one MLA group, then the KDA groups (block tables of their own widths)
            groups = 1 + d.mamba_groups
            self.block_tables = BlockTables([d.block_size] * groups, d.max_reqs, d.max_tokens,
                                            [d.attn_width] + [d.mamba_width] * d.mamba_groups, dev,
                                            slot_mapping_enabled=[True] + [False] * d.mamba_groups,
                                            dcp_sharded=[True] + [False] * d.mamba_groups)
            # Sampler.__init__: SamplingStates (sample/states.py) and PenaltiesState (sample/penalties.py)
            self.temperature = buffer_utils.UvaBackedTensor(d.max_reqs, dtype=torch.float32)
            self.min_p = buffer_utils.UvaBackedTensor(d.max_reqs, dtype=torch.float32)
            self.seeds = buffer_utils.UvaBackedTensor(d.max_reqs, dtype=torch.int64)
            self.penalties = PenaltiesState(None, LogitsProcRequestState.from_request_state(self.req_states))
        self.host_temperature = np.zeros(d.max_reqs, np.float32)
        self.host_min_p = np.zeros(d.max_reqs, np.float32)
        self.needs_processing = np.zeros(d.max_reqs, bool)  # Sampler.needs_logits_processing
        self.may_mask = np.zeros(d.max_reqs, bool)  # Sampler.may_mask_logits
        self.block_cursor = NUM_BLOCKS // 2  # the running requests' next blocks (new requests' are drawn)
        self.model_state = self._mamba_state()
        self.zeroer = self._zeroer()
        self.drafter = self._drafter()

    # -- model_states/mamba_hybrid.py MambaHybridModelState (align mode), its MambaSpecDecodeGPUContext --------------
    def _mamba_state(self):
        torch, d, dev = self.torch, self.d, self.device
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
        from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

        # the hybrid allocator's pages: one tensor per layer position, shared by the MLA layer and one KDA layer of
        # each group (conv state (dim-contiguous, SD) then the fp32 recurrent state in each page)
        self.pages = [torch.zeros(NUM_BLOCKS, d.page_bytes, dtype=torch.uint8, device=dev)
                      for _ in range(d.layers_per_group)]
        conv_len = d.conv_width - 1 + d.num_spec
        conv_dim = d.heads * (2 * d.head_k + d.head_v)
        conv_bytes = conv_len * conv_dim * 2
        states = []  # (tensor, group) per KDA layer state, in MambaSpecDecodeGPUContext._populate_metadata's order
        for g in range(d.mamba_groups):
            for page in self.pages[: min(d.layers_per_group, d.kda_layers - g * d.layers_per_group)]:
                conv = page[:, :conv_bytes].view(torch.bfloat16).view(NUM_BLOCKS, conv_len, conv_dim)
                rec = page[:, conv_bytes:conv_bytes + d.heads * d.head_k * d.head_v * 4].view(torch.float32)
                states += [(conv, g, conv_len), (rec.view(NUM_BLOCKS, d.heads, d.head_k, d.head_v), g, 0)]
        n = len(states)
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        mamba_tables = self.block_tables.block_tables[1:]
        ctx = MambaSpecDecodeGPUContext(  # MambaSpecDecodeGPUContext.create, then _populate_metadata's values
            state_base_addrs=torch.tensor([t.data_ptr() for t, _, _ in states], **i64),
            state_block_strides=torch.tensor([t.stride(0) * t.element_size() for t, _, _ in states], **i64),
            state_elem_sizes=torch.tensor([t.element_size() for t, _, _ in states], **i32),
            state_inner_sizes=torch.tensor([t.stride(1) if w else t[0].numel() for t, _, w in states], **i64),
            state_conv_widths=torch.tensor([w for _, _, w in states], **i32),
            state_group_indices=torch.tensor([g for _, g, _ in states], **i32),
            state_dim_row_count=torch.zeros(n, **i32), state_dim_row_stride=torch.zeros(n, **i64),
            block_size=d.block_size, num_states=n, mamba_group_ids=list(range(1, 1 + d.mamba_groups)),
            num_groups=d.mamba_groups, num_accepted_tokens_snapshot=torch.zeros(d.max_reqs, **i32),
            block_table_ptrs=torch.tensor([t.gpu.data_ptr() for t in mamba_tables], **i64),
            aligned_index_block_table_ptrs=torch.tensor(
                [t.data_ptr() for t in self.block_tables.input_block_tables[1:]], **i64),
            block_table_stride_req=mamba_tables[0].gpu.stride(0),
            aligned_state_indices=torch.empty((d.mamba_groups, d.max_reqs, 1 + d.num_spec), **i32),
            is_initialized=True, replayssm=None)
        # MambaHybridModelState.__init__ (align mode, no ReplaySSM, no RecoverSSM) and initialize_kv_cache
        m = object.__new__(MambaHybridModelState)
        m.max_num_reqs, m.device = d.max_reqs, dev
        m.num_accepted_tokens_gpu = torch.ones(d.max_reqs, **i32)
        m._align_mode, m._use_flashinfer_replayssm, m.recoverssm = True, False, None
        m._mamba_ctx, m._mamba_group_ids = ctx, ctx.mamba_group_ids
        m._mamba_spec = SimpleNamespace(block_size=d.block_size)  # the groups' MambaSpec: only its block size is read
        m._mamba_state_idx_gpu = torch.zeros(d.max_reqs, **i32)
        m._mamba_src_col_gpu = torch.full((d.max_reqs,), -1, **i32)
        m._mamba_src_off_gpu = torch.zeros(d.max_reqs, **i32)
        m._replayssm_query_start_loc = None
        return m

    # -- v1/worker/utils.py KVBlockZeroer over the MLA layers' pages (GPUModelRunner._init_kv_zero_meta) ----------
    def _zeroer(self):
        torch, dev = self.torch, self.device
        # KVBlockZeroer.__init__'s _meta: one segment per MLA layer's KV (its page, [blocks, block_size, 576] bf16),
        # block stride and page in int32 words; BLOCK_SIZE = min(next_pow2(page words), 1024)
        page_words = self.d.page_bytes // 4
        blk = min(1 << (page_words - 1).bit_length(), 1024)
        return (torch.tensor([p.data_ptr() for p in self.pages], dtype=torch.uint64, device=dev),
                torch.tensor([page_words] * len(self.pages), dtype=torch.int64, device=dev),
                torch.tensor([page_words] * len(self.pages), dtype=torch.int64, device=dev),
                (page_words + blk - 1) // blk, blk, len(self.pages))

    # KVBlockZeroer.zero_block_ids (its async_tensor_h2d stages the ids in pinned host memory: a driver's)
    def zero_block_ids(self, block_ids: list[int]) -> None:
        from vllm.v1.worker.utils import _zero_kv_blocks_kernel

        seg_addrs, seg_block_strides, seg_page_sizes, max_chunks, blk_size, n_segs = self.zeroer
        idx = self.torch.tensor(block_ids, dtype=self.torch.int64).to(self.device)
        _zero_kv_blocks_kernel[(len(block_ids), n_segs, max_chunks)](
            seg_addrs, seg_block_strides, seg_page_sizes, idx, BLOCK_SIZE=blk_size)

    # -- spec_decode/speculator.py DraftModelSpeculator + autoregressive / target_dependent_ar __init__ (MTP) -------
    def _drafter(self):
        torch, d, dev = self.torch, self.d, self.device
        from vllm.v1.worker.gpu.input_batch import InputBuffers

        return SimpleNamespace(
            input_buffers=InputBuffers(d.max_reqs, d.max_tokens, dev),
            idx_mapping=torch.zeros(d.max_reqs, dtype=torch.int64, device=dev),
            temperature=torch.zeros(d.max_reqs, dtype=torch.float32, device=dev),
            seeds=torch.zeros(d.max_reqs, dtype=torch.int64, device=dev),
            draft_tokens=torch.zeros(d.max_reqs, d.num_spec, dtype=torch.int64, device=dev),
            current_draft_step=torch.tensor(0, dtype=torch.int64, device=dev),
            last_token_indices=torch.zeros(d.max_reqs, dtype=torch.int64, device=dev),
            hidden_states=torch.zeros(d.max_tokens, d.hidden, dtype=torch.bfloat16, device=dev),
            sample_src_positions=torch.zeros(d.max_reqs, dtype=torch.int64, device=dev),
            max_model_len_gpu=torch.tensor(d.max_model_len, dtype=torch.int32, device=dev))

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self, st: dict) -> None:
        self.add_requests(st["new"])
        self.update_requests(st["new"], st["running"], st["decodes"])
        batch = self.prepare_inputs(st)
        block_tables, _ = self.prepare_attn(batch)
        self.model_state.preprocess_state(batch, block_tables, None, self.req_states.num_computed_tokens.gpu)
        self.aligned_state_indices(batch)
        logits = self.torch.zeros(batch.num_logits, self.d.vocab, dtype=self.torch.bfloat16, device=self.device)
        if batch.num_draft_tokens == 0:
            sampled, num_sampled, num_rejected = self.sampler(logits, batch)
        else:
            sampled, num_sampled, num_rejected = self.rejection_sampler(logits, batch)
        self.postprocess_sampled(batch, sampled, num_sampled, num_rejected)
        self.propose(batch, num_sampled, num_rejected)

    # model_runner.py add_requests
    def add_requests(self, new: list[dict]) -> None:
        if not new:
            return
        rng = random.Random(len(new))  # the prompts' token ids and unseeded requests' seeds
        with _device_pools(self.device):
            for r in new:
                slot, p = r["slot"], r["params"]
                tokens = [rng.randrange(self.d.vocab) for _ in range(min(r["prompt"], 64))]
                tokens = (tokens * (-(-r["prompt"] // len(tokens))))[: r["prompt"]]
                self.req_states.remove_request(f"r{slot}")  # the slot's previous request, finished
                # RequestState.add_request pops the last free index: the slot the host drew
                self.req_states.free_indices.remove(slot)
                self.req_states.free_indices.append(slot)
                self.req_states.add_request(f"r{slot}", r["prompt"], tokens, r["computed"], 256)
                # MambaHybridModelState.add_request
                self.model_state.num_accepted_tokens_gpu[slot].fill_(1)
                self.model_state._mamba_state_idx_gpu[slot].fill_((r["computed"] - 1) // self.d.block_size)
                self.block_tables.append_block_ids(slot, tuple(r["new_blocks"]), overwrite=True)
                # Sampler.add_request: SamplingStates.add_request, the logits processors' (penalties)
                self.host_temperature[slot], self.host_min_p[slot] = p["temperature"], p["min_p"]
                self.temperature.np[slot], self.min_p.np[slot] = p["temperature"], p["min_p"]
                self.seeds.np[slot] = p["seed"] if p["seed"] is not None else rng.randrange(1 << 62)
                needs = p["temperature"] != 0.0 and (p["temperature"] != 1.0 or p["min_p"] != 0.0)
                may_mask = p["temperature"] != 0.0 and p["min_p"] != 0.0
                penalty = self.penalties.add_request(slot, SimpleNamespace(**p))
                self.needs_processing[slot] = needs or may_mask or penalty
                self.may_mask[slot] = may_mask or penalty
            self.req_states.apply_staged_writes()
            # Sampler.apply_staged_writes: SamplingStates' UVA copies, PenaltiesState's bincount
            for t in (self.temperature, self.min_p, self.seeds):
                t.copy_to_uva()
            self.penalties_staged_writes()

    # sample/penalties.py PenaltiesState.apply_staged_writes (its async_tensor_h2d pins host memory: a driver's)
    def penalties_staged_writes(self) -> None:
        from vllm.v1.worker.gpu.sample.penalties import bincount

        pen, torch = self.penalties, self.torch
        if pen._new_penalties_reqs:
            idx_mapping = torch.tensor(pen._new_penalties_reqs, dtype=torch.int64).to(self.device)
            max_prefill_len = int(self.req_states.prefill_len.np[pen._new_penalties_reqs].max())
            bincount(idx_mapping, self.req_states.all_token_ids.gpu, self.req_states.prompt_len.gpu,
                     self.req_states.prefill_len.gpu, pen.prompt_bin_mask, pen.output_bin_counts, max_prefill_len)
            pen._new_penalties_reqs.clear()
        for t in (pen.repetition_penalty, pen.frequency_penalty, pen.presence_penalty):
            t.copy_to_uva()

    # model_runner.py update_requests (+ execute_model's block_tables.apply_staged_writes)
    def update_requests(self, new: list[dict], running: list[dict], decodes: list[dict]) -> None:
        zero = [b for r in new for b in r["new_blocks"][0]]
        for r in running + decodes:
            seq = r["computed"] + max(r.get("chunk", 0), 1 + self.d.num_spec)
            if seq > r["blocks"] * self.d.block_size:  # the scheduler allocates the next block of each group
                r["blocks"] += 1
                ids = tuple([self._next_block()] for _ in range(1 + self.d.mamba_groups))
                self.block_tables.append_block_ids(r["slot"], ids, overwrite=False)
                zero.append(ids[0][0])
        if zero:
            self.zero_block_ids(zero)
        with _device_pools(self.device):
            self.block_tables.apply_staged_writes()

    def _next_block(self) -> int:
        self.block_cursor = self.block_cursor % (NUM_BLOCKS - 1) + 1
        return self.block_cursor

    # model_runner.py prepare_inputs (no adaptive verification, no PCP, no LoRA)
    def prepare_inputs(self, st: dict):
        np, torch, d, dev = self.np, self.torch, self.d, self.device
        from vllm.v1.worker.gpu.input_batch import (combine_sampled_and_draft_tokens, expand_idx_mapping,
                                                   prepare_pos_seq_lens, prepare_prefill_inputs)

        # sort_batch_req_ids: verification / decode first, then prefill chunks
        rows = [(r, 1 + d.num_spec, d.num_spec) for r in st["decodes"]] + \
               [(r, r["chunk"], 0) for r in st["new"] if r not in st["decodes"]] + \
               [(r, r["chunk"], 0) for r in st["running"]]
        num_reqs = len(rows)
        num_scheduled = np.array([q for _, q, _ in rows], np.int32)
        num_drafts = np.array([k for _, _, k in rows], np.int32)
        idx_mapping_np = np.array([r["slot"] for r, _, _ in rows], np.intp)
        idx_mapping = torch.tensor(idx_mapping_np, dtype=torch.int64).to(dev)  # async_tensor_h2d
        num_tokens = int(num_scheduled.sum())
        has_prefill = bool(st["new"] or st["running"]) and any(q and not k for _, q, k in rows)
        graph = st["graph"]
        num_reqs_padded = graph if graph else num_reqs
        num_tokens_padded = graph * (1 + d.num_spec) if graph else _piecewise(num_tokens, d)
        draft_scheduled = bool(num_drafts.sum())
        if not draft_scheduled:
            num_logits = num_reqs
            cu_num_logits_np = np.arange(num_reqs + 1, dtype=np.int32)
            cu_num_logits = torch.arange(num_reqs + 1, device=dev, dtype=torch.int32)
            expanded_idx_mapping = idx_mapping
            expanded_local_pos = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
        else:
            logits_per_req = num_drafts + 1
            num_logits = int(logits_per_req.sum())
            cu_num_logits_np = np.zeros(num_reqs + 1, np.int32)
            np.cumsum(logits_per_req, out=cu_num_logits_np[1:])
            cu_num_logits = torch.tensor(cu_num_logits_np).to(dev)
        query_start_loc_np = np.empty(d.max_reqs + 1, np.int32)
        query_start_loc_np[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc_np[1:num_reqs + 1])
        query_start_loc_np[num_reqs + 1:] = num_tokens
        query_start_loc = self.input_buffers.query_start_loc
        query_start_loc.copy_(torch.tensor(query_start_loc_np).to(dev))
        if draft_scheduled:
            expanded_idx_mapping, expanded_local_pos = expand_idx_mapping(
                idx_mapping, num_logits, cu_num_logits, 1 + d.num_spec)
        query_start_loc = query_start_loc[:num_reqs_padded + 1]
        if has_prefill:
            prepare_prefill_inputs(self.input_buffers.input_ids, self.req_states.next_prefill_tokens, idx_mapping,
                                   query_start_loc, self.req_states.all_token_ids.gpu,
                                   self.req_states.prefill_len.gpu, self.req_states.num_computed_tokens.gpu)
        prepare_pos_seq_lens(idx_mapping, query_start_loc, self.req_states.num_computed_tokens.gpu,
                             self.input_buffers.positions, self.input_buffers.seq_lens)
        seq_lens = self.input_buffers.seq_lens[:num_reqs_padded]
        logits_indices = combine_sampled_and_draft_tokens(
            self.input_buffers.input_ids, idx_mapping, self.req_states.last_sampled_tokens, query_start_loc,
            seq_lens, self.req_states.prefill_len.gpu, self.req_states.draft_tokens, cu_num_logits, num_logits, 1)
        seq_upper = np.zeros(num_reqs_padded, np.int32)
        seq_upper[:num_reqs] = np.array([r["computed"] for r, _, _ in rows], np.int32) + num_scheduled
        return SimpleNamespace(
            num_reqs=num_reqs, num_reqs_after_padding=num_reqs_padded, idx_mapping=idx_mapping,
            idx_mapping_np=idx_mapping_np, expanded_idx_mapping=expanded_idx_mapping,
            expanded_local_pos=expanded_local_pos, num_scheduled_tokens=num_scheduled, num_tokens=num_tokens,
            num_tokens_after_padding=num_tokens_padded, num_draft_tokens=int(num_drafts.sum()),
            query_start_loc=query_start_loc, seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_upper,
            input_ids=self.input_buffers.input_ids[:num_tokens_padded],
            positions=self.input_buffers.positions[:num_tokens_padded], logits_indices=logits_indices,
            cu_num_logits=cu_num_logits, cu_num_logits_np=cu_num_logits_np, num_logits=num_logits, graph=graph)

    # model_runner.py prepare_attn
    def prepare_attn(self, b):
        block_tables = self.block_tables.gather_block_tables(
            b.idx_mapping, num_reqs_padded=b.num_reqs_after_padding,
            num_computed_tokens=self.req_states.num_computed_tokens.gpu)
        slot_mappings = self.block_tables.compute_slot_mappings(
            b.idx_mapping, b.query_start_loc, b.positions, num_tokens_padded=b.num_tokens_after_padding)
        return block_tables, slot_mappings

    # mamba_hybrid.py MambaHybridModelState.prepare_attn's align branch (the KDA builders take aligned indices:
    # GDNAttentionMetadataBuilder.mamba_aligned_state_indices); FULL graphs at the padded request count
    def aligned_state_indices(self, b) -> None:
        num_reqs = b.num_reqs_after_padding if b.graph else b.num_reqs
        self.model_state._mamba_ctx.compute_aligned_state_indices(b.seq_lens, num_reqs)

    # sample/sampler.py Sampler.__call__ / sample / apply_sampling_params / _sample_random (no top-k / top-p)
    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, input_ids, expanded_local_pos):
        from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
        from vllm.v1.worker.gpu.sample.min_p import apply_min_p
        from vllm.v1.worker.gpu.sample.penalties import apply_penalties

        np, torch = self.np, self.torch
        if not np.any(self.needs_processing[idx_mapping_np]):
            return logits
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        pen = self.penalties
        if np.any(pen.use_penalty[idx_mapping_np]):  # PenaltiesState.apply
            apply_penalties(logits, expanded_idx_mapping, input_ids, expanded_local_pos,
                            pen.repetition_penalty.gpu, pen.frequency_penalty.gpu, pen.presence_penalty.gpu,
                            pen.prompt_bin_mask, pen.output_bin_counts)
        temp = self.host_temperature[idx_mapping_np]
        if not np.all((temp == 0.0) | (temp == 1.0)):  # SamplingStates.apply_temperature
            apply_temperature(logits, expanded_idx_mapping, self.temperature.gpu)
        if not np.all(self.host_min_p[idx_mapping_np] == 0.0):  # SamplingStates.apply_min_p
            apply_min_p(logits, expanded_idx_mapping, self.min_p.gpu)
        return logits

    def sampler(self, logits, b):
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

        pos = b.positions[b.logits_indices]
        input_ids = b.input_ids[b.logits_indices]
        processed = self.apply_sampling_params(logits, b.expanded_idx_mapping, b.idx_mapping_np, input_ids,
                                               b.expanded_local_pos)
        sampled = gumbel_sample(processed, b.expanded_idx_mapping, self.temperature.gpu, self.seeds.gpu, pos,
                                apply_temperature=False, is_drafting=False, use_fp64=False)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            b.seq_lens.new_ones(b.num_reqs), b.seq_lens, b.cu_num_logits, b.idx_mapping,
            self.req_states.prefill_len.gpu)
        return sampled.view(-1, 1), num_sampled, num_rejected

    # spec_decode/rejection_sampler.py RejectionSampler.__call__ / _verify_in_chunks (one chunk) / _verify
    def rejection_sampler(self, logits, b):
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

        np = self.np
        draft_sampled, pos = gather_draft_sampled(b.input_ids, b.positions, b.logits_indices,
                                                  b.expanded_idx_mapping, b.expanded_local_pos,
                                                  self.req_states.prefill_len.gpu)
        lo, hi = 0, int(b.cu_num_logits_np[b.num_reqs])
        chunk_cu_num_logits = b.cu_num_logits[0:b.num_reqs + 1] - lo
        processed = self.apply_sampling_params(logits[lo:hi], b.expanded_idx_mapping[lo:hi], b.idx_mapping_np,
                                               draft_sampled[lo:hi], b.expanded_local_pos[lo:hi])
        sampled, num_sampled = rejection_sample(
            processed, None, draft_sampled[lo:hi], chunk_cu_num_logits, pos[lo:hi], b.idx_mapping[0:b.num_reqs],
            b.expanded_idx_mapping[lo:hi], b.expanded_local_pos[lo:hi], self.temperature.gpu, self.seeds.gpu,
            self.d.num_spec, None, use_fp64=False, use_block_verification=False, fly_window_size=0,
            skip_masked_vocab_blocks=bool(np.any(self.may_mask[b.idx_mapping_np])))
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, b.seq_lens, b.cu_num_logits, b.idx_mapping, self.req_states.prefill_len.gpu)
        return sampled, num_sampled, num_rejected

    # model_runner.py postprocess_sampled
    def postprocess_sampled(self, b, sampled, num_sampled, num_rejected) -> None:
        from vllm.v1.worker.gpu.input_batch import post_update

        post_update(b.idx_mapping, self.req_states.num_computed_tokens.gpu, self.req_states.last_sampled_tokens,
                    self.penalties.output_bin_counts, sampled, num_sampled, num_rejected, b.query_start_loc,
                    self.req_states.all_token_ids.gpu, self.req_states.total_len.gpu, None,
                    self.req_states.draft_tokens)
        self.model_state.postprocess_state(b.idx_mapping, num_sampled, self.req_states.num_computed_tokens.gpu)

    # spec_decode/target_dependent_ar/speculator.py TargetDependentARSpeculator.propose (MTP, greedy drafts)
    def propose(self, b, num_sampled, num_rejected) -> None:
        import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as tdar
        from vllm.v1.worker.gpu.sample.greedy_argmax import greedy_argmax

        torch, d, s = self.torch, self.d, self.drafter
        num_reqs = b.num_reqs
        # _copy_request_inputs
        s.temperature.copy_(self.temperature.gpu)
        s.seeds.copy_(self.seeds.gpu)
        s.idx_mapping[:num_reqs].copy_(b.idx_mapping)
        s.idx_mapping[num_reqs:].fill_(-1)
        tdar.prepare_prefill_inputs(s.last_token_indices, s.current_draft_step, s.input_buffers, b, num_sampled,
                                    num_rejected, self.req_states.last_sampled_tokens,
                                    self.req_states.next_prefill_tokens, d.max_reqs)
        # _prefill (eager / piecewise, or replayed from the FULL graph captured at the bucket's request count)
        rows = b.num_reqs_after_padding if b.graph else num_reqs
        draft_logits = torch.zeros(rows, d.vocab, dtype=torch.bfloat16, device=self.device)  # compute_logits
        s.draft_tokens[:rows, 0] = greedy_argmax(draft_logits)
        if d.num_spec <= 1:
            return
        # AutoRegressiveSpeculator._run_multi_step_decode: the draft decode graphs (FULL_DECODE_ONLY) at a bucket
        rows = next((g for g in d.buckets if g >= num_reqs), num_reqs) if b.graph else num_reqs
        ib = s.input_buffers
        tdar._prepare_decode_inputs_kernel[(rows + 1,)](  # TargetDependentARSpeculator._prepare_decode_inputs
            s.draft_tokens[:rows, 0], s.draft_tokens.stride(0), b.seq_lens, num_rejected, ib.input_ids,
            ib.positions, s.sample_src_positions, ib.query_start_loc, ib.seq_lens, d.max_model_len, d.max_reqs,
            BLOCK_SIZE=1024, ADVANCE_DRAFT_POSITIONS=True)
        for step in range(1, d.num_spec):  # _multi_step_decode / _fused_multi_step_decode
            self.block_tables.compute_slot_mappings(s.idx_mapping[:rows], ib.query_start_loc[:rows + 1],
                                                    ib.positions[:rows], rows)
            s.current_draft_step.fill_(step)
            # _decode: the draft model's forward (not driven) returns its hidden states; sample_draft's argmax
            hidden = torch.zeros(rows, d.hidden, dtype=torch.bfloat16, device=self.device)
            logits = torch.zeros(rows, d.vocab, dtype=torch.bfloat16, device=self.device)
            draft_tokens = greedy_argmax(logits)
            tdar.update_draft_inputs(draft_tokens, s.current_draft_step, hidden, s.draft_tokens, s.hidden_states,
                                     ib, s.sample_src_positions, rows, s.max_model_len_gpu, d.num_spec,
                                     advance_draft_positions=True)


def _piecewise(num_tokens: int, d: Deployment) -> int:
    """The token count a piecewise (breakable) graph pads a mixed batch to: the smallest capture size (tokens) at
    least ``num_tokens`` up to the largest, else eager (``CudaGraphManager`` dispatch)."""
    sizes = [b * (1 + d.num_spec) for b in d.buckets]
    return next((s for s in sizes if s >= num_tokens), num_tokens)
