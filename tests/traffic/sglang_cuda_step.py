"""Seeded, server-like steps of Kimi-Linear on sglang 0.5.23's CUDA path around its KDA and MoE layers (EAGLE, FA3
for the MLA layers on Hopper): the independent model-level traffic ``tests/test_sglang_model_step.py`` checks the
plan of ``prewarm.providers.sglang.cuda`` (its ``runner``, ``mla``, ``spec_worker`` and JIT components) against, on
fake tensors under the real Triton key computation. (The KDA layer is ``traffic.sglang_layer``'s, the MoE and logits
``traffic.sglang_cuda_model``'s.)

Written from sglang's scheduler, model runner, FA3 backend, DeepSeek MLA code, EAGLE v2 worker and its graph runners
(``/tmp/sgl/sglang`` is the wheel unpacked), never from the provider. Each kernel is reached through the function its
server caller calls (sglang's own entry point), with the arguments that caller builds; where the caller itself
cannot run here (it needs the serving stack: a ForwardBatch, a ScheduleBatch, a model runner), its lines of argument
building are transcribed below, each naming its file and function.

The deployment: every launch line runs EAGLE (``--speculative-num-draft-tokens`` = the manifest's ``draft_widths``;
a chain is ``--speculative-eagle-topk 1`` with ``num_steps = width - 1``, a tree (``eagle_tree``) topk 2),
``--page-size 1`` (sglang's default), the MLA layers on FA3 (``model_override_base``: MLA on Hopper -> "fa3"),
the context length Kimi-Linear's config gives (``get_context_length``: ``model_max_length``). One step (one
``Call``) is drawn on its own:

- ``extend``: a prefill batch of new / radix-prefixed / chunk-continuing requests packed up to the chunk. The
  scheduler writes ``req_to_token`` (``mem_cache/allocation.py`` ``write_cache_indices``:
  ``write_req_to_token_pool_triton``, the row length a constexpr: context + ``4 + width``,
  ``allocation_sizing.get_req_to_token_extra_context_len``); one MLA layer (``attention_backend_handler``
  ``_handle_attention_backend``): no prefix or >= ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD`` prefix tokens -> MHA
  one-shot (``forward_mha.py``: the latent's KV store ``set_mla_kv_buffer`` with ``kv_a`` normed and ``k_pe`` a
  column view of the latent, the cached prefix read back with ``get_mla_kv_buffer`` where there is one, then
  ``_concat_and_cast_mha_k``: ``concat_and_cast_mha_k_triton``: 32 heads, 128 + 64, powers of two); otherwise the
  absorbed MLA path (``forward_mla.py``: ``set_mla_kv_buffer`` of the normed ``k_nope`` and ``k_pe``; on Hopper
  sglang's JIT module); the dense layer's, the shared experts' and the routed experts' ``silu_and_mul``
  (``layers/activation.py``, ``fused_moe.py``: sglang's JIT where the width fits); a constrained request's
  grammar mask on the sampler's logits (xgrammar's ``apply_vocab_mask`` on CUDA:
  ``apply_token_bitmask_inplace_triton``); the MoE router (``layers/moe/topk.py`` ``biased_grouped_topk_gpu``:
  ``moe_fused_gate``).
- ``spec``: one EAGLE v2 decode step of a batch (1..``--max-running-requests``; up to the largest
  ``--cuda-graph-bs`` bucket the draft, verify and draft-extend graphs replay, padded to the bucket; above it,
  eager). The scheduler's ``alloc_for_spec_decode`` -> ``assign_req_to_token_pool_func`` (int32 current / next KV
  lengths); the overlap scheduler's gather of the previous step's draft extras (``overlap_utils``
  ``FutureMap._resolve_spec_extras``: ``gather_spec_extras``); the draft (``eagle_worker_common.prepare_for_draft``:
  ``assign_draft_cache_locs_contiguous_func``, a chain's whole window as the target translator plans it, positions
  for topk 1; per draft step the topk-1 argmax ``draft_topk1_postprocess`` over the fp32 logits; under the draft
  graph, ``FlashAttentionMultiStepBackend``'s per-step FA3 replay metadata ``normal_decode_set_metadata`` with
  ``SEQ_LEN_DELTA`` = the step + 1); the verify input (``build_chain_tree`` for a chain, from the relay's int64
  bonus tokens); the target verify (FA3's graph replay metadata with the draft width as delta; a tree's
  ``build_trtllm_mha_page_table`` for the prefix half; the MLA KV store of bucket x width tokens, eager: batch x
  width, and the MoE router over the same tokens); ``eagle_sample`` (a grammar's vocab mask over the verify's rows;
  all greedy: sglang's JIT ``verify_tree_greedy``, any request sampled: its JIT
  ``tree_speculative_sampling_target_only``);
  ``prepare_verify_commit_outputs`` (the radix cache's track interval); the draft extend (a tree's
  ``prepare_draft_extend_inputs``; ``prepare_draft_extend_layout``; under the draft-extend graph, captured per
  bucket, FA3's ``draft_extend_set_metadata``).

Values are valid for a real run (slots inside the pools, request rows inside ``req_to_token``, token ids inside the
vocab), so the same calls run on a GPU. Not driven here (named for the reader and the lead): the EAGLE draft
model's own layers; a tree's ``build_tree_kernel_efficient`` (sgl-kernel's ahead-of-time CUDA op); a sampled
verify's top-k / top-p renorm (FlashInfer's sampling module); penalties (``apply_scaling_penalties`` is
``torch.compile``d: Inductor's own Triton kernels); the target translator's KV plans; MHA chunked-KV prefill (a
batch over ``SGLANG_MAX_KV_CHUNK_CAPACITY`` = 128K tokens) and the one-shot prefix index gather; the sampler past
the grammar mask (on Hopper its softmax is torch's, its samplers FlashInfer's, ``layers/sampler.py``); the RMSNorms
(``layers/layernorm.py`` ``forward_cuda``: sgl-kernel's ``rmsnorm`` / ``fused_add_rmsnorm``, which hand over to
FlashInfer's norm, not to sglang's JIT, where ``cast_x_before_out_mul`` is off).
"""
from __future__ import annotations

import contextlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prewarm.providers.sglang.common import read_spec
from traffic import Call, cycle, short

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "model-configs" / "kimi-linear-48b-a3b-instruct" / \
    "config.json"
CHUNKED_PREFIX_CACHE_THRESHOLD = 8192  # environ.py: SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD
MAX_KV_CHUNK_CAPACITY = 128 * 1024  # environ.py: SGLANG_MAX_KV_CHUNK_CAPACITY (MHA one-shot above: chunked)
KV_POOL_TOKENS = 1 << 16  # the MLA pool's token slots here (a live pool's size follows the GPU memory: not a key)
MAX_SEQ = 4096  # the KV lengths drawn (positions inside req_to_token; a real run's values, not keys)
TREE_TOPK = 2  # --speculative-eagle-topk of a tree launch line
TRACK_GRID = math.lcm(64, 1, 256)  # runtime_context.mamba_track_grid: mamba chunk, page 1, --mamba-track-interval


@dataclass(frozen=True)
class Model:
    """Kimi-Linear's widths (the fixture's config.json) and the deployment's knobs (the manifest's spec)."""

    hidden: int
    heads: int
    nope: int
    rope: int
    v_head: int
    kv_lora: int
    dense_inter: int
    shared_inter: int
    moe_inter: int
    topk: int
    experts: int
    renormalize: bool
    scaling: float
    vocab: int
    context_len: int
    max_running: int
    chunk: int
    buckets: tuple
    widths: tuple
    tree: bool
    track: bool

    @classmethod
    def of(cls, spec: dict) -> "Model":
        c, s = json.loads(CONFIG.read_text()), read_spec(spec)
        tp = (spec.get("parallel") or {}).get("tensor_parallel", 1)
        context = next(c[k] for k in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                                      "max_position_embeddings") if c.get(k) is not None)
        return cls(hidden=c["hidden_size"], heads=c["num_attention_heads"] // tp, nope=c["qk_nope_head_dim"],
                   rope=c["qk_rope_head_dim"], v_head=c["v_head_dim"], kv_lora=c["kv_lora_rank"],
                   dense_inter=c["intermediate_size"] // tp,
                   shared_inter=c["moe_intermediate_size"] * c["num_shared_experts"] // tp,
                   moe_inter=c["moe_intermediate_size"] // tp, topk=c["num_experts_per_token"],
                   experts=c["num_experts"], renormalize=c["moe_renormalize"], scaling=c["routed_scaling_factor"],
                   vocab=c["vocab_size"],
                   context_len=context, max_running=s.max_batch, chunk=s.max_prefill_tokens,
                   buckets=tuple(sorted(s.graph_buckets)), widths=tuple(s.draft_widths), tree=s.eagle_tree,
                   track=s.track_state)

    def row(self, width: int) -> int:
        """``req_to_token``'s row: the context + ``get_req_to_token_extra_context_len()`` (page 1: 4 + the draft
        tokens)."""
        return self.context_len + 4 + width


def import_kernels() -> None:
    """Imports every sglang module the steps reach, before ``fake_device`` (module-level device probes)."""
    import sglang.kernels.ops.activation.activation  # noqa: F401
    import sglang.kernels.ops.attention.metadata  # noqa: F401
    import sglang.kernels.ops.attention.mla_qk_prep  # noqa: F401
    import sglang.kernels.ops.attention.trtllm_mha_page_table  # noqa: F401
    import sglang.kernels.ops.grammar.bitmask_ops  # noqa: F401
    import sglang.kernels.ops.kvcache.mla_buffer  # noqa: F401
    import sglang.kernels.ops.kvcache.set_mla_kv_buffer  # noqa: F401
    import sglang.kernels.ops.memory.common  # noqa: F401
    import sglang.kernels.ops.moe.moe_fused_gate  # noqa: F401
    import sglang.kernels.ops.speculative.cache_locs  # noqa: F401
    import sglang.kernels.ops.speculative.eagle  # noqa: F401
    import sglang.kernels.ops.speculative.gather_spec_extras  # noqa: F401
    import sglang.kernels.ops.speculative.sampling  # noqa: F401
    import sglang.kernels.ops.speculative.topk1  # noqa: F401
    import sglang.kernels.ops.speculative.tree  # noqa: F401
    import sglang.srt.mem_cache.allocation  # noqa: F401


@contextlib.contextmanager
def eager_custom_ops(module) -> Iterator[None]:
    """Within the block ``module``'s sglang custom ops (``srt/utils/custom_op.py``: ``register_custom_op``'s eager
    entry, ``_call_directly_in_eager``) call their own function, as that entry does for plain CUDA tensors in a
    server's eager forward (a graph capture records the same call); on fake tensors it would hand the call to the
    dispatcher, whose fake implementation never reaches the JIT module."""
    wrapped = {name: fn for name, fn in vars(module).items() if hasattr(fn, "__wrapped__")
               and getattr(getattr(fn, "__code__", None), "co_filename", "").endswith("custom_op.py")}
    for name, fn in wrapped.items():
        setattr(module, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in wrapped.items():
            setattr(module, name, fn)


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded steps within ``spec``'s envelope, tensors on ``device`` (drawn when made, run when called)."""
    traffic = _Traffic(Model.of(spec), random.Random(seed), device)
    for i in range(n):
        yield traffic.draw(i)


def kinds(spec: dict) -> list[str]:
    """The kinds of step :func:`calls` draws within ``spec``'s envelope (a call's ``kind``): ``extend``, and an
    EAGLE step per verify shape (a chain; a tree where the launch line runs one) replayed from the graphs (a batch
    up to the largest ``--cuda-graph-bs`` bucket) or eager (a batch above it)."""
    m = Model.of(spec)
    top = m.buckets[-1] if m.buckets else 0
    return ["extend"] + [_spec_kind(topk, graph) for topk in ((1, TREE_TOPK) if m.tree else (1,))
                         for graph in (True, False) if (graph and top) or (not graph and m.max_running > top)]


def _spec_kind(topk: int, graph: bool) -> str:
    return f"spec_{'tree' if topk > 1 else 'chain'}_{'graph' if graph else 'eager'}"


class _Traffic:
    def __init__(self, m: Model, rng: random.Random, device: str):
        self.m, self.rng, self.device = m, rng, device
        self.modes = cycle(rng, ["extend", "spec", "spec"])
        self.batches = cycle(rng, range(1, m.max_running + 1))
        self.shapes = cycle(rng, [(w, topk) for w in m.widths for topk in ((1, TREE_TOPK) if m.tree else (1,))])
        self.prefixes = cycle(rng, ["fresh", "radix", "chunked", "mixed", "long"])
        self.grammars = cycle(rng, [False, True])
        self.greedy = cycle(rng, [True, False])
        self.tables: dict = {}  # width -> req_to_token (one kept: a GPU run holds one)
        self.kv = self.graph_buffers = None
        self.relays: dict = {}

    # ---------------------------------------------------------------- draws

    def draw(self, i: int) -> Call:
        mode, rng, m = next(self.modes), self.rng, self.m
        d: dict = {"mode": mode}
        d["width"], d["topk"] = next(self.shapes)
        if mode == "extend":
            d["prefix"] = next(self.prefixes)
            # a long cached prefix (MHA one-shot with its read-back) fits the one-shot capacity in a few requests
            n = rng.randint(1, min(3 if d["prefix"] == "long" else 16, m.max_running))
            budget = m.chunk
            extend, prefix = [], []
            for j in range(n):
                cached = {"fresh": 0, "radix": rng.randint(1, 3000), "chunked": rng.randint(1, 4) * 997,
                          "mixed": rng.choice([0, rng.randint(1, 5000)]),
                          "long": rng.randint(CHUNKED_PREFIX_CACHE_THRESHOLD, 3 * CHUNKED_PREFIX_CACHE_THRESHOLD)
                          }[d["prefix"]]
                new = max(1, min(budget - (n - j - 1), int(2 ** rng.uniform(0, math.log2(max(2, budget))))))
                extend.append(new)
                prefix.append(cached)
                budget -= new
                if budget <= n - j - 1:
                    break
            d["extend"], d["prefix_lens"] = extend, prefix
        else:
            bs = next(self.batches)
            d["batch"] = bs
            top = m.buckets[-1] if m.buckets else 0
            d["bucket"] = next((b for b in m.buckets if b >= bs), None) if bs <= top else None
            d["seq_lens"] = [rng.randint(1, MAX_SEQ) for _ in range(bs)]
            d["greedy"] = next(self.greedy)  # all greedy, or any request sampled (temperature > 0)
        d["kind"] = mode if mode == "extend" else _spec_kind(d["topk"], d["bucket"] is not None)
        d["grammar"] = next(self.grammars)  # any constrained request in the batch (xgrammar, the default)
        label = f"{mode}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k not in ("mode", "kind")) + "]"
        return Call(label, lambda: self.step(d), d)

    def step(self, d: dict) -> None:
        if d["mode"] == "extend":
            self.extend(d)
        else:
            self.spec(d)

    # ---------------------------------------------------------------- tensors

    def torch(self):
        import torch

        return torch

    def ids(self, values, dtype: str):
        """A host-known index tensor (sglang's host code and a GPU run read its values)."""
        from prewarm.providers.capture import index_tensor

        return index_tensor(list(values), getattr(self.torch(), dtype), self.device)

    def req_to_token(self, width: int):
        """``ReqToTokenPool.req_to_token``: int32 ``[max_running + 1, row]`` (row 0 is the graphs' padding row)."""
        torch = self.torch()
        if width not in self.tables:
            self.tables.clear()
            self.tables[width] = torch.zeros((self.m.max_running + 1, self.m.row(width)), dtype=torch.int32,
                                             device=self.device)
        return self.tables[width]

    def relay(self, name: str, shape: tuple, dtype):
        """The overlap scheduler's FutureMap relay buffers (made once per shape)."""
        key = (name, shape)
        if key not in self.relays:
            self.relays = {k: v for k, v in self.relays.items() if k[0] != name}
            self.relays[key] = self.torch().zeros(shape, dtype=dtype, device=self.device)
        return self.relays[key]

    def kv_buffer(self):
        """``MLATokenToKVPool.kv_buffer[layer]``: ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``."""
        torch = self.torch()
        if self.kv is None:
            self.kv = torch.zeros((KV_POOL_TOKENS + 1, 1, self.m.kv_lora + self.m.rope), dtype=torch.bfloat16,
                                  device=self.device)
        return self.kv

    def locs(self, n: int):
        """``out_cache_loc``: int64 token slots the allocator hands out (slot 0 is the padding slot)."""
        start = self.rng.randint(1, KV_POOL_TOKENS - n)
        return self.ids(range(start, start + n), "int64")

    # ---------------------------------------------------------------- extend

    def extend(self, d: dict) -> None:
        torch, m = self.torch(), self.m
        extend, prefix = d["extend"], d["prefix_lens"]
        bs, T = len(extend), sum(extend)
        seq = [p + e for p, e in zip(prefix, extend)]
        rows = self.rng.sample(range(1, m.max_running + 1), bs)
        out_cache_loc = self.locs(T)
        self.write_cache_indices(d["width"], rows, prefix, seq, extend, out_cache_loc)
        self.mla_extend(T, prefix, seq, out_cache_loc)
        self.router(T)
        self.mlp(T)
        if d["grammar"]:  # the sampler: one row per request (the logits processor's last-token rows)
            self.grammar(bs)

    def write_cache_indices(self, width, rows, prefix, seq, extend, out_cache_loc) -> None:
        """allocation.alloc_for_extend -> write_cache_indices: int64 host lengths moved to the device, the
        prefixes' KV indices (``req.prefix_indices``, int64) by pointer."""
        from types import SimpleNamespace

        from sglang.srt.mem_cache import allocation

        torch = self.torch()
        pool = SimpleNamespace(req_to_token=self.req_to_token(width), device=self.device)
        prefix_tensors = [self.ids(range(1, p + 1), "int64") for p in prefix]  # slots the radix tree holds
        cpu = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        saved = allocation.attention_backends, allocation.is_pin_memory_available
        allocation.attention_backends = lambda: ("fa3", "fa3")  # the runtime context a server publishes
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(out_cache_loc):  # fake tensors, no driver: pinning needs one (where the host-side pointer table
            allocation.is_pin_memory_available = lambda device=None: False  # stays is not in a key)
        try:
            allocation.write_cache_indices(
                out_cache_loc, self.ids(rows, "int64"), cpu(rows), self.ids(prefix, "int64"), cpu(prefix),
                self.ids(seq, "int64"), cpu(seq), self.ids(extend, "int64"), cpu(extend), prefix_tensors, pool)
        finally:
            allocation.attention_backends, allocation.is_pin_memory_available = saved

    def mla_extend(self, T: int, prefix: list, seq: list, out_cache_loc) -> None:
        """One MLA layer's prefill (forward_mha.py / forward_mla.py, FA3), its Triton and JIT launches."""
        from sglang.kernels.ops.attention.mla_qk_prep import concat_and_cast_mha_k_triton
        from sglang.kernels.ops.kvcache.mla_buffer import get_mla_kv_buffer_triton, set_mla_kv_buffer_triton

        torch, m = self.torch(), self.m
        bf16 = torch.bfloat16
        # kv_a_proj_with_mqa's output [T, kv_lora + rope]; kv_a its normed first columns (RMSNorm: a new tensor)
        latent = torch.empty((T, m.kv_lora + m.rope), dtype=bf16, device=self.device)
        kv_a = torch.empty((T, m.kv_lora), dtype=bf16, device=self.device)
        k_pe = latent.unsqueeze(1)[:, :, m.kv_lora:]
        prefix_sum = sum(prefix)
        mha = prefix_sum == 0 or prefix_sum >= CHUNKED_PREFIX_CACHE_THRESHOLD
        if not mha:  # forward_absorb_prepare: k_nope = kv_a_layernorm(latent[..., :kv_lora]).unsqueeze(1)
            set_mla_kv_buffer_triton(self.kv_buffer(), out_cache_loc, kv_a.unsqueeze(1), k_pe)
            return
        if sum(seq) > MAX_KV_CHUNK_CAPACITY:
            return  # MHA chunked KV: not driven (see the module's docstring)
        # forward_normal_prepare: the latent's KV store, then (a prefix) the whole KV read back from the pool
        set_mla_kv_buffer_triton(self.kv_buffer(), out_cache_loc, kv_a.unsqueeze(1), k_pe)
        rows = T
        if prefix_sum:
            rows = sum(seq)
            kv_indices = self.ids([1 + (j % (KV_POOL_TOKENS - 1)) for j in range(rows)], "int32")
            nope = torch.empty((rows, 1, m.kv_lora), dtype=bf16, device=self.device)
            k_pe = torch.empty((rows, 1, m.rope), dtype=bf16, device=self.device)
            get_mla_kv_buffer_triton(self.kv_buffer(), kv_indices, nope, k_pe)
        # kv_b_proj(kv_a) viewed [rows, heads, nope + v]; k_nope its first columns
        kv = torch.empty((rows, m.heads * (m.nope + m.v_head)), dtype=bf16, device=self.device)
        k_nope = kv.view(-1, m.heads, m.nope + m.v_head)[..., :m.nope]
        k = k_nope.new_empty(rows, m.heads, m.nope + m.rope)
        concat_and_cast_mha_k_triton(k, k_nope, k_pe)

    def router(self, T: int) -> None:
        """KimiMoE's TopK (grouped, a correction bias) -> select_experts -> biased_grouped_topk_gpu on CUDA: not
        FlashInfer's fused_topk_deepseek (it wants ``topk_group * num_expert_group >= topk``: 1 x 1 < 8), not
        the grouped fallback (one group), not the JIT gate's 384 / > 512 experts / top > 8 shapes: the ungrouped
        sigmoid branch, ``moe_fused_gate`` over the bf16 router logits as they are and the bias upcast to fp32, the
        routed scaling factor not applied on the output (the Triton runner does not fuse it into top-k)."""
        from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate

        torch, m = self.torch(), self.m
        logits = torch.empty((T, m.experts), dtype=torch.bfloat16, device=self.device)  # the bf16 gate's output
        bias = torch.zeros((m.experts,), dtype=torch.bfloat16, device=self.device)  # e_score_correction_bias
        moe_fused_gate(logits, bias.to(torch.float32), m.topk, scoring_func="sigmoid", renormalize=m.renormalize,
                       routed_scaling_factor=m.scaling, apply_routed_scaling_factor_on_output=False)

    def mlp(self, T: int) -> None:
        """The dense layer's MLP, the shared experts (LlamaMLP: SiluAndMul.forward_cuda -> activation.silu_and_mul,
        sglang's JIT where ``_jit_act_supported``) and the routed experts' activation (fused_moe.py: bf16, no
        clamp: ``silu_and_mul(intermediate_cache1.view(-1, N), intermediate_cache2)``)."""
        from sglang.kernels.ops.activation import activation

        torch = self.torch()
        shapes = [(T, self.m.dense_inter), (T, self.m.shared_inter), (T * self.m.topk, self.m.moe_inter)]
        with eager_custom_ops(activation):
            for rows, inter in shapes:
                gate_up = torch.empty((rows, 2 * inter), dtype=torch.bfloat16, device=self.device)
                out = gate_up.new_empty(rows, inter)
                if out.shape[-1] % (16 // out.dtype.itemsize) == 0:  # activation._jit_act_supported on sm_90
                    activation.silu_and_mul(gate_up, out)

    def grammar(self, rows: int) -> None:
        """A constrained request's vocab mask on the sampler's fp32 logits (SamplingBatchInfo's apply_mask_func;
        under EAGLE the verify's GrammarMask over every draft row): XGrammarGrammar.apply_vocab_mask on CUDA
        (not ROCm) -> apply_token_bitmask_inplace_triton with xgrammar's int32 bitmask ``[rows, ceil(vocab / 32)]``."""
        from sglang.kernels.ops.grammar.bitmask_ops import apply_token_bitmask_inplace_triton

        torch = self.torch()
        logits = torch.empty((rows, self.m.vocab), dtype=torch.float32, device=self.device)
        bitmask = torch.full((rows, (self.m.vocab + 31) // 32), -1, dtype=torch.int32, device=self.device)
        apply_token_bitmask_inplace_triton(logits, bitmask)

    # ---------------------------------------------------------------- one EAGLE decode step

    def spec(self, d: dict) -> None:
        torch, m = self.torch(), self.m
        width, topk, bs, bucket = d["width"], d["topk"], d["batch"], d["bucket"]
        steps = width - 1
        rows = self.rng.sample(range(1, m.max_running + 1), bs)
        seq = d["seq_lens"]
        req_to_token = self.req_to_token(width)
        req_pool_indices, seq_lens = self.ids(rows, "int64"), self.ids(seq, "int64")

        # scheduler: eagle_utils.prepare_for_decode -> alloc_for_spec_decode (page 1, int32 KV lengths)
        from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

        reserve = topk * steps + width  # the next step's window past the committed lengths
        cur, nxt = seq, [s + reserve for s in seq]
        assign_req_to_token_pool_func(req_pool_indices, req_to_token, self.ids(cur, "int32"),
                                      self.ids(nxt, "int32"), self.locs(bs * reserve), bs)

        # the overlap scheduler: FutureMap._resolve_spec_extras gathers the previous step's draft extras by the
        # batch's future indices (its req_pool_indices) from the relay buffers _maybe_init_forward_bufs sized from
        # the first payload: topk_p fp32 [pool, topk], topk_index int64 [pool, topk], output tokens int64 [pool],
        # the draft's hidden states (EAGLE relays them: spec_need_hidden_states) [pool, hidden] bf16
        from sglang.kernels.ops.speculative.gather_spec_extras import gather_spec_extras

        pool = m.max_running + 1
        _, _, bonus, _ = gather_spec_extras(req_pool_indices, self.relay("topk_p", (pool, topk), torch.float32),
                           self.relay("topk_index", (pool, topk), torch.int64),
                           self.relay("tokens", (pool,), torch.int64),
                           self.relay("hidden", (pool, m.hidden), torch.bfloat16))

        # the graphs' static buffers (runner_utils/buffers.py: int64 req_pool_indices / seq_lens), padded rows 0
        g_rows = bucket or bs
        g_indices = self.ids(rows + [0] * (g_rows - bs), "int64")
        g_seq = self.ids(seq + [1] * (g_rows - bs), "int64")

        # draft: eagle_worker_common.prepare_for_draft (the target translator plans a chain's whole window)
        from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous_func

        window = width if topk == 1 and width > steps else steps
        out_cache_loc = torch.empty((bs * topk * window,), dtype=torch.int64, device=self.device)
        positions = torch.empty_like(seq_lens) if topk == 1 else None
        assign_draft_cache_locs_contiguous_func(req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk,
                                                window, positions=positions, mrope=None)
        if bucket:  # the draft graph's replay: per draft step backend (speculative_step_id i), FA3 topk <= 1
            if topk == 1:
                for step in range(steps - 1):
                    self.decode_metadata(g_indices, g_seq, step + 1, width)
        draft_tokens = None
        if topk == 1:  # eagle_worker_v2.draft_forward: the chain's columns from draft_topk1_postprocess
            from sglang.kernels.ops.speculative.topk1 import draft_topk1_postprocess

            draft_tokens = torch.empty((bs, steps), dtype=torch.int64, device=self.device)
            pos = torch.empty((bs,), dtype=torch.int64, device=self.device)
            for i in range(steps - 1):
                logits = torch.empty((bs, m.vocab), dtype=torch.float32, device=self.device)
                draft_topk1_postprocess(logits, pos, draft_tokens, i + 1)
            # eagle_worker_common: the verify input of a chain
            from sglang.kernels.ops.speculative.eagle import build_chain_tree

            mask = torch.zeros((m.buckets[-1] * width * width,), dtype=torch.bool, device=self.device) \
                if bucket else None
            # the draft input's bonus tokens: the relay's int64 ones the overlap scheduler gathered
            build_chain_tree(bonus, draft_tokens, seq_lens, mask, req_pool_indices=req_pool_indices,
                             req_to_token=req_to_token, with_mrope=False)

        # target verify: FA3's graph replay metadata (topk <= 1: the fused decode metadata, the draft width past
        # seq_lens; a tree: the prefix half's page table, build_trtllm_mha_page_table) and the MLA layer's KV store
        if bucket and topk == 1:
            self.decode_metadata(g_indices, g_seq, width, width)
        elif bucket:
            from sglang.kernels.ops.attention.trtllm_mha_page_table import build_trtllm_mha_page_table

            cache_seqlens, _, _, page_table = self.graph_metadata(g_rows)
            build_trtllm_mha_page_table(req_to_token=req_to_token, req_pool_indices=g_indices,
                                        cache_seqlens=cache_seqlens, page_table=page_table, page_size=1)
        from sglang.kernels.ops.kvcache.mla_buffer import set_mla_kv_buffer_triton

        T = g_rows * width
        latent = torch.empty((T, m.kv_lora + m.rope), dtype=torch.bfloat16, device=self.device)
        k_nope = torch.empty((T, m.kv_lora), dtype=torch.bfloat16, device=self.device).unsqueeze(1)
        set_mla_kv_buffer_triton(self.kv_buffer(), self.locs(T), k_nope, latent[..., m.kv_lora:].unsqueeze(1))
        self.router(T)

        # eagle_sample: the grammar mask over the verify's rows, then greedy or sampled acceptance
        if d["grammar"]:
            self.grammar(bs * width)
        predict, accept_index, accept_lens = self.verify(bs, width, steps, d["greedy"])

        # eagle_worker_common: the fused commit of the verify's outputs
        from sglang.kernels.ops.speculative.eagle import prepare_verify_commit_outputs

        if topk == 1:
            # the radix cache's extra buffer (track_state) gives every batch its track indices: the interval is
            # runtime_context.mamba_track_grid(1) = lcm(mamba chunk 64, page 1, --mamba-track-interval 256)
            prepare_verify_commit_outputs(predict, accept_index, accept_lens, seq_lens, num_draft_tokens=width,
                                          mamba_track_interval=TRACK_GRID if m.track else 0)
        else:
            prepare_verify_commit_outputs(predict, accept_index, accept_lens, seq_lens)
            from sglang.kernels.ops.speculative.eagle import prepare_draft_extend_inputs

            prepare_draft_extend_inputs(accept_lens, predict, width)

        # draft extend: eagle_worker_common.prepare_for_draft_extend (fused lengths and positions)
        from sglang.kernels.ops.speculative.eagle import prepare_draft_extend_layout

        prepare_draft_extend_layout(seq_lens, width, False)
        if bucket:  # the draft-extend graph, captured per bucket: FA3's in-graph metadata (no SWA)
            self.draft_extend_metadata(g_indices, g_seq, g_rows, width)

    def verify(self, bs: int, width: int, steps: int, greedy: bool):
        """eagle_utils.eagle_sample: int32 predict / accept tables, int64 candidates and retrieve tables
        (EagleVerifyInput); all greedy: argmax target predictions (int64) into ``verify_tree_greedy_func`` (on CUDA
        sglang's JIT ``verify_tree_greedy``); else (no rejection sampling: the default) the fp32 target
        probabilities ``[bs, width, vocab]``, zero draft probabilities, fp32 coins into
        ``tree_speculative_sampling_target_only`` (verify_sampling.py on CUDA: sglang's JIT, deterministic)."""
        torch, dev = self.torch(), self.device
        predict = torch.zeros((bs * width,), dtype=torch.int32, device=dev)
        accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32, device=dev)
        num_correct = torch.ones((bs,), dtype=torch.int32, device=dev)
        candidates = torch.zeros((bs * width,), dtype=torch.int64, device=dev).reshape(bs, width)
        # a chain-shaped tree's retrieve tables (index, next token, next sibling), as build_chain_tree fills them
        cols = torch.arange(width, dtype=torch.int64, device=dev).repeat(bs)
        retrieve = torch.stack([torch.arange(bs * width, dtype=torch.int64, device=dev),
                                torch.where(cols + 1 < width, cols + 1, -1),
                                torch.full((bs * width,), -1, dtype=torch.int64, device=dev)]).view(3, bs, width)
        tables = dict(predicts=predict, accept_index=accept_index, accept_token_num=num_correct,
                      candidates=candidates, retrive_index=retrieve[0], retrive_next_token=retrieve[1],
                      retrive_next_sibling=retrieve[2])
        if greedy:
            from sglang.kernels.ops.speculative.tree import verify_tree_greedy

            target = torch.zeros((bs * width,), dtype=torch.int64, device=dev).reshape(bs, width)  # argmax
            verify_tree_greedy(**tables, target_predict=target)
        else:
            from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only

            target_probs = torch.full((bs * width, self.m.vocab), 1.0 / self.m.vocab, dtype=torch.float32,
                                      device=dev).reshape(bs, width, -1)
            coins = torch.rand((bs, width), dtype=torch.float32, device=dev)
            final = torch.rand((bs,), dtype=torch.float32, device=dev)
            tree_speculative_sampling_target_only(
                **tables, uniform_samples=coins, uniform_samples_for_final_sampling=final,
                target_probs=target_probs, draft_probs=torch.zeros_like(target_probs), threshold_single=1.0,
                threshold_acc=1.0, deterministic=True)
        # the verify kernels count the correct drafts; eagle_sample returns accept_lens = num_correct_drafts + 1 (the
        # bonus token), which the commit reads as a column count (accept_index[row, accept_lens - 1])
        return predict, accept_index, num_correct + 1

    def graph_metadata(self, rows: int):
        """FA3's ``init_cuda_graph_state`` buffers for the largest bucket (made once, as the backend does), sliced to
        ``rows`` as ``_bind_metadata_buffers`` does."""
        torch, m = self.torch(), self.m
        if self.graph_buffers is None:
            max_bs, pages = m.buckets[-1], m.context_len  # page 1: max_num_pages = max_context_len
            self.graph_buffers = (torch.zeros(max_bs, dtype=torch.int32, device=self.device),
                                  torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                                  torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                                  torch.zeros(max_bs, pages, dtype=torch.int32, device=self.device))
        cache_seqlens, cu_k, cu_q, page_table = self.graph_buffers
        return cache_seqlens[:rows], cu_k[:rows + 1], cu_q[:rows + 1], page_table[:rows]

    def decode_metadata(self, req_pool_indices, seq_lens, delta: int, width: int) -> None:
        """FA3 ``_apply_cuda_graph_metadata`` -> ``_set_decode_page_metadata`` (no SWA, reads untranslated)."""
        from sglang.kernels.ops.attention.metadata import normal_decode_set_metadata

        rows = req_pool_indices.shape[0]
        cache_seqlens, cu_k, _, page_table = self.graph_metadata(rows)
        normal_decode_set_metadata(cache_seqlens, cu_k, page_table, self.req_to_token(width), req_pool_indices,
                                   self.m.context_len, seq_lens, delta, 1, None, full_to_swa_index_mapping=None,
                                   skip_page_table=False)

    def draft_extend_metadata(self, req_pool_indices, seq_lens, rows: int, width: int) -> None:
        """FA3 ``init_forward_metadata_in_graph`` for DRAFT_EXTEND_V2 (the draft-extend runner's int32
        extend_seq_lens)."""
        from sglang.kernels.ops.attention.metadata import draft_extend_set_metadata

        torch = self.torch()
        cache_seqlens, cu_k, cu_q, page_table = self.graph_metadata(rows)
        extend_seq_lens = torch.full((self.m.buckets[-1],), width, dtype=torch.int32, device=self.device)[:rows]
        draft_extend_set_metadata(cache_seqlens_int32=cache_seqlens, cu_seqlens_k=cu_k, cu_seqlens_q=cu_q,
                                  page_table=page_table, req_to_token=self.req_to_token(width),
                                  req_pool_indices=req_pool_indices[:rows], seq_lens=seq_lens[:rows],
                                  extend_seq_lens=extend_seq_lens, page_size=1)
