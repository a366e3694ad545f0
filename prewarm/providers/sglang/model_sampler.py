"""The sampler's Triton kernels as sglang 0.5.23 runs them on CUDA (Hopper, ``--sampling-backend flashinfer``): the
model component ``sampler`` of ``prewarm.providers.sglang.cuda``.

What the sampler reaches on this deployment, by request kind (``srt/layers/sampler.py`` ``Sampler.forward`` and what
the model runner applies before it, ``ModelRunner._preprocess_logits`` -> ``SamplingBatchInfo.apply_logits_bias``):

- greedy (``is_all_greedy``): ``torch.argmax``; nothing to compile.
- sampled: ``logits.div_(temperatures)``, then ``sampler_softmax`` (``sglang.kernels.ops.sampling.softmax``): Cake's
  Blackwell softmax only where ``torch.cuda.get_device_capability() == (10, 3)`` (``cake_kernels/sampling.py``
  ``_device_supported``), else ``torch.softmax``; then ``torch.multinomial`` (no top-k / top-p / min-p) or
  FlashInfer's ``top_k_top_p_sampling_from_probs`` / ``min_p_sampling_from_probs`` and sgl-kernel's
  ``top_k_renorm_prob`` / ``top_p_renorm_prob`` (FlashInfer's sampling JIT module, planned as a JIT request; sgl-kernel
  ahead of time). No Triton.
- penalties (frequency, presence, min_new_tokens) and logit bias: torch element-wise ops in
  ``srt/sampling/penaltylib`` (``logits.sub_``, ``torch.where``, ``logits.add_``). No Triton. The repetition
  penalty's ``apply_scaling_penalties`` is ``torch.compile(dynamic=True)`` (Inductor on CUDA): Inductor generates and
  compiles its own Triton kernels at the first request with ``repetition_penalty != 1`` (not planned: below).
- structured output (a request with a JSON schema, regex or grammar; xgrammar, sglang's default grammar backend): the
  filled vocab mask is applied to the fp32 logits by ``XGrammarGrammar.apply_vocab_mask`` ->
  ``apply_token_bitmask_inplace_triton`` (``sglang.kernels.ops.grammar.bitmask_ops``; CUDA, not ROCm) before
  sampling, in prefill / decode sampling (one row per request) and in EAGLE's verify (``eagle_utils.py``:
  ``grammar_mask.apply(next_token_logits)``, one row per draft token). Planned here: :func:`calls`.
- output logprobs: ``log_softmax`` and gathers (``logprob_processor.py`` ``compute_logprobs``). No Triton.

The mask kernel's specializations: the fp32 logits and int32 bitmask pointers (fresh or the graph's buffer from its
first row: aligned), ``num_rows`` (an int Triton specializes as 1, a multiple of 16, other: one launch per class the
deployment's row counts reach), the vocab and bitmask widths (fixed by the model), ``NUM_SMS`` (a constexpr: the
device's SM count, which the target's device profile answers) and ``BLOCK_SIZE``.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "sampler"
KERNELS = ("sglang.kernels.ops.grammar.bitmask_ops:apply_token_bitmask_inplace_kernel",)
NOT_PLANNED = [
    {"what": "greedy, temperature, top-k / top-p / min-p, frequency / presence / min_new_tokens penalties, logit "
             "bias, output logprobs",
     "why": "torch ops, sgl-kernel (ahead of time) and FlashInfer's sampling JIT module (planned as a JIT request): "
            "no Triton on sm_90 (sampler.py: sampler_softmax is torch.softmax off sm_103; penaltylib: torch)"},
    {"what": "the repetition penalty (penaltylib/repetition_penalty.py: apply_scaling_penalties)",
     "why": "torch.compile(dynamic=True), Inductor on CUDA: Inductor writes and compiles its own Triton kernels at the "
            "first request with repetition_penalty != 1; prewarm plans the server's Triton kernels, not Inductor's"},
    {"what": "sglang.kernels.ops.sampling.murmur_hash:murmur_hash32_kernel (seeded sampling)",
     "why": "only with --enable-deterministic-inference (sampling_batch_info.py: sampling_seed is None otherwise)"},
    {"what": "sglang.srt.utils.async_probe:_assert_no_nan_kernel",
     "why": "only with SGLANG_ENABLE_NAN_LOGITS_CHECK / SGLANG_ENABLE_ASYNC_ASSERT (both off by default)"},
    {"what": "sglang.kernels.ops.grammar.token_filter_ops (reset_vocab_mask_kernel, set_token_filter_batch_kernel)",
     "why": "the reasoner grammar's strict-thinking token filter: only with --reasoning-parser (not in the launch "
            "line)"},
    {"what": "sglang.srt.layers.logsumexp:_row_logsumexp_kernel, _row_logsumexp_topk_kernel (input logprobs)",
     "why": "the logits processor's prompt-logprob path (logprob_processor.py, SGLANG_ENABLE_FAST_INPUT_LOGPROBS on by "
            "default), reached by requests asking for input logprobs: not yet planned"},
]
BITS = 32  # xgrammar's bitmask: one int32 per 32 tokens


def vocab_size(spec: dict) -> int | None:
    """``[spec.sglang.model] vocab_size`` (the logits' width; validated by the logits component)."""
    return ((spec.get("sglang") or {}).get("model") or {}).get("vocab_size")


def row_counts(s) -> list[int]:
    """One row count per Triton int class (1, a multiple of 16, other) among those the deployment reaches: a batch of
    1..``s.max_batch`` requests, and in EAGLE's verify each batch times each draft width."""
    rows = set(range(1, s.max_batch + 1)) | {b * w for b in range(1, s.max_batch + 1) for w in s.draft_widths}
    classes: dict[int, int] = {}
    for n in sorted(rows):
        classes.setdefault(1 if n == 1 else 16 if n % 16 == 0 else 0, n)
    return sorted(classes.values())


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the grammar mask at each row class (none without ``[spec.sglang.model] vocab_size``)."""
    vocab = vocab_size(spec)
    if vocab is None:
        return
    for rows in row_counts(s):
        yield f"{COMPONENT}/apply_vocab_mask[rows={rows}]", lambda rows=rows: _apply_mask(rows, vocab, device)


def _apply_mask(rows: int, vocab: int, device: str) -> None:
    """``XGrammarGrammar.apply_vocab_mask`` on CUDA: the fp32 logits ``[rows, vocab]`` and the mask xgrammar
    allocates (``allocate_token_bitmask``: int32 ``[rows, ceil(vocab / 32)]``), moved to the device."""
    import torch

    from sglang.kernels.ops.grammar.bitmask_ops import apply_token_bitmask_inplace_triton

    logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    mask = torch.empty(rows, -(-vocab // BITS), dtype=torch.int32, device=device)
    apply_token_bitmask_inplace_triton(logits, mask)


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook."""
    if vocab_size(spec) is None:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": KERNELS[0] + " (structured output's vocab mask)",
             "why": "no [spec.sglang.model] vocab_size: the model's widths are not stated"},
            *[dict(d) for d in NOT_PLANNED]]}
    return {"component": COMPONENT, "planned": list(KERNELS), "not_planned": [dict(d) for d in NOT_PLANNED]}
