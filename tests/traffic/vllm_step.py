"""Seeded steps of vLLM 0.34.0's V2 model runner around Kimi-Linear that ``tests/traffic/vllm_model.py`` does not
draw: the staged writes of the request state and the block tables, and the hybrid model state's mamba bookkeeping
under prefix caching (``mamba_cache_mode`` align). The independent traffic ``tests/test_vllm_step.py`` checks the
plan (``prewarm.providers.vllm.staged`` / ``.mamba``) against.

Written from vLLM's sources, never from the provider (which this module does not import):

- staged writes as ``GPUModelRunner`` makes them each step: ``RequestState.add_request`` (``states.py``) stages a new
  request's prompt, length and computed count, ``BlockTables.append_block_ids`` (``block_table.py``) its new blocks
  in every KV-cache group, then ``apply_staged_writes`` of both (``buffer_utils.py``: ``StagedWriteTensor.apply_write``,
  one launch per tensor; ``FusedStagedWriter.apply`` for the block tables' groups). vLLM stages through UVA views of
  pinned host buffers (its C op maps them into the device's address space); here a host buffer is a plain CPU array
  and its device view a tensor of the same dtype and length: the kernel gets a pointer either way;
- the KV-cache groups as vLLM's hybrid allocator makes them: ``_get_kv_cache_groups_uniform_page_size``
  (``v1/core/kv_cache_planning.py``) over one spec per layer of the model's config.json (MLA layers, KDA layers),
  the block table widths as ``GPUModelRunner.initialize_kv_cache`` computes them (``max_num_blocks_per_req``,
  ``get_block_table_width``);
- the MTP drafter as ``MTPSpeculator.propose`` runs it (``spec_decode/target_dependent_ar/speculator.py``, its
  autoregressive base's ``_run_multi_step_decode``): ``prepare_prefill_inputs`` on the target's input buffers and
  the drafter's own ``InputBuffers``, the draft logits (bf16, the model's head) sampled by ``greedy_argmax``
  (``draft_sample_method`` greedy, vLLM's default), then per further draft step ``_prepare_decode_inputs_kernel``
  (once) and ``update_draft_inputs`` on the draft model's hidden states (``[tokens, hidden]``, padded to the
  graph's size on a graph step);
- the sampler's logits processing as ``Sampler.apply_sampling_params`` runs it (the rejection sampler calls it on
  the verify step's rows too): an fp32 copy of the model's logits, then the penalties processor
  (``PenaltiesState``: a new request's ``bincount`` over the token history, ``apply_penalties``),
  ``SamplingStates.apply_temperature`` (a request whose temperature is neither 0 nor 1) and ``apply_min_p`` (a
  request with min-p), on the expanded ``idx_mapping`` (int64) and the sampling states' UVA-backed tables;
- the rejection sampler's draft gather as ``RejectionSampler.__call__`` makes it (``gather_draft_sampled``: the
  step's token ids and positions at its logits indices, int64, as ``combine_sampled_and_draft_tokens`` returns them;
  the expanded ``idx_mapping`` and local positions; the request state's ``prefill_len``);
- the mamba bookkeeping as ``MambaHybridModelState`` runs it (``model_states/mamba_hybrid.py``):
  ``preprocess_state`` (``preprocess_mamba_align_fused_kernel``, then ``MambaSpecDecodeGPUContext.run_fused_precopy``),
  ``prepare_attn`` (``compute_aligned_state_indices``: Kimi-Linear's KDA builder takes the precomputed indices),
  ``postprocess_state`` (``_scatter_num_accepted_kernel`` on the sampled counts, ``run_fused_postprocess_align``);
  the context made by ``MambaSpecDecodeGPUContext.create`` and ``initialize_from_forward_context`` over each KDA
  layer's bound states (conv state then recurrent state over one page per block).

Each step draws its request count (small ones often) and, for staged writes, each request's prompt length (so its
block count in every group).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import random
import types
from pathlib import Path
from typing import Iterator

from traffic import Call
from traffic.vllm_model import CAPTURE_SIZES

KINDS = ("staged", "mamba", "draft", "sampling", "verify")
CONFIG = Path(__file__).resolve().parents[1] / "fixtures/model-configs/kimi-linear-48b-a3b-instruct/config.json"


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded runner steps within ``spec``'s envelope."""
    steps = _Steps(spec, random.Random(seed), device)
    for i in range(n):
        yield steps.draw(i)


def kinds(spec: dict) -> list[str]:
    """The kinds :func:`calls` draws within ``spec``'s envelope."""
    return _Steps(spec, random.Random(0), "cpu").kinds


@contextlib.contextmanager
def host_views(device: str):
    """vLLM's ``UvaBuffer`` (pinned host memory mapped into the device, ``buffer_utils.py``) as a real CPU array
    (what ``stage_write`` fills) beside a device tensor of its size and dtype (what the kernel reads); a
    ``UvaBackedTensor``'s host copy (its source of truth, a numpy view) real too, under fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    bu = importlib.import_module("vllm.v1.worker.gpu.buffer_utils")
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    class HostView:
        def __init__(self, size, dtype):
            with unset_fake_temporarily():  # filled before it is read (the pools copy into it)
                self.cpu = torch.empty(size, dtype=dtype)
                self.np = self.cpu.numpy()
            with fake if fake is not None else contextlib.nullcontext():
                self._uva = torch.zeros(size, dtype=dtype, device=device)

        def uva(self, n=None):
            return self._uva[:n] if n is not None else self._uva

    backed = bu.UvaBackedTensor.__init__

    def backed_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            backed(self, *args, **kwargs)

    saved = bu.UvaBuffer, bu.is_uva_available
    bu.UvaBuffer, bu.is_uva_available, bu.UvaBackedTensor.__init__ = HostView, lambda: True, backed_init
    try:
        yield
    finally:
        (bu.UvaBuffer, bu.is_uva_available), bu.UvaBackedTensor.__init__ = saved, backed


class _Steps:
    def __init__(self, spec: dict, rng: random.Random, device: str):
        import torch

        self.torch, self.rng, self.device = torch, rng, device
        serving, vllm = spec.get("serving", {}), spec.get("vllm", {})
        self.dtype = getattr(torch, spec.get("dtypes", {}).get("activation", "bfloat16"))
        self.max_tokens = serving.get("max_prefill_tokens") or 8192
        self.max_reqs = serving.get("max_running_requests") or max(serving.get("decode_batch_buckets") or [1])
        widths = [w for w in serving.get("draft_widths", []) if w > 1]
        self.num_spec = max(widths) - 1 if widths else 0
        self.max_model_len, self.vocab = vllm["max_model_len"], vllm["vocab_size"]
        self.page = vllm["mamba_page_bytes"][0]
        self.conv_width = vllm.get("conv_kernel_size", 4)
        self.align = vllm.get("mamba_cache_mode", "align") == "align"
        model = spec["model"]
        self.heads, self.head_dim = model["kda_heads"], model["head_k_dim"]
        self.kinds = [k for k in KINDS if (k != "mamba" or self.align) and (k not in ("draft", "verify")
                                                                              or self.num_spec)]
        self.made = {}

    def draw(self, i: int) -> Call:
        rng = self.rng
        if i == 0:
            self.order = rng.sample(self.kinds, len(self.kinds))
        kind = self.order[i] if i < len(self.order) else rng.choice(self.kinds)  # each kind once, then at random
        small = min(9, self.max_reqs + 1)
        reqs = rng.randrange(1, self.max_reqs + 1) if rng.random() < 0.5 else rng.randrange(1, small)
        if kind == "staged":
            prompts = [rng.choice((rng.randrange(1, 64), rng.randrange(1, self.max_tokens + 1))) for _ in range(reqs)]
            return Call(f"step {i} staged requests={reqs}", lambda: self.staged_step(prompts),
                        {"kind": kind, "requests": reqs})
        if kind == "sampling":  # a step's rows: one logit per request, or each request's token and drafts (verify)
            rows = reqs * (1 + self.num_spec) if self.num_spec and rng.random() < 0.5 else reqs
            temperature = rng.random() < 0.8  # some request's temperature is neither 0 nor 1
            min_p = not temperature or rng.random() < 0.3
            penalties = rng.random() < 0.4  # some request's repetition / frequency / presence penalty
            return Call(f"step {i} sampling rows={rows} temperature={temperature} min_p={min_p} penalties={penalties}",
                        lambda: self.sampling_step(reqs, rows, temperature, min_p, penalties),
                        {"kind": kind, "rows": rows, "temperature": temperature, "min_p": min_p,
                         "penalties": penalties})
        if kind == "verify":  # each request verifies its own draft count (0 .. num_speculative_tokens)
            drafts = [rng.randrange(0, self.num_spec + 1) for _ in range(reqs)]
            return Call(f"step {i} verify requests={reqs} logits={reqs + sum(drafts)}",
                        lambda: self.verify_step(reqs + sum(drafts)),
                        {"kind": kind, "requests": reqs, "logits": reqs + sum(drafts)})
        if kind == "draft":
            graph = rng.random() < 0.5  # the draft decode replayed in a CUDA graph: its hidden states padded
            return Call(f"step {i} draft requests={reqs} graph={graph}", lambda: self.draft_step(reqs, graph),
                        {"kind": kind, "requests": reqs, "graph": graph})
        return Call(f"step {i} mamba requests={reqs}", lambda: self.mamba_step(reqs), {"kind": kind, "requests": reqs})

    # --- the KV-cache layout vLLM's allocator builds for the model --------------------------------------------------

    def kv_cache_config(self):
        """``KVCacheConfig`` with vLLM's own grouping of the model's layers (config.json: ``kda_layers`` KDA layers,
        the rest MLA), every page the padded mamba page (attention block = page / MLA bytes per token)."""
        if "kv" in self.made:
            return self.made["kv"]
        torch = self.torch
        ki = importlib.import_module("vllm.v1.kv_cache_interface")
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        registry = importlib.import_module("vllm.v1.attention.backends.registry")
        cfg = json.loads(CONFIG.read_text())
        kda_layers = len(cfg["linear_attn_config"]["kda_layers"])
        mla_layers = cfg["num_hidden_layers"] - kda_layers
        mla_per_token = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * self.dtype.itemsize
        block = self.page // mla_per_token
        conv_dim = 3 * self.heads * self.head_dim
        mamba = ki.MambaSpec(block_size=block, shapes=((self.conv_width - 1 + self.num_spec, conv_dim),
                                                       (self.heads, self.head_dim, self.head_dim)),
                             dtypes=(self.dtype, torch.float32), page_size_padded=self.page,
                             mamba_type=registry.MambaAttentionBackendEnum.GDN_ATTN,
                             mamba_cache_mode="align" if self.align else "none",
                             num_speculative_blocks=self.num_spec)
        mla = ki.MLAAttentionSpec(block_size=block, num_kv_heads=1,
                                  head_size=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], dtype=self.dtype)
        layers = {f"model.layers.{i}.self_attn": mla for i in range(mla_layers)}
        layers.update({f"model.layers.{i}.kda": mamba for i in range(kda_layers)})
        groups = planning._get_kv_cache_groups_uniform_page_size(layers)
        self.made["kv"] = ki.KVCacheConfig(num_blocks=self.max_reqs * 8, kv_cache_tensors=[], kv_cache_groups=groups)
        self.made["block"] = block
        return self.made["kv"]

    def block_tables(self):
        """``GPUModelRunner.initialize_kv_cache``'s ``BlockTables`` over the groups: each group's width from its
        spec."""
        if "bt" in self.made:
            return self.made["bt"]
        ki = importlib.import_module("vllm.v1.kv_cache_interface")
        bt = importlib.import_module("vllm.v1.worker.gpu.block_table")
        kv = self.kv_cache_config()
        config = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(mamba_cache_mode="align" if self.align else "none"),
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
        sizes, widths = [], []
        for g in kv.kv_cache_groups:
            s = g.kv_cache_spec
            sizes.append(s.block_size)
            widths.append(ki.get_block_table_width(s.max_num_blocks_per_req(config, self.max_model_len), s.block_size,
                                                   token_alignment=s.block_table_token_alignment))
        with host_views(self.device):
            self.made["bt"] = bt.BlockTables(sizes, self.max_reqs, self.max_tokens, widths,
                                             self.torch.device(self.device),
                                             slot_mapping_enabled=[g.kv_cache_spec.uses_slot_mapping
                                                                   for g in kv.kv_cache_groups])
        return self.made["bt"]

    def request_state(self):
        if "rs" not in self.made:
            states = importlib.import_module("vllm.v1.worker.gpu.states")
            with host_views(self.device):
                self.made["rs"] = states.RequestState(self.max_reqs, self.max_model_len, self.max_tokens,
                                                      self.num_spec, self.vocab, self.torch.device(self.device))
        return self.made["rs"]

    # --- GPUModelRunner.update_requests -> apply_staged_writes -----------------------------------------------------

    def staged_step(self, prompts: list[int]):
        rs, tables = self.request_state(), self.block_tables()
        with host_views(self.device):
            for r, prompt in enumerate(prompts):
                rs.add_request(f"req-{r}", prompt, list(range(prompt)), 0, 16)
                tables.append_block_ids(r, tuple([1] * -(-prompt // size) for size in tables.block_sizes),
                                        overwrite=True)
            rs.apply_staged_writes()
            tables.apply_staged_writes()
            for r in range(len(prompts)):
                rs.remove_request(f"req-{r}")

    # --- MambaHybridModelState: preprocess_state, prepare_attn, postprocess_state ----------------------------------

    def mamba_ctx(self):
        if "ctx" in self.made:
            return self.made["ctx"]
        torch = self.torch
        mu = importlib.import_module("vllm.v1.worker.mamba_utils")
        mamba_utils = importlib.import_module("vllm.model_executor.layers.mamba.mamba_utils")
        kv, tables = self.kv_cache_config(), self.block_tables()
        slots = 2  # every table entry here is block 0: two pages per layer keep a GPU run small
        forward_context = {}
        for g in kv.kv_cache_groups:
            s = g.kv_cache_spec
            if not isinstance(s, importlib.import_module("vllm.v1.kv_cache_interface").MambaSpec):
                continue
            for name in g.layer_names:  # each layer's states over its own pages (the runner's _reshape_kv_cache)
                raw = torch.zeros(slots * self.page, dtype=torch.uint8, device=self.device)
                (conv_shape, state_shape), (conv_dtype, state_dtype) = s.shapes, s.dtypes
                conv = raw.view(conv_dtype).as_strided((slots, *conv_shape),
                                                       (self.page // conv_dtype.itemsize, conv_shape[1], 1))
                conv_bytes = conv_dtype.itemsize * conv_shape[0] * conv_shape[1]
                state = raw.view(state_dtype).as_strided(
                    (slots, *state_shape), (self.page // state_dtype.itemsize, state_shape[1] * state_shape[2],
                                            state_shape[2], 1), conv_bytes // state_dtype.itemsize)
                forward_context[name] = types.SimpleNamespace(kv_cache=[conv, state])
        groups = mu.get_mamba_groups(kv)
        copy_funcs = {spec.mamba_type: mamba_utils.MambaStateCopyFuncCalculator.kda_state_copy_func()
                      for spec in groups}
        ctx = mu.MambaSpecDecodeGPUContext.create(max_num_reqs=self.max_reqs, kv_cache_config=kv,
                                                  copy_funcs=copy_funcs, forward_context=forward_context,
                                                  device=torch.device(self.device))
        ids = mu.get_mamba_group_ids(groups)
        ctx.initialize_from_forward_context(kv, forward_context, copy_funcs,
                                            [tables.block_tables[i].gpu for i in ids],
                                            [tables.input_block_tables[i] for i in ids])
        i32 = torch.int32
        z = lambda fill=0: torch.full((self.max_reqs,), fill, dtype=i32, device=self.device)  # noqa: E731
        self.made["ctx"] = ctx, dict(num_accepted=z(1), state_idx=z(), src_col=z(-1), src_off=z(),
                                     computed=z(), seq_lens=z()), groups
        return self.made["ctx"]

    def mamba_step(self, reqs: int):
        torch = self.torch
        mu = importlib.import_module("vllm.v1.worker.mamba_utils")
        mh = importlib.import_module("vllm.v1.worker.gpu.model_states.mamba_hybrid")
        ctx, b, groups = self.mamba_ctx()
        block = next(iter(groups)).block_size
        idx_mapping = torch.zeros(reqs, dtype=torch.int64, device=self.device)  # async_tensor_h2d(..., torch.int64)
        query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32, device=self.device)
        # preprocess_state
        mu.preprocess_mamba_align_fused_kernel[(-(-reqs // 256),)](
            idx_mapping, b["state_idx"], b["computed"], query_start_loc, b["num_accepted"], b["src_col"],
            b["src_off"], reqs, BLOCK_SIZE=256, MAMBA_BLOCK_SIZE=block)
        ctx.run_fused_precopy(reqs, b["state_idx"], b["src_col"], b["src_off"], idx_mapping)
        # prepare_attn: every KDA group's aligned state indices, for the builder
        ctx.compute_aligned_state_indices(b["seq_lens"], reqs)
        # postprocess_state: the sampler's counts (seq_lens.new_ones) or the rejection sampler's (new_empty int32)
        num_sampled = torch.zeros(reqs, dtype=torch.int32, device=self.device)
        mh._scatter_num_accepted_kernel[(reqs,)](idx_mapping, num_sampled, b["num_accepted"])
        ctx.run_fused_postprocess_align(reqs, b["num_accepted"], b["state_idx"], b["computed"], idx_mapping)

    # --- MTPSpeculator.propose --------------------------------------------------------------------------------------

    def draft_step(self, reqs: int, graph: bool):
        torch = self.torch
        ts = importlib.import_module("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator")
        ga = importlib.import_module("vllm.v1.worker.gpu.sample.greedy_argmax")
        ib = importlib.import_module("vllm.v1.worker.gpu.input_batch")
        R, S, dev = self.max_reqs, self.num_spec, self.device
        i32, i64 = torch.int32, torch.int64
        if "draft" not in self.made:
            hidden = json.loads(CONFIG.read_text())["hidden_size"]  # the MTP layer's width: the target's
            self.made["draft"] = dict(
                target=ib.InputBuffers(max_num_reqs=R, max_num_tokens=self.max_tokens, device=torch.device(dev)),
                draft=ib.InputBuffers(max_num_reqs=R, max_num_tokens=self.max_tokens, device=torch.device(dev)),
                last_token_indices=torch.zeros(R, dtype=i64, device=dev),
                current_draft_step=torch.tensor(0, dtype=i64, device=dev),
                draft_tokens=torch.zeros(R, S, dtype=i64, device=dev),
                hidden_states=torch.zeros(self.max_tokens, hidden, dtype=self.dtype, device=dev),
                sample_src_positions=torch.zeros(R, dtype=i64, device=dev),
                max_model_len_gpu=torch.tensor(self.max_model_len, dtype=i32, device=dev),
                last_sampled=torch.zeros(R, 1, dtype=i64, device=dev),
                next_prefill_tokens=torch.zeros(1, R, dtype=i32, device=dev), hidden=hidden)
        d = self.made["draft"]
        tokens = reqs * (1 + S)  # the verify step the drafts follow: each request's token and drafts
        t = d["target"]
        t.query_start_loc[:reqs + 1].copy_(torch.arange(0, tokens + 1, 1 + S, dtype=i32, device=dev))
        t.seq_lens[:reqs].fill_(1 + S)
        batch = types.SimpleNamespace(num_reqs=reqs, input_ids=t.input_ids[:tokens], positions=t.positions[:tokens],
                                      idx_mapping=torch.zeros(reqs, dtype=i64, device=dev),
                                      query_start_loc=t.query_start_loc[:reqs + 1], seq_lens=t.seq_lens[:reqs])
        num_sampled = torch.ones(reqs, dtype=i32, device=dev)
        num_rejected = torch.zeros(reqs, dtype=i32, device=dev)
        ts.prepare_prefill_inputs(d["last_token_indices"], d["current_draft_step"], d["draft"], batch, num_sampled,
                                  num_rejected, d["last_sampled"], d["next_prefill_tokens"], R)
        sampled = ga.greedy_argmax(torch.zeros(reqs, self.vocab, dtype=self.dtype, device=dev))  # _prefill
        if S <= 1:
            return
        ts._prepare_decode_inputs_kernel[(reqs + 1,)](
            d["draft_tokens"][:reqs, 0], d["draft_tokens"].stride(0), batch.seq_lens, num_rejected,
            d["draft"].input_ids, d["draft"].positions, d["sample_src_positions"], d["draft"].query_start_loc,
            d["draft"].seq_lens, self.max_model_len, R, BLOCK_SIZE=1024, ADVANCE_DRAFT_POSITIONS=True)
        padded = next((c for c in CAPTURE_SIZES if c >= reqs), reqs) if graph else reqs
        for step in range(1, S):  # _decode: the draft model's hidden states, its greedy sample, the next inputs
            d["current_draft_step"].fill_(step)
            hidden = torch.zeros(padded, d["hidden"], dtype=self.dtype, device=dev)
            sampled = ga.greedy_argmax(torch.zeros(reqs, self.vocab, dtype=self.dtype, device=dev))
            ts.update_draft_inputs(sampled, d["current_draft_step"], hidden, d["draft_tokens"], d["hidden_states"],
                                   d["draft"], d["sample_src_positions"], reqs, d["max_model_len_gpu"], S,
                                   advance_draft_positions=True)

    # --- Sampler.apply_sampling_params ------------------------------------------------------------------------------

    def sampling_step(self, reqs: int, rows: int, temperature: bool, min_p: bool, penalties: bool):
        torch = self.torch
        gumbel = importlib.import_module("vllm.v1.worker.gpu.sample.gumbel")
        mp = importlib.import_module("vllm.v1.worker.gpu.sample.min_p")
        pen = importlib.import_module("vllm.v1.worker.gpu.sample.penalties")
        R, V, dev, i32 = self.max_reqs, self.vocab, self.device, torch.int32
        logits = torch.zeros(rows, V, dtype=self.dtype, device=dev)  # compute_logits
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        expanded = torch.zeros(rows, dtype=torch.int64, device=dev)
        states = {n: torch.zeros(R, dtype=torch.float32, device=dev) for n in ("t", "min_p", "rep", "freq", "pres")}
        if penalties:  # PenaltiesState: a new request's bincount (apply_staged_writes), then apply on the logits
            if "penalties" not in self.made:
                self.made["penalties"] = (torch.zeros(R, -(-V // 32), dtype=i32, device=dev),
                                          torch.zeros(R, V, dtype=i32, device=dev),
                                          torch.zeros(R, self.max_model_len, dtype=i32, device=dev))
            prompt_mask, output_counts, all_token_ids = self.made["penalties"]
            lens = torch.ones(R, dtype=i32, device=dev)  # RequestState.prompt_len / prefill_len
            pen.bincount(torch.zeros(1, dtype=torch.int64, device=dev), all_token_ids, lens, lens, prompt_mask,
                         output_counts, 1)
            input_ids = torch.zeros(self.max_tokens, dtype=i32, device=dev)[:rows]  # InputBatch.input_ids
            local_pos = torch.zeros(rows, dtype=i32, device=dev)  # expanded_local_pos
            pen.apply_penalties(logits, expanded, input_ids, local_pos, states["rep"], states["freq"],
                                states["pres"], prompt_mask, output_counts)
        if temperature:
            gumbel.apply_temperature(logits, expanded, states["t"])
        if min_p:
            mp.apply_min_p(logits, expanded, states["min_p"])

    # --- RejectionSampler.__call__ ------------------------------------------------------------------------------------

    def verify_step(self, num_logits: int):
        torch = self.torch
        rs = importlib.import_module("vllm.v1.worker.gpu.spec_decode.rejection_sampler")
        dev, i32, i64 = self.device, torch.int32, torch.int64
        input_ids = torch.zeros(self.max_tokens, dtype=i32, device=dev)[:num_logits]  # InputBatch.input_ids
        positions = torch.zeros(self.max_tokens, dtype=i64, device=dev)[:num_logits]
        logits_indices = torch.zeros(num_logits, dtype=i64, device=dev)  # combine_sampled_and_draft_tokens'
        expanded_idx_mapping = torch.zeros(num_logits, dtype=i64, device=dev)  # expand_idx_mapping's
        expanded_local_pos = torch.zeros(num_logits, dtype=i32, device=dev)
        prefill_len = torch.zeros(self.max_reqs, dtype=i32, device=dev)  # RequestState.prefill_len (UVA-backed)
        rs.gather_draft_sampled(input_ids, positions, logits_indices, expanded_idx_mapping, expanded_local_pos,
                                prefill_len)
