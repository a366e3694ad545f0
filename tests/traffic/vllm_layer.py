"""Seeded server steps of vLLM 0.34.0's Kimi-Linear KDA layer (``KimiGatedDeltaNetAttention.forward``, the wheel's
file) within a manifest's envelope: the independent layer-level traffic the closure test (fake tensors) and
``bench/vllm_layer_traffic.py`` (an H200) run.

Written from vLLM's sources, never from the provider (``prewarm.providers.vllm.layer``, which this module does not
import):

- the layer is built as ``KimiLinearForCausalLM`` builds it (``KimiLinearConfig`` with the manifest's heads and head
  dim, conv kernel 4; a ``VllmConfig`` with the model dtype, ``num_speculative_tokens``, ``custom_ops``);
- its state is bound as the model runner binds a ``MambaSpec`` group: one raw byte page per block, the conv state
  ``(state_len, conv_dim)`` at the page's start and the fp32 recurrent state ``(h, V, K)`` right after it, block
  ``b`` at ``b * page`` (``kv_cache_interface.MambaSpec``: conv state first, each state dense in its page);
- the block table is the runner's ``[max_num_seqs, 1 + num_speculative_tokens]`` int32 table (``MambaSpec.
  max_num_blocks_per_req`` with cache mode none), rows in the scheduler's order (decodes before prefills);
- ``GDNAttentionMetadata`` is filled as ``GDNAttentionMetadataBuilder.build`` (``v1/attention/backends/gdn_attn.py``)
  fills it: first chunks without prior state are prefills; a batch with spec requests splits tokens with the argsort
  of the token mask, reclassifies plain decodes beside them as prefills, copies the spec rows of the block table;
  FULL-CUDA-graph decode and spec-only batches go through the builder's persistent buffers, padded to the capture
  size with null-block rows (``_stage_decode`` / ``_stage_spec_decode``); the conv metadata is
  ``compute_causal_conv1d_metadata``'s.

Each step draws: its make-up (prefill, chunked prefill with prefix state, decodes beside prefills, decode eager or
graph-padded, spec-only uniform or ragged, spec beside decodes or prefills), the request count (every count up to the
largest batch, as a seeded permutation, and small batches more often), odd lengths, which prefills have a prefix, the page size (the manifest's
list); each generator (a server) runs one of the manifest's ``custom_ops`` settings and one speculative width. The step kinds follow the manifest's ``[spec.vllm] paths`` and ``serving.prefill``. ``Call.options`` holds
what it drew.
"""
from __future__ import annotations

import importlib
import itertools
import random
from typing import Iterator

from prewarm.providers.capture import index_tensor
from traffic import Call, cycle

KINDS = ("prefill", "chunked", "mixed", "decode", "decode_graph", "spec", "spec_ragged", "spec+decode",
         "spec+prefill")
NAME = "model.layers.7.self_attn"


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded forward steps of the layer within ``spec``'s envelope."""
    steps = _Steps(spec, random.Random(seed), device)
    for i in range(n):
        yield steps.draw(i)


class _Steps:
    def __init__(self, spec: dict, rng: random.Random, device: str):
        import torch

        self.torch, self.rng, self.device = torch, rng, device
        model, serving, vllm = spec["model"], spec.get("serving", {}), spec.get("vllm", {})
        tp = spec.get("parallel", {}).get("tensor_parallel", 1) // spec.get("parallel", {}).get("attention_dp", 1)
        self.heads, self.tp, self.dim = model["kda_heads"], tp, model["head_k_dim"]
        self.dtype = getattr(torch, spec.get("dtypes", {}).get("activation", "bfloat16"))
        self.max_seqs = serving.get("max_running_requests") or max(serving.get("decode_batch_buckets") or [1])
        self.max_tokens = serving.get("max_prefill_tokens") or 8192
        self.capture = sorted(serving.get("decode_batch_buckets") or [])
        widths = [w for w in serving.get("draft_widths", []) if w > 1]
        self.num_spec = rng.choice(widths) - 1 if widths else 0
        self.pages = vllm.get("mamba_page_bytes")
        self.custom_ops = rng.choice(vllm.get("custom_ops", [["all"]]))  # the setting this server runs with
        paths = set(vllm.get("paths", ["prefill", "decode", "spec_verify"]))
        if not serving.get("prefill", True):
            paths.discard("prefill")
        needs = {"prefill": {"prefill"}, "chunked": {"prefill"}, "mixed": {"prefill", "decode"},
                 "decode": {"decode"}, "decode_graph": {"decode"}, "spec": {"spec_verify"},
                 "spec_ragged": {"spec_verify"}, "spec+decode": {"spec_verify"},
                 "spec+prefill": {"spec_verify", "prefill"}}
        self.kinds = [k for k in KINDS if needs[k] <= paths and (self.num_spec or not k.startswith("spec"))]
        self.counts = cycle(rng, range(1, self.max_seqs + 1))
        self.layers = {}
        self.configs = {}  # page -> the VllmConfig its layer was built with (the forward context holds it)

    # --- the layer as the model builds it, its state as the runner binds it --------------------------------------

    def layer(self, page: int | None):
        if page in self.layers:
            return self.layers[page]
        torch = self.torch
        import tempfile

        from vllm.config import (CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                 SpeculativeConfig, VllmConfig, set_current_vllm_config)
        from vllm.distributed import (init_distributed_environment, initialize_model_parallel,
                                      model_parallel_is_initialized)
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

        kda = importlib.import_module("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn")
        # one attention rank: its heads in a tensor-parallel group of one (the layer divides the heads by the width)
        config = KimiLinearConfig(hidden_size=2304, rms_norm_eps=1e-5, architectures=["KimiLinearForCausalLM"],
                                  linear_attn_config={"head_dim": self.dim, "num_heads": self.heads // self.tp,
                                                      "short_conv_kernel_size": 4, "kda_layers": [8],
                                                      "full_attn_layers": [4]})
        model_dir = tempfile.mkdtemp(prefix="vllm-layer-traffic-")  # a server reads its checkpoint's config.json
        config.save_pretrained(model_dir)
        mc = ModelConfig(model=model_dir, dtype=self.dtype, skip_tokenizer_init=True)
        pc = ParallelConfig()
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(), parallel_config=pc,
                        scheduler_config=SchedulerConfig(max_num_seqs=self.max_seqs, max_model_len=mc.max_model_len,
                                                         is_encoder_decoder=mc.is_encoder_decoder),
                        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=self.num_spec,
                                                             prompt_lookup_max=self.num_spec, prompt_lookup_min=1,
                                                             target_model_config=mc, target_parallel_config=pc)
                        if self.num_spec else None, compilation_config=CompilationConfig(custom_ops=self.custom_ops))
        if not model_parallel_is_initialized():
            with set_current_vllm_config(vc):
                init_distributed_environment(1, 0, f"file://{model_dir}/dist", 0, "gloo")
                initialize_model_parallel(1, backend="gloo")
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with set_current_vllm_config(vc), torch.device(self.device):
                layer = kda.KimiGatedDeltaNetAttention(config, vc, prefix=NAME)
        finally:
            torch.set_default_dtype(default)
        (conv_shape, rec_shape), (conv_dt, rec_dt) = layer.get_state_shape(), layer.get_state_dtype()
        conv_bytes = conv_dt.itemsize * conv_shape[0] * conv_shape[1]
        rec_bytes = rec_dt.itemsize * rec_shape[0] * rec_shape[1] * rec_shape[2]
        page_size = page or conv_bytes + rec_bytes
        blocks = self.max_seqs + 1  # block 0: the null block
        raw = torch.zeros(blocks, page_size, dtype=torch.int8, device=self.device)
        conv = torch.as_strided(raw.view(conv_dt), (blocks, *conv_shape),
                                (page_size // conv_dt.itemsize, conv_shape[1], 1))
        rec = torch.as_strided(raw.view(rec_dt), (blocks, *rec_shape),
                               (page_size // rec_dt.itemsize, rec_shape[1] * rec_shape[2], rec_shape[2], 1),
                               conv_bytes // rec_dt.itemsize)
        layer.kv_cache = (conv, rec)
        self.layers[page] = layer
        self.configs[page] = vc
        return layer

    # --- one step --------------------------------------------------------------------------------------------------

    def draw(self, i: int) -> Call:
        rng = self.rng
        kind = rng.choice(self.kinds)
        reqs = next(self.counts) if rng.random() < 0.7 else rng.randrange(1, min(8, self.max_seqs) + 1)
        W = 1 + self.num_spec
        odd = lambda top: rng.randrange(1, max(2, top)) | 1  # noqa: E731
        if kind in ("decode", "decode_graph"):
            q, ctx, spec = [1] * reqs, [rng.randrange(1, 4000) for _ in range(reqs)], [False] * reqs
        elif kind in ("spec", "spec_ragged"):
            q = [W if kind == "spec" else rng.randrange(1, W + 1) for _ in range(reqs)]
            ctx, spec = [rng.randrange(1, 4000) for _ in range(reqs)], [True] * reqs
        elif kind.startswith("spec+"):
            n_spec = rng.randrange(1, max(2, reqs))
            others = max(1, reqs - n_spec)
            budget = max(others, self.max_tokens - n_spec * W)
            other_q = [1] * others if kind == "spec+decode" else _lengths(rng, others, budget)
            q = [rng.choice((W, W, rng.randrange(1, W + 1))) for _ in range(n_spec)] + other_q
            ctx = [rng.randrange(1, 4000) for _ in range(n_spec)] + \
                  ([rng.randrange(1, 4000)] * others if kind == "spec+decode" else
                   [rng.choice((0, 0, rng.randrange(1, 4000))) for _ in range(others)])
            spec = [True] * n_spec + [False] * others
        else:  # prefill, chunked (a later chunk: prefix state), mixed (decodes first, then prefills)
            n_pre = rng.randrange(1, min(reqs, 16) + 1)
            n_dec = reqs - n_pre if kind == "mixed" else 0
            budget = max(n_pre, self.max_tokens - n_dec)
            q = [1] * n_dec + _lengths(rng, n_pre, budget)
            ctx = [rng.randrange(1, 4000) for _ in range(n_dec)] + \
                  [odd(3000) if kind == "chunked" or rng.random() < 0.3 else 0 for _ in range(n_pre)]
            spec = [False] * len(q)
        page = rng.choice(self.pages) if self.pages else None
        graph = kind in ("decode_graph", "spec") and rng.random() < 0.7
        options = {"kind": kind, "requests": len(q), "tokens": sum(q), "page": page, "graph": graph,
                   "prefix": sum(1 for c, s, x in zip(ctx, spec, q) if c and not s and x > 1)}

        def run(q=q, ctx=ctx, spec=spec, page=page, graph=graph):
            from vllm.forward_context import set_forward_context

            layer = self.layer(page)
            meta = self.metadata(q, ctx, spec, graph)
            torch = self.torch
            tokens = meta.num_actual_tokens
            hidden = torch.zeros(tokens, layer.hidden_size, dtype=self.dtype, device=self.device)
            with set_forward_context({NAME: meta}, self.configs[page], num_tokens=tokens):
                return layer.forward(hidden, torch.zeros(tokens, dtype=torch.int64, device=self.device))

        return Call(f"step {i} {kind} requests={len(q)} tokens={sum(q)} page={page} graph={graph}", run, options)

    def metadata(self, q: list, ctx: list, spec: list, graph: bool):
        """``GDNAttentionMetadataBuilder.build`` for one step (mamba cache mode none)."""
        torch, dev, i32 = self.torch, self.device, self.torch.int32
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

        W = 1 + self.num_spec
        n_spec = sum(spec) if self.num_spec else 0
        pad = 0
        if graph and not any(x > 1 for x, s in zip(q, spec) if not s):
            tokens_each = W if n_spec else 1
            bigger = [c for c in self.capture if c >= len(q) * tokens_each and c % tokens_each == 0]
            pad = (bigger[0] // tokens_each - len(q)) if bigger else 0
        reqs = len(q) + pad
        q_all = q + [0 if n_spec else 1] * pad  # padded rows: a spec graph pads requests, a decode graph tokens
        spec_all = spec + [False] * pad
        table = torch.zeros(self.max_seqs + pad, W, dtype=i32, device=dev)[:reqs]
        qsl = [0, *itertools.accumulate(q_all)]
        m = dict(num_actual_tokens=qsl[-1])
        if not n_spec:
            n_dec = sum(1 for x, c in zip(q_all, ctx + [1] * pad) if x == 1 and c > 0)
            first_pre = next((j for j, (x, c) in enumerate(zip(q, ctx)) if not (x == 1 and c > 0)), len(q))
            n_dec = first_pre if first_pre < len(q) else n_dec
            n_pre = len(q) - first_pre if first_pre < len(q) else 0
            m.update(num_decodes=n_dec, num_decode_tokens=n_dec, num_prefills=n_pre,
                     num_prefill_tokens=qsl[-1] - n_dec, num_spec_decodes=0, num_spec_decode_tokens=0)
            ns_state = table[:, 0]
            ns_qsl_values, ns_ctx = qsl, ctx
            ns_qsl = index_tensor(qsl, i32, dev)
            if graph and not n_pre:  # _stage_decode: the persistent buffers, null-block padding
                ns_state = torch.zeros(self.max_seqs * W + pad, dtype=i32, device=dev)[:reqs]
                ns_qsl = torch.zeros(self.max_seqs * W + pad + 1, dtype=i32, device=dev)[:reqs + 1]
            m.update(non_spec_state_indices_tensor=ns_state, non_spec_query_start_loc=ns_qsl)
        else:
            ns_q = [x for x, s in zip(q_all, spec_all) if not s]
            sp_q = [x for x, s in zip(q_all, spec_all) if s]
            n_dec = sum(1 for x in ns_q if x == 1)
            n_pre = len(ns_q) - n_dec - sum(1 for x in ns_q if x == 0)
            if n_dec:
                n_pre, n_dec = n_pre + n_dec, 0
            m.update(num_decodes=0, num_decode_tokens=0, num_prefills=n_pre, num_prefill_tokens=sum(ns_q),
                     num_spec_decodes=n_spec, num_spec_decode_tokens=sum(sp_q))
            ns_ctx = [c for c, s in zip(ctx, spec) if not s]
            if not n_pre:
                sp_state = table[:n_spec, :W]
                sp_qsl = index_tensor(qsl[:n_spec + 1], i32, dev)
                accepted = torch.ones(self.max_seqs, dtype=i32, device=dev)[:n_spec]
                if graph:  # _stage_spec_decode
                    sp_state = torch.zeros(self.max_seqs * W + pad, W, dtype=i32, device=dev)[:reqs]
                    sp_qsl = index_tensor(qsl + [qsl[-1]] * 0, i32, dev)
                    accepted = torch.ones(self.max_seqs * W + pad, dtype=i32, device=dev)[:reqs]
                m.update(spec_token_indx=torch.arange(sum(sp_q), dtype=i32, device=dev),
                         non_spec_token_indx=torch.empty(0, dtype=i32, device=dev),
                         spec_state_indices_tensor=sp_state, non_spec_state_indices_tensor=None,
                         spec_query_start_loc=sp_qsl, non_spec_query_start_loc=None, num_accepted_tokens=accepted)
                ns_qsl_values = None
            else:
                order = sorted(range(qsl[-1]), key=lambda t: spec_all[_owner(qsl, t)])  # argsort, stable
                n_ns = sum(ns_q)
                ns_qsl_values = [0, *itertools.accumulate(ns_q)]
                m.update(non_spec_token_indx=torch.tensor(order[:n_ns], dtype=torch.int64, device=dev),
                         spec_token_indx=torch.tensor(order[n_ns:], dtype=torch.int64, device=dev),
                         spec_state_indices_tensor=torch.zeros(n_spec, W, dtype=i32, device=dev),
                         non_spec_state_indices_tensor=torch.zeros(len(ns_q), dtype=i32, device=dev),
                         spec_query_start_loc=index_tensor([0, *itertools.accumulate(sp_q)], i32, dev),
                         non_spec_query_start_loc=index_tensor(ns_qsl_values, i32, dev),
                         num_accepted_tokens=torch.ones(n_spec, dtype=i32, device=dev))
            m["spec_sequence_masks"] = torch.tensor(spec_all, dtype=torch.bool, device=dev)
        if m["num_prefills"]:
            lens = [b - a for a, b in zip(ns_qsl_values, ns_qsl_values[1:])]
            m["has_initial_state"] = torch.tensor([c > 0 for c in ns_ctx][:len(lens)] +
                                                  [False] * (len(lens) - len(ns_ctx)), dtype=torch.bool,
                                                  device=dev)
            # compute_causal_conv1d_metadata (v1/attention/backends/utils.py), BLOCK_M 8: the programs of each
            # sequence, which sequence and which chunk of it each program takes (host tables), the device tables
            programs = [-(-n // 8) for n in lens]
            size = max(1024, sum(programs)) * 2
            owner = [j for j, k in enumerate(programs) for _ in range(k)]
            chunk = [c for k in programs for c in range(k)]
            batch_ptr = torch.full((size,), -1, dtype=i32, device=dev)
            offset_ptr = torch.full((size,), -1, dtype=i32, device=dev)
            m.update(nums_dict={8: {"nums": torch.tensor(programs), "tot": sum(programs),
                                    "mlist": torch.tensor(owner, dtype=torch.int64), "mlist_len": len(owner),
                                    "offsetlist": torch.tensor(chunk, dtype=i32), "batch_ptr": batch_ptr,
                                    "token_chunk_offset_ptr": offset_ptr}},
                     batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)
        return GDNAttentionMetadata(**m)


def _owner(qsl: list, token: int) -> int:
    return next(j for j in range(len(qsl) - 1) if qsl[j] <= token < qsl[j + 1])


def _lengths(rng: random.Random, n: int, budget: int) -> list[int]:
    """``n`` prompt lengths within ``budget`` tokens: short, odd, long (the whole budget when alone)."""
    if n == 1 and rng.random() < 0.25:
        return [budget]
    each = max(1, budget // n)
    return [rng.choice((1, 2, rng.randrange(1, each + 1), rng.randrange(1, each + 1) | 1)) for _ in range(n)]
