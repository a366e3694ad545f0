"""Seeded, server-like steps of Kimi K3 on sglang 0.5.23's Ascend path, around and between its KDA layers: the
independent traffic that ``tests/ascend/test_sglang_ascend_model.py`` checks the plan of
``manifests/kimi-k3-ascend-a3-sglang.toml`` against, by keys. (The KDA layer itself is ``traffic.sglang_ascend``'s.)

Written from sglang's scheduler, model runner, model and DSPARK worker sources (``/tmp/sgl/sglang`` is the wheel
unpacked) and sgl-kernel-npu's, never from the provider. Each kernel is reached through the function its server
caller calls (sglang's or sgl-kernel-npu's own entry point, imported from the wheel's bytes), with the arguments that
caller builds; where the caller itself cannot import here (it imports the serving stack), its few lines of argument
building are transcribed below, each naming its file and function. As on a node, torch_npu's ``transfer_to_npu``
makes ``Tensor.is_cuda`` answer ``is_npu`` (:func:`transfer_to_npu`), so sglang's ``x.is_cuda`` / ``inputs_on_cuda``
dispatches take their Triton kernels.

One rank of the report's deployment (TP 64, DP 4 with DP attention: attention TP 16, DeepEP over EP 64, W4A8 int
routed experts, DSPARK), K3's widths from ``tests/fixtures/model-configs/kimi-k3-shaped/config.json`` (hidden 7168,
dense intermediate 33792, 896 experts of 3072 with 2 shared, vocab 163840, RMSNorm eps) and the facts that config
lacks, from sglang's K3 code: SiTU beta 4.0 / linear beta 25.0 (``kimi_k3.py``: MegaMoE asserts every K3 checkpoint
carries them), at most 8 attention-residual snapshots (``attn_residual.py``: ``_MAX_ROWS = next_pow2(8 + 1)``).
The deployment's own knobs come from the manifest's ``[spec]`` (``serving``: max_running_requests,
max_prefill_tokens, draft_widths, decode_batch_buckets = ``--cuda-graph-bs``; ``parallel``).

Per step (one ``Call``), drawn on its own: the forward mode (extend: fresh, with a radix prefix, a chunked
prefill's next chunk or a mix; decode; DSPARK verify; DSPARK draft; idle: this DP rank has no tokens while its peers
run), the batch and token counts over the deployment's whole range (a decode or verify batch up to the largest
``--cuda-graph-bs`` bucket replays its graph, padded to the next bucket; above it, eager), the DP rank and its
peers' token counts, each request's sampling (greedy, temperature only, top-k / top-p; the verify's accept path),
the draft width, the Markov head's dtype. Each categorical draw is a seeded cycle (every value before any repeats),
so a few dozen steps of any seed reach every mode, accept path and dispatch. What runs:

- scheduler (``mem_cache/allocation.py``): an extend allocates its KV pages through the NPU allocator
  (``hardware_backend/npu/allocator_npu.py``: sgl-kernel-npu's ``alloc_extend_kernel`` below 200 new pages; int64
  prefix / seq lengths and last locations; ``free_pages`` a view past the pages already handed out) and writes
  ``req_to_token`` (``write_cache_indices``: ``write_req_to_token_pool_triton``, whose row stride is a constexpr:
  the model's context length + ``get_req_to_token_extra_context_len()``); a DSPARK decode step that crosses its
  page reservation allocates through the same kernel from ``alloc_for_spec_decode`` (the draft input's int32
  current / next KV lengths, ``get_last_loc_torch``'s int32 last locations) and writes ``req_to_token`` with
  ``assign_req_to_token_pool`` (its row length and ``next_power_of_2(batch)`` constexprs);
- model runner: extend positions (``forward_batch_info.compute_position``: ``compute_position_triton`` over int32
  prefix and extend lengths; ``support_triton("ascend")`` holds on NPU);
- model (``kimi_k3.py``): the attention-residual mix before each attention and FFN read (``attn_residual._mix_fused``
  -> sgl-kernel-npu's ``mix_fused``: bf16 prefix ``[T, H]``, the bank ``[T, 8, H]``, fp32 ``cw``, 1..8 valid
  snapshots), and once more for DSPARK's aux capture (``aggregate_stream``); the dense layer's MLP on the full TP
  group (``_dense_mlp_parallel_group``: ``enable_dense_mlp_attn_tp`` is off by default), its rows gathered over
  the DP ranks and scattered back (under ``DpPaddingMode.SUM_LEN``: ``dp_attention._dp_gather_via_all_reduce`` /
  ``dp_scatter``'s ``memcpy_triton`` with 0-d int64 views of ``global_num_tokens`` and its cumsum as offsets),
  its SiTU ``SituAndMul.forward_npu`` -> ``situ_and_mul(x)`` (``[rows, 2 * 33792 / 64]``); the shared experts'
  SiTU (DeepEP replicates them: ``[T, 2 * 6144]``); the routed experts' grouped SiTU with int8 requant
  (``moe_runner/ascend.py``, DeepEP, W4A8 int: ``NPUSitu(need_quant=True)`` over ``[rows, 2 * 3072]``, the 14 local
  experts' int64 counts, group_list_type 1);
- logits processor (``logits_processor.py``): a graph replay's bf16 logits cast into the graph's fp32 logits
  buffer (``cast_to_float32_logits``);
- DSPARK worker (``dspark_verify.py``, ``dspark_draft.py``): the verify's accept (all greedy: ``AcceptGreedy``;
  any sampled: ``AcceptSampling`` with its temperature softmax or top-k/top-p target probabilities, sgl-kernel-npu's
  chain rejection sampling and the bonus gather, plus ``AcceptGreedy`` and ``SelectMixedAccept`` where greedy and
  sampled requests share the batch; a ragged verify's cutoff lengths through ``CapCorrectLen``), then
  ``FinalizeAcceptLens``; the draft's Markov step per draft position (``MarkovSampleStep``: greedy drafts argmax,
  sampled drafts keep their step logits; bf16 base logits, the step dtype promoted with the head's), the draft
  probabilities of a sampled verify (``SoftmaxTemp`` over those step logits).

Not driven here (each named, for the reader and the lead): the KDA layer (``traffic.sglang_ascend`` drives it);
MLA (read, no Triton found: K3 sets ``_disable_npu_fused_split_qk_norm``, its MLA is NoPE, the rest CANN ops);
the sampler after a prefill (``layers/sampler.py``: its softmax is torch's on NPU, the cake kernel needing
``torch.version.cuda``; its sampling backends not read through); the DSPARK draft model's own layers;
``MarkovGreedyStep`` (a one-row greedy draft whose head exposes its w2 weight); vocab-sharded Markov heads; the MoE
router (K3's grouped top-k with a correction bias is ``npu_moe_gating_top_k``, a CANN op).

Run the calls inside ``common.fake_device("npu")`` and :func:`transfer_to_npu`, after :func:`import_kernels`.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prewarm.providers.capture import index_tensor

from . import Call, cycle, short

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "model-configs" / "kimi-k3-shaped" / "config.json"
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # kimi_k3.py: K3 checkpoints carry (activation_situ_beta, _linear_beta)
MAX_SNAPSHOTS = 8  # attn_residual.py: _MAX_ROWS = 16 = next_pow2(8 + 1), "K3 has <= 8 snapshots"
PAGE_SIZE = 128  # hardware_backend/npu/utils.py: sglang's NPU default --page-size
NPU_ALLOC_KERNEL_PAGES = 200  # allocator_npu.py: alloc_extend takes the Triton kernel below this many new pages
MODES = ("extend", "decode", "verify", "draft", "idle")
DRAFT_NOISE_DOMAIN = 0x2D2A9C317E44B1F3  # dspark_draft.py: draft_noise_key(random_seed) xors the seed with it


def import_kernels() -> None:
    """Imports every kernel module the steps reach, before ``fake_device``."""
    import sgl_kernel_npu.activation.situ  # noqa: F401
    import sgl_kernel_npu.kimi_k3.attn_residual  # noqa: F401
    import sgl_kernel_npu.mem_cache.allocator  # noqa: F401
    import sgl_kernel_npu.sample  # noqa: F401
    import sglang.kernels.ops.activation.softcap  # noqa: F401
    import sglang.kernels.ops.attention.position  # noqa: F401
    import sglang.kernels.ops.memory.common  # noqa: F401
    import sglang.kernels.ops.memory.memcpy_triton  # noqa: F401
    import sglang.kernels.ops.speculative.dflash  # noqa: F401
    import sglang.kernels.ops.speculative.dspark.dspark_accept  # noqa: F401
    import sglang.kernels.ops.speculative.dspark.markov_sample  # noqa: F401
    import sglang.srt.mem_cache.allocation  # noqa: F401


@contextlib.contextmanager
def transfer_to_npu() -> Iterator[None]:
    """``torch_npu.contrib.transfer_to_npu``'s ``torch.Tensor.is_cuda = torch.Tensor.is_npu``, as every sglang NPU
    worker process runs it: a tensor on the NPU says it is a CUDA tensor."""
    import torch

    original = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: self.device.type == "npu")
    try:
        yield
    finally:
        torch.Tensor.is_cuda = original


@dataclass(frozen=True)
class Rank:
    """One attention rank of the deployment: K3's widths at its rank-local shapes, and the server's knobs."""

    hidden: int
    dense_cols: int  # the dense MLP's gate|up columns on this rank (full-TP sharding)
    shared_cols: int  # the shared experts' gate|up columns (replicated under DeepEP)
    routed_cols: int  # one routed expert's gate|up columns (whole experts under EP)
    local_experts: int
    top_k: int
    vocab: int
    eps: float
    context_len: int
    dp: int
    max_running: int
    max_prefill_tokens: int
    graph_buckets: tuple
    draft_widths: tuple

    @classmethod
    def of(cls, spec: dict) -> "Rank":
        text = json.loads(CONFIG.read_text())["text_config"]
        serving, parallel = spec.get("serving", {}), spec.get("parallel", {})
        tp = parallel.get("tensor_parallel", 1)
        experts = text["num_experts"]
        return cls(hidden=text["hidden_size"], dense_cols=2 * text["intermediate_size"] // tp,
                   shared_cols=2 * text["moe_intermediate_size"] * text["num_shared_experts"],
                   routed_cols=2 * text["moe_intermediate_size"], local_experts=experts // tp,
                   top_k=text["num_experts_per_token"], vocab=text["vocab_size"], eps=text["rms_norm_eps"],
                   context_len=text["max_position_embeddings"], dp=parallel.get("attention_dp", 1),
                   max_running=serving["max_running_requests"], max_prefill_tokens=serving["max_prefill_tokens"],
                   graph_buckets=tuple(sorted(serving.get("decode_batch_buckets", ()))),
                   draft_widths=tuple(serving.get("draft_widths", ())))

    def req_to_token_row(self, width: int) -> int:
        """``req_to_token``'s row length: the context length + ``get_req_to_token_extra_context_len()`` (DSPARK,
        topk 1: ``max(4 + width, 2 * get_alloc_len_per_decode() + page_size - 1)``, the alloc length being the
        draft width)."""
        return self.context_len + max(4 + width, 2 * width + PAGE_SIZE - 1)


def calls(spec: dict, seed: int, count: int) -> Iterator[Call]:
    """``count`` seeded steps of one rank of the deployment ``spec`` describes (drawn when made, run when called)."""
    traffic = _Traffic(Rank.of(spec), random.Random(seed))
    for i in range(count):
        yield traffic.draw(i)


class _Traffic:
    """The seeded draws: each categorical choice a seeded cycle (every value before any repeats, so a few dozen steps
    of any seed reach every mode, accept path and dispatch), sizes drawn over their whole range."""

    def __init__(self, rank: Rank, rng: random.Random):
        self.rank, self.rng = rank, rng
        top = max(rank.graph_buckets, default=0)
        self.modes = cycle(rng, MODES)
        # graph replays: batches up to the largest --cuda-graph-bs bucket, padded to the next bucket; eager above it
        self.replays = {m: cycle(rng, [True, False] if top < rank.max_running else [True])
                        for m in ("decode", "verify")}
        self.batches = {True: cycle(rng, range(1, top + 1)), False: cycle(rng, range(top + 1, rank.max_running + 1)),
                        "draft": cycle(rng, range(1, rank.max_running + 1))}
        # the verify's accept: all greedy, all temperature-only, top-k / top-p, greedy and sampled mixed; with or
        # without a ragged verify's cutoff lengths
        self.accepts = cycle(rng, [(a, c) for a in ("greedy", "temperature", "top_k_top_p", "mixed")
                                   for c in (False, True)])
        self.drafts = cycle(rng, ["greedy", "sampled"])
        self.prefixes = cycle(rng, ["fresh", "radix", "chunked", "mixed"])
        self.crossings = cycle(rng, [False, True])  # a DSPARK step allocating new pages (alloc_for_spec_decode)
        self.markov = cycle(rng, ["bfloat16", "float32"])  # the DSPARK Markov head's weights (markov_w1 / w2)
        self.snapshots = cycle(rng, range(1, MAX_SNAPSHOTS + 1))
        self.idle_peers = cycle(rng, [True, False])

    def draw(self, i: int) -> Call:
        r, rng = self.rank, self.rng
        mode = next(self.modes)
        d: dict = {"mode": mode, "width": rng.choice(r.draft_widths), "dp_rank": rng.randrange(r.dp)}
        if mode == "extend":
            seqs = rng.randint(1, r.max_running)
            total = max(seqs, min(r.max_prefill_tokens, int(2 ** rng.uniform(0, math.log2(r.max_prefill_tokens + 1)))))
            cuts = sorted(rng.sample(range(1, total), seqs - 1))
            d["lengths"] = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            # a fresh request, a radix-cache hit, a chunked prefill's next chunk (the request holds its row)
            kind = next(self.prefixes)
            d["prefix"] = [_prefix(rng, rng.choice(["fresh", "radix", "chunked"]) if kind == "mixed" else kind,
                                   r.max_prefill_tokens) for _ in range(seqs)]
            d["handed_out"] = rng.randrange(0, 4096)  # pages the allocator handed out before (free_pages' offset)
            d["tokens"] = total
        elif mode == "idle":
            d["tokens"] = 0
            d["peers_extend"] = next(self.idle_peers)  # whether a peer's batch is an extend (is_extend_in_batch)
        else:
            replay = next(self.replays[mode]) if mode != "draft" else None
            batch = next(self.batches[replay if mode != "draft" else "draft"])
            graph = min(g for g in r.graph_buckets if g >= batch) if replay else None
            d.update(batch=batch, graph=graph, tokens=(graph or batch) * (d["width"] if mode == "verify" else 1))
            if mode == "verify":
                d["accept"], d["cutoff"] = next(self.accepts)
                d["sampling"] = _sampling(rng, d["accept"], batch)
            else:
                d["sampling"] = _sampling(rng, "greedy" if next(self.drafts) == "greedy" else "mixed", batch)
            if mode in ("decode", "verify"):
                # requests whose next DSPARK block crosses their page reservation (alloc_for_spec_decode)
                d["new_pages"] = rng.randint(1, batch) if next(self.crossings) else 0
                d["handed_out"] = rng.randrange(0, 4096)
            d["markov_dtype"] = next(self.markov)
            d["random_seed"] = rng.randrange(2**31)  # --random-seed (the server draws one when unset)
        # the DP peers' tokens this step (0: an idle peer); a graph replay pads every rank to the same count
        d["peers"] = [d["tokens"] if d.get("graph") else rng.choice([0, rng.randint(1, max(d["tokens"], 1) * 2)])
                      for _ in range(r.dp - 1)]
        d["nvb"] = next(self.snapshots)
        d["routed_rows"] = rng.randint(0, max(d["tokens"], 1) * r.top_k)
        label = f"{mode}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k != "mode") + "]"
        return Call(label, lambda: _Step(r, d).run(), d)


def _prefix(rng: random.Random, kind: str, chunk: int) -> int:
    """A request's prefix length: none, a radix-cache hit, or the chunks a chunked prefill already ran."""
    return {"fresh": 0, "radix": rng.randint(1, 8192), "chunked": rng.randint(1, 64) * chunk}[kind]


def _sampling(rng: random.Random, accept: str, batch: int) -> list[str]:
    """Each request's sampling for an accept path: greedy (temperature 0), temperature only, top-k / top-p."""
    sampled = ["temperature", "top_k", "top_p"]
    if accept == "greedy":
        return ["greedy"] * batch
    if accept == "temperature":
        return ["temperature"] * batch
    if accept == "top_k_top_p" or batch == 1:
        return [rng.choice(sampled) for _ in range(batch)]
    picks = [rng.choice(["greedy", *sampled]) for _ in range(batch)]
    picks[:2] = ["greedy", rng.choice(sampled)]  # greedy and sampled requests in one batch
    rng.shuffle(picks)
    return picks


class _Step:
    """One forward step of one rank: the scheduler's allocation, the runner's metadata, the model's layers (dense
    layer 0, an MoE layer), the DSPARK worker's accept or draft."""

    def __init__(self, rank: Rank, d: dict):
        import torch

        self.r, self.d, self.torch = rank, d, torch

    def zeros(self, *shape, dtype):
        return self.torch.zeros(*shape, dtype=dtype, device="npu")

    def index(self, values, dtype):
        return index_tensor(list(values), getattr(self.torch, dtype), "npu")

    def run(self) -> None:
        d = self.d
        if d["mode"] == "extend":
            self.allocate_extend()
            self.positions()
        if d.get("new_pages"):
            self.allocate_spec_decode()
        if d["mode"] != "draft":  # the draft step runs the DSPARK draft model, not K3's layers
            self.model()
        if d.get("graph"):
            self.logits()
        if d["mode"] == "verify":
            self.accept()
        if d["mode"] == "draft":
            self.draft()

    # --- scheduler and runner -------------------------------------------------------------------------------------

    def allocate_extend(self) -> None:
        """``alloc_for_extend``: the NPU allocator's ``alloc_extend``, then ``write_cache_indices``."""
        from sglang.kernels.ops.memory.common import write_req_to_token_pool_triton

        d, torch = self.d, self.torch
        prefix, lengths = d["prefix"], d["lengths"]
        seq = [p + n for p, n in zip(prefix, lengths)]
        # _prefix_kv_indices: int64 (a held row cast, the tree's indices, the empty prefix); last_loc: each
        # prefix's last entry or torch.full((1,), -1): int64
        out_cache_loc = self._alloc_extend(self.index(prefix, "int64"), self.index(seq, "int64"),
                                           self.index([p - 1 for p in prefix], "int64"), prefix, seq)
        row = self.r.req_to_token_row(d["width"])
        req_to_token = self.zeros(self.r.max_running + 1, row, dtype=torch.int32)
        bs = len(lengths)
        write_req_to_token_pool_triton[(bs,)](
            req_to_token, self.index(range(1, bs + 1), "int64"), self.index([0] * bs, "uint64"),
            self.index(prefix, "int64"), self.index(seq, "int64"), self.index(lengths, "int64"), out_cache_loc,
            req_to_token.shape[1])

    def allocate_spec_decode(self) -> None:
        """``alloc_for_spec_decode``: DFlashDraftInputV2's int32 current / next KV-length buffers, each crossing
        request a page further (``page_aligned_decode_alloc_lens``), ``get_last_loc_torch``'s int32 locations;
        then ``assign_req_to_token_pool_func`` writes the new locations into the batch's ``req_to_token`` rows."""
        from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

        d, torch = self.d, self.torch
        bs, crossing = d["batch"], d["new_pages"]
        cur = [PAGE_SIZE * (1 + i) for i in range(bs)]
        nxt = [c + (PAGE_SIZE if i < crossing else 0) for i, c in enumerate(cur)]
        cur_kv_lens, nxt_kv_lens = self.index(cur, "int32"), self.index(nxt, "int32")
        out_cache_loc = self._alloc_extend(cur_kv_lens, nxt_kv_lens, self.index([c - 1 for c in cur], "int32"),
                                           cur, nxt)
        req_to_token = self.zeros(self.r.max_running + 1, self.r.req_to_token_row(d["width"]), dtype=torch.int32)
        assign_req_to_token_pool_func(self.index(range(1, bs + 1), "int64"), req_to_token, cur_kv_lens, nxt_kv_lens,
                                      out_cache_loc, bs)

    def _alloc_extend(self, prefix_lens, seq_lens, last_loc, prefix: list[int], seq: list[int]):
        """``NPUPagedTokenToKVPoolAllocator.alloc_extend`` (allocator_npu.py): sgl-kernel-npu's kernel below 200
        new pages (int64 out indices, returned as int32), sglang's torch fallback above."""
        from sgl_kernel_npu.mem_cache.allocator import alloc_extend_kernel

        torch = self.torch
        roundup = PAGE_SIZE - 1
        pages = sum((s + roundup) // PAGE_SIZE - (p + roundup) // PAGE_SIZE for p, s in zip(prefix, seq))
        tokens = sum(s - p for p, s in zip(prefix, seq))
        if pages >= NPU_ALLOC_KERNEL_PAGES:
            return self.zeros(tokens, dtype=torch.int32)
        # the allocator's free pages: torch.arange(1, num_pages + 1, int64), sliced past those handed out
        handed_out = self.d["handed_out"]
        free_pages = self.zeros(handed_out + pages + 1024, dtype=torch.int64)[handed_out:]
        out_indices = self.zeros(tokens, dtype=torch.int64)
        bs = prefix_lens.shape[0]
        alloc_extend_kernel[(bs,)](prefix_lens, seq_lens, last_loc, free_pages, out_indices,
                                   1 << (bs - 1).bit_length(), PAGE_SIZE, 1 << (tokens - 1).bit_length())
        return out_indices.int()

    def positions(self) -> None:
        """``ForwardBatch.init_new`` -> ``compute_position``: int32 extend prefix and seq lengths."""
        from sglang.kernels.ops.attention.position import compute_position_triton

        d = self.d
        compute_position_triton(self.index(d["prefix"], "int32"), self.index(d["lengths"], "int32"), d["tokens"])

    # --- the model ----------------------------------------------------------------------------------------------

    def model(self) -> None:
        """K3's layers on this rank's tokens: the residual mixes, the dense layer's gathered MLP, an MoE layer's
        shared and routed experts, the final aggregate for DSPARK's aux capture."""
        from sgl_kernel_npu.activation.situ import situ, situ_and_mul

        r, d, torch = self.r, self.d, self.torch
        T = d["tokens"]
        hidden = self.zeros(T, r.hidden, dtype=torch.bfloat16)
        bank = self.zeros(T, MAX_SNAPSHOTS, r.hidden, dtype=torch.bfloat16)  # AttnResidual.block_residual
        self.mix(hidden, bank, d["nvb"])  # the attention read
        # dense layer 0: the FFN read, DP gather, SiTU on the gathered rows, DP scatter
        sum_len = self._sum_len()
        gathered = self.dp_gather(hidden, sum_len)
        situ_and_mul(self.zeros(gathered.shape[0], r.dense_cols, dtype=torch.bfloat16))
        if sum_len:
            self.dp_scatter(hidden, gathered)
        # an MoE layer: the FFN read, shared experts on the local rows, routed experts on the dispatched rows
        self.mix(hidden, bank, min(d["nvb"] + 1, MAX_SNAPSHOTS))
        situ_and_mul(self.zeros(T, r.shared_cols, dtype=torch.bfloat16))
        group_list = self.zeros(r.local_experts, dtype=torch.int64)  # num_recv_tokens_per_expert / ll group_list
        situ(self.zeros(d["routed_rows"], r.routed_cols, dtype=torch.bfloat16), group_list, 1, need_quant=True,
             beta=SITU_BETA, linear_beta=SITU_LINEAR_BETA)
        if d["mode"] in ("decode", "verify", "extend"):
            self.mix(hidden, bank, MAX_SNAPSHOTS)  # aggregate_stream(nvb = block_num) for the aux hidden states

    def mix(self, prefix, bank, nvb: int) -> None:
        """``attn_residual._mix_fused`` on NPU: ``mix_fused(prefix_sum, bank, nvb, get_cw(...) (fp32 [H]),
        score_norm.variance_epsilon)``; nothing at 0 tokens."""
        from sgl_kernel_npu.kimi_k3.attn_residual import mix_fused

        cw = self.zeros(self.r.hidden, dtype=self.torch.float32)
        mix_fused(prefix, bank, nvb, cw, self.r.eps)

    def _counts(self) -> list[int]:
        """Every DP rank's tokens this step (``global_num_tokens``), this rank's at its DP rank."""
        counts = list(self.d["peers"])
        counts.insert(self.d["dp_rank"], self.d["tokens"])
        return counts

    def _sum_len(self) -> bool:
        """``DpPaddingMode.get_dp_padding_mode``: a graph replay pads to MAX_LEN (``get_default_mode_in_cuda_graph``:
        DeepEP and DSPARK rule the custom all-reduce's SUM_LEN out); an extend anywhere in the batch gathers SUM_LEN
        (K3 has no ``hybrid_override_pattern``: no MAX_LEN for idle ranks); otherwise the cheaper one, MAX_LEN on a
        tie."""
        d, counts = self.d, self._counts()
        if d.get("graph"):
            return False
        if d["mode"] == "extend" or d.get("peers_extend"):
            return True
        return sum(counts) * 2 < max(counts) * len(counts)

    def _dp_local(self):
        """``get_dp_local_info``: 0-d int64 views of ``global_num_tokens_gpu`` and its cumsum at this DP rank."""
        d, counts = self.d, self._counts()
        global_num_tokens = self.index(counts, "int64")
        cumtokens = self.index(list(itertools.accumulate(counts)), "int64")
        k = d["dp_rank"]
        start = self.torch.zeros_like(cumtokens[0]) if k == 0 else cumtokens[k - 1]
        return sum(counts), start, global_num_tokens[k]

    def dp_gather(self, local, sum_len: bool):
        """``dp_gather_partial``: under SUM_LEN ``_dp_gather_via_all_reduce``'s ``memcpy_triton(global, local, 0,
        start, num, False)`` where this rank has tokens; under MAX_LEN an all-gather (no Triton) of ``max * dp``
        rows."""
        from sglang.kernels.ops.memory.memcpy_triton import memcpy_triton

        if not sum_len:
            return self.zeros(max(self._counts()) * self.r.dp, local.shape[1], dtype=local.dtype)
        total, start, num = self._dp_local()
        gathered = self.zeros(total, local.shape[1], dtype=local.dtype)
        if local.shape[0] > 0:
            memcpy_triton(gathered, local, 0, start, num, False)
        return gathered

    def dp_scatter(self, local, gathered) -> None:
        """``dp_scatter`` after the dense MLP's all-reduce under SUM_LEN (MAX_LEN reduce-scatters instead):
        ``memcpy_triton(local, global, 0, start, num, True)``."""
        from sglang.kernels.ops.memory.memcpy_triton import memcpy_triton

        _, start, num = self._dp_local()
        if local.shape[0] > 0:
            memcpy_triton(local, gathered, 0, start, num, True)

    def logits(self) -> None:
        """``LogitsProcessor`` under a graph replay: the TP-gathered bf16 logits ``[tokens, vocab]`` cast into the
        graph's fp32 ``next_token_logits_buffer[:tokens]`` (``cast_to_float32_logits``, where ``logits.is_cuda``)."""
        from sglang.kernels.ops.activation.softcap import cast_to_float32_logits

        r, T, torch = self.r, self.d["tokens"], self.torch
        buffer = self.zeros(r.max_running * max(r.draft_widths), r.vocab, dtype=torch.float32)
        cast_to_float32_logits(self.zeros(T, r.vocab, dtype=torch.bfloat16), buffer[:T])

    # --- DSPARK ---------------------------------------------------------------------------------------------------

    def _sampling_info(self):
        """The batch's ``SamplingBatchInfo`` as the accept reads it (fp32 temperatures ``[bs, 1]``, int32 top-k,
        fp32 top-p)."""
        from types import SimpleNamespace

        modes = self.d["sampling"]
        bs = len(modes)
        return SimpleNamespace(
            temperatures=self.zeros(bs, 1, dtype=self.torch.float32), top_ks=self.zeros(bs, dtype=self.torch.int32),
            top_ps=self.zeros(bs, dtype=self.torch.float32), is_all_greedy=all(m == "greedy" for m in modes),
            is_any_greedy=any(m == "greedy" for m in modes), need_top_k_sampling="top_k" in modes,
            need_top_p_sampling="top_p" in modes)

    def accept(self) -> None:
        """``dspark_verify.accept_draft_tokens`` then ``build_accept_outs``' ``FinalizeAcceptLens`` (NPU: no
        block-wise rejection noise, ``BuildOutTokens`` in torch)."""
        from sglang.kernels.ops.speculative.dspark.dspark_accept import (
            AcceptGreedy, AcceptSampling, FinalizeAcceptLens, SelectMixedAccept, SoftmaxTemp,
        )
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

        d, r, torch = self.d, self.r, self.torch
        bs, stride = d["batch"], d["width"]
        gamma = stride - 1
        candidates = self.zeros(bs, stride, dtype=torch.int64)
        logits = self.zeros(bs * stride, r.vocab, dtype=torch.float32)  # the verify's next-token logits
        cutoff = self.index([stride] * bs, "int32") if d["cutoff"] else None
        info = self._sampling_info()
        greedy = dict(candidates=candidates, target_logits=logits, verify_num_draft_tokens=stride,
                      cutoff_verify_lens=cutoff)
        if info.is_all_greedy:
            correct_len, _, cap_trim = AcceptGreedy.execute(**greedy)
        else:
            # the draft block's corrected step logits, in the Markov head's step dtype (draft below)
            step_logits = self.zeros(bs, gamma, r.vocab, dtype=self._step_dtype())
            draft_probs = SoftmaxTemp.execute(logits=step_logits.reshape(bs * gamma, r.vocab),
                                              temperatures=self.zeros(bs, dtype=torch.float32),
                                              rows_per_request=gamma).view(bs, gamma, r.vocab)
            sampled = AcceptSampling.execute(
                candidates=candidates, target_logits=logits, draft_probs=draft_probs, sampling_info=info,
                draft_input=DFlashDraftInputV2(max_top_k=64), gamma=gamma, verify_num_draft_tokens=stride,
                cutoff_verify_lens=cutoff)
            correct_len, _, cap_trim = sampled
            if info.is_any_greedy:
                g_len, g_bonus, g_trim = AcceptGreedy.execute(**greedy)
                picked = SelectMixedAccept.execute(
                    greedy_mask=self.zeros(bs, dtype=torch.bool), greedy_len=g_len, greedy_bonus=g_bonus,
                    greedy_trim=g_trim, sampling_len=sampled[0], sampling_bonus=sampled[1],
                    sampling_trim=sampled[2])
                correct_len, cap_trim = picked.correct_len, picked.cap_trim_lens
        seq_lens = self.zeros(r.max_running, dtype=torch.int64)[:bs]  # the batch's seq_lens[:bs]
        FinalizeAcceptLens.execute(correct_len=correct_len, cap_trim_lens=cap_trim, prefix_lens=seq_lens)

    def _step_dtype(self):
        """``VanillaMarkov.step_logits_dtype``: ``promote_types(base_logits.dtype, markov_w1.weight.dtype)``, the
        base logits bf16 (``project_through_lm_head``: a matmul in the target lm_head's dtype)."""
        return self.torch.promote_types(self.torch.bfloat16, getattr(self.torch, self.d["markov_dtype"]))

    def draft(self) -> None:
        """``dspark_draft.draft_markov_block``: per draft position ``MarkovSampleStep`` over ``base_logits[:, step]``
        (an unsharded head: ``gather_and_crop_vocab``'s full-vocab bf16 logits), the bias in the head's dtype, the
        step logits kept (``logits_out[:, step]``) for a sampled draft, none for a greedy one."""
        from sglang.kernels.ops.speculative.dspark.markov_sample import MarkovSampleStep

        d, r, torch = self.d, self.r, self.torch
        bs, gamma = d["batch"], d["width"] - 1
        step_dtype = self._step_dtype()
        greedy_draft = all(m == "greedy" for m in d["sampling"])
        base_logits = self.zeros(bs, gamma, r.vocab, dtype=torch.bfloat16)
        logits_out = None if greedy_draft else self.zeros(bs, gamma, r.vocab, dtype=step_dtype)
        offset = self.zeros(1, dtype=torch.int64)  # DraftNoise.offset, the counter each block advances
        key = (d["random_seed"] ^ DRAFT_NOISE_DOMAIN) & 0x7FFFFFFFFFFFFFFF  # draft_noise_key
        for step in range(gamma):
            MarkovSampleStep.execute(
                base_logits=base_logits[:, step],
                bias=self.zeros(bs, r.vocab, dtype=getattr(torch, d["markov_dtype"])),  # markov_w2(markov_w1(prev))
                temperatures=self.zeros(bs, dtype=torch.float32), key=key, offset=offset, step=step,
                step_dtype=step_dtype, logits_out=None if logits_out is None else logits_out[:, step],
                has_sampled_rows=None if logits_out is not None else False)
