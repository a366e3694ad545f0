"""DSPARK's verify accept on sglang's Ascend path: the ``spec_worker`` component of
:mod:`prewarm.providers.sglang.ascend`.

After each target verify, ``DsparkVerifier`` (sglang 0.5.23 ``srt/speculative/dspark_components/dspark_verify.py``:
``accept_draft_tokens``, then ``build_accept_outs``) decides the accepted lengths with the kernels of
``sglang/kernels/ops/speculative/dspark/dspark_accept.py``, each class dispatching on ``inputs_on_cuda`` (the first
tensor's ``is_cuda``: true on the NPU under torch_npu's ``transfer_to_npu``, so its Triton path runs there):

- a greedy batch (every request at temperature 0): ``AcceptGreedy`` -> ``compute_dflash_correct_drafts_and_bonus``
  (``dflash.py``'s fused kernel), and with a ragged verify layout ``CapCorrectLen`` and the bonus gather;
- a sampled batch: ``AcceptSampling`` -> the target's ``SoftmaxTemp`` (no top-k / top-p: the Triton softmax, no
  FlashInfer on NPU) or the top-k / top-p renormalized probabilities (torch on NPU), the draft's probabilities (an
  argmax draft's one-hot, or ``SoftmaxTemp`` of the draft's corrected logits), sgl-kernel-npu's
  ``chain_speculative_sampling_triton`` (``dspark_accept.py`` imports it on NPU: its block-sum kernel takes the batch
  size as a constexpr, so every batch size up to the running-request cap is planned) and the two-level bonus gather;
- a batch mixing both: ``SelectMixedAccept``; then every batch: ``FinalizeAcceptLens``.

Before each verify the DSPARK draft proposes its block (``dspark_draft.py`` ``draft_markov_block``): per draft
position ``_draft_step`` -> ``MarkovSampleStep.execute`` (``markov_sample.py``; ``inputs_on_cuda``: its Triton
partial and finish kernels on the NPU) over ``base_logits[:, step]`` (the draft's bf16 full-vocab logits: an unsharded
head, ``gather_and_crop_vocab``), the step bias in the Markov head's dtype, the step dtype
``promote_types(bf16, head dtype)`` (``VanillaMarkov.step_logits_dtype``; every head dtype is planned: it comes from
the draft checkpoint), the fp32 step temperatures, the Philox key ``draft_noise_key(--random-seed)`` (an int64 the
binder specializes on divisibility by 16: both classes), the noise offset, and for a sampled draft the kept step logits
``step_logits[:bs][:, step]`` (``has_sampled_rows`` None: sampled), for a greedy one none (``False``: argmax). A
sampled verify's draft probabilities are ``SoftmaxTemp`` of those step logits, in the step dtype.

:func:`calls` calls those classes' ``execute`` as ``accept_draft_tokens`` and ``build_accept_outs`` do, with the
dtypes their callers hand over: int64 candidates ``[bs, draft]``, the target's fp32 logits over the whole vocabulary
(``LogitsProcessor`` gathers them over TP), fp32 temperatures ``[bs, 1]``, int32 ragged verify lengths, bool greedy
masks, int64 sequence lengths. Batch sizes: every one up to the cap for the sampled accept (the constexpr), the
sizes that stand for every specialization class elsewhere (``capture.batch_sizes``).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Iterator

from ..capture import batch_sizes

COMPONENT = "spec_worker"
MODULE = "sglang.kernels.ops.speculative.dspark.dspark_accept"
CHAIN = "sgl_kernel_npu.sample.chain_speculative_sampling"
MARKOV = "sglang.kernels.ops.speculative.dspark.markov_sample"
TOP_K = 20  # a sampled batch's largest top-k (DFlashDraftInputV2.max_top_k): torch's top-k only, no kernel
HEAD_DTYPES = ("bfloat16", "float16", "float32")  # the Markov head's weights (markov_w1 / markov_w2), the checkpoint's
DRAFT_NOISE_DOMAIN = 0x2D2A9C317E44B1F3  # dspark_draft.py: draft_noise_key(seed) = (seed ^ it) & (2**63 - 1)


def import_modules() -> None:
    import sglang.kernels.ops.speculative.dspark.dspark_accept  # noqa: F401
    import sglang.kernels.ops.speculative.dspark.markov_sample  # noqa: F401


def noise_keys() -> list[int]:
    """``draft_noise_key`` of --random-seed values that give each specialization class the key takes: int64 (the
    domain's high bits stay set for any seed below 2**61), divisible by 16 (a seed whose low 4 bits are 3) or not."""
    return [(seed ^ DRAFT_NOISE_DOMAIN) & 0x7FFFFFFFFFFFFFFF for seed in (3, 0)]


def step_dtype(head_dtype):
    """``VanillaMarkov.step_logits_dtype`` over the draft's bf16 base logits."""
    import torch

    return torch.promote_types(torch.bfloat16, head_dtype)


def calls(s, model) -> Iterator[tuple[str, Callable[[], object]]]:
    import torch

    from sglang.kernels.ops.speculative.dspark import dspark_accept as accept

    vocab = model.vocab_size

    def tensors(bs, width):
        npu = dict(device="npu")
        return SimpleNamespace(
            candidates=torch.empty(bs, width, dtype=torch.int64, **npu),
            logits=torch.empty(bs * width, vocab, dtype=torch.float32, **npu),
            verify_lens=torch.empty(bs, dtype=torch.int32, **npu),
            temperatures=torch.empty(bs, 1, dtype=torch.float32, **npu),
            prefix_lens=torch.empty(bs, dtype=torch.int64, **npu),
            greedy_mask=torch.empty(bs, dtype=torch.bool, **npu))

    for width in s.draft_widths:
        for bs in batch_sizes(s.max_batch):
            yield from _draft(width, bs, vocab, s.max_batch)
            for ragged in (False, True):
                def greedy(bs=bs, width=width, ragged=ragged):
                    t = tensors(bs, width)
                    correct, bonus, trim = accept.AcceptGreedy.execute(
                        candidates=t.candidates, target_logits=t.logits, verify_num_draft_tokens=width,
                        cutoff_verify_lens=t.verify_lens if ragged else None)
                    accept.FinalizeAcceptLens.execute(correct_len=correct, cap_trim_lens=trim,
                                                      prefix_lens=t.prefix_lens)
                    accept.SelectMixedAccept.execute(  # a batch mixing greedy and sampled requests
                        greedy_mask=t.greedy_mask, greedy_len=correct, greedy_bonus=bonus, greedy_trim=trim,
                        sampling_len=correct, sampling_bonus=bonus, sampling_trim=trim)

                yield f"accept_greedy[draft={width},bs={bs},ragged={ragged}]", greedy
        classes = batch_sizes(s.max_batch)
        for bs in range(1, s.max_batch + 1):
            # top-k / top-p requested (the target probabilities renormalized) and a sampled draft (its softmax) add
            # no constexpr: each at the sizes that stand for every specialization class, the rest at every size
            # (a sampled draft's step dtypes: its draft probabilities' softmax reads its step logits)
            variants = [(f, None) for f in (False, True)] + [
                (f, step_dtype(getattr(torch, head))) for f in (False, True) for head in HEAD_DTYPES]
            variants = list(dict.fromkeys(variants)) if bs in classes else [(False, None)]
            for filtered, draft_dtype in variants:
                greedy_draft = draft_dtype is None

                def sampled(bs=bs, width=width, filtered=filtered, draft_dtype=draft_dtype):
                    t = tensors(bs, width)
                    rows = width - 1  # the draft's proposal rows (gamma)
                    if draft_dtype is None:  # an argmax draft: one-hot fp32 probabilities
                        draft_probs = torch.zeros(bs, rows, vocab, dtype=torch.float32, device="npu")
                    else:  # dspark_verify._draft_probs: SoftmaxTemp of the draft's corrected (step) logits
                        draft_probs = accept.SoftmaxTemp.execute(
                            logits=torch.empty(bs * rows, vocab, dtype=draft_dtype, device="npu"),
                            temperatures=t.temperatures, rows_per_request=rows).view(bs, rows, vocab)
                    info = SimpleNamespace(
                        need_top_k_sampling=filtered, need_top_p_sampling=filtered, need_min_p_sampling=False,
                        temperatures=t.temperatures, top_ks=torch.empty(bs, dtype=torch.int32, device="npu"),
                        top_ps=torch.empty(bs, dtype=torch.float32, device="npu"), is_all_greedy=False)
                    # the batch's largest top-k, which the scheduler hands the draft input (torch ops use it)
                    draft_input = SimpleNamespace(max_top_k=TOP_K, uniform_top_k_value=None)
                    accept.AcceptSampling.execute(
                        candidates=t.candidates, target_logits=t.logits, draft_probs=draft_probs,
                        sampling_info=info, draft_input=draft_input, gamma=rows,
                        verify_num_draft_tokens=width, cutoff_verify_lens=None)

                draft = "argmax" if greedy_draft else str(draft_dtype).rsplit(".", 1)[-1]
                yield f"accept_sampled[draft={width},bs={bs},top_k_p={filtered},draft_probs={draft}]", sampled


def _draft(width: int, bs: int, vocab: int, max_bs: int) -> Iterator[tuple[str, Callable[[], object]]]:
    """``draft_markov_block``'s Markov steps for a batch of ``bs`` at draft width ``width``: a greedy draft and a
    sampled one, per Markov head dtype and Philox key class, every draft position."""
    import torch

    for head in HEAD_DTYPES:
        for greedy_draft in (True, False):
            for key in noise_keys():
                def call(head=getattr(torch, head), greedy_draft=greedy_draft, key=key):
                    from sglang.kernels.ops.speculative.dspark.markov_sample import MarkovSampleStep

                    gamma, dtype = width - 1, step_dtype(head)
                    base_logits = torch.empty(bs, gamma, vocab, dtype=torch.bfloat16, device="npu")
                    # DsparkDraftSampler's buffers, sized for the largest batch, sliced to this one
                    step_temperatures = torch.empty(max_bs, dtype=torch.float32, device="npu")[:bs]
                    step_logits = None if greedy_draft else torch.empty(
                        max_bs, gamma, vocab, dtype=dtype, device="npu")[:bs]
                    offset = torch.zeros(1, dtype=torch.int64, device="npu")  # DraftNoise.offset
                    for step in range(gamma):
                        MarkovSampleStep.execute(
                            base_logits=base_logits[:, step],
                            bias=torch.empty(bs, vocab, dtype=head, device="npu"),  # markov_w2(markov_w1(prev))
                            temperatures=step_temperatures, key=key, offset=offset, step=step, step_dtype=dtype,
                            logits_out=None if step_logits is None else step_logits[:, step],
                            has_sampled_rows=None if step_logits is not None else False)

                yield (f"draft_markov[draft={width},bs={bs},head={head},greedy_draft={greedy_draft},"
                       f"key_mod16={key % 16}]", call)


def coverage(s, model) -> dict:
    return {"component": COMPONENT, "planned": [
        "sglang.kernels.ops.speculative.dflash:_fused_correct_drafts_and_bonus_kernel",
        f"{MODULE}:_cap_correct_len_kernel", f"{MODULE}:_gather_row_bonus_kernel",
        f"{MODULE}:_finalize_accept_lens_kernel", f"{MODULE}:_mixed_accept_select_kernel",
        f"{MODULE}:_softmax_temp_kernel", f"{MODULE}:_gather_two_level_bonus_kernel",
        f"{CHAIN}:_chain_rejection_accept_kernel", f"{CHAIN}:_chain_rejection_block_sum_kernel",
        f"{CHAIN}:_chain_rejection_sample_kernel", f"{MARKOV}:_markov_sample_partial_kernel",
        f"{MARKOV}:_markov_sample_finish_kernel"],
        "not_planned": [
            {"what": "sglang.kernels.ops.speculative.dspark.dspark_draft_model:_markov_greedy_partial_kernel, "
                     "_markov_greedy_combine_kernel (MarkovGreedyStep: a one-row greedy draft whose unsharded "
                     "VanillaMarkov head exposes its w2 weight)",
             "why": "not driven: its rank (markov_rank, an int the binder specializes) is the draft checkpoint's, "
                    "not available here, and the module is not in the assembled sglang tree"},
            {"what": "MarkovSampleStep over a vocab-sharded Markov head (vocab_start, the per-rank candidate "
                     "gather: VanillaMarkov.configure_tp_shard)",
             "why": "a dense DSpark draft never shards it (models/dspark.py: DSparkDraftMixin."
                    "supports_vocab_parallel_draft_logits = False; only MiniMax's draft does): the unsharded head "
                    "is planned"},
            {"what": "the DSPARK draft model's kernels (dspark_draft_model), its KV inject / verify window / stage "
                     "commit kernels",
             "why": "the DSPARK draft worker (dspark_draft.py, dspark_kv_inject.py) is not driven yet"},
            {"what": "sglang.kernels.ops.speculative.dspark.blockwise_rejection",
             "why": "taken only with a rejection-noise seed (SGLANG_DSPARK_* block-wise rejection), which the report "
                    "does not set; not driven"},
            {"what": "the verify epilogue folded into the target-verify graph (DsparkVerifyEpilogue, static accept "
                     "tail, simulated bonus)",
             "why": "the graph-folded accept (SGLANG_SIMULATE_ACC_LEN / static epilogue) is not driven yet"}]}
