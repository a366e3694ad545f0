"""The logits processor's cast into the CUDA graph's logits buffer, as sglang 0.5.23 runs it on CUDA: the model
component ``logits`` of ``prewarm.providers.sglang.cuda``.

Under the decode and target-verify CUDA graph runners the forward batch carries ``next_token_logits_buffer`` (the
runner's shared fp32 ``[rows, vocab]`` buffer, ``graph_shared_output.get_logits_buffer``, sliced to the batch's
tokens), and ``LogitsProcessor._copy_logits_to_buffer`` writes the lm_head's bf16 ``[tokens, vocab]`` logits into it
with ``cast_to_float32_logits`` (``sglang.kernels.ops.activation.softcap``: one Triton kernel over the flattened rows;
a model with ``final_logit_softcapping`` takes ``softcap_to_float32_logits`` instead: Kimi-Linear has none). What
reaches the kernel from the batch is the flattened length (tokens x vocab, an int Triton specializes on: 1, a multiple
of 16, other), so :func:`calls` casts at each graph-runner token count class the deployment reaches.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "logits"
KERNELS = ("sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel",)


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the cast at the token counts of the CUDA graph replays (decode: each bucket's requests;
    verify: x each draft width), one of each int class of the flattened length (none without
    ``[spec.sglang.model] vocab_size`` or without graph buckets)."""
    from prewarm_kernels.spec import SpecError

    vocab = ((spec.get("sglang") or {}).get("model") or {}).get("vocab_size")
    if vocab is None or not s.graph_buckets:
        return
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise SpecError("sglang.model.vocab_size", vocab, "a positive integer: config.json vocab_size")
    tokens = {b * w for b in s.graph_buckets for w in (1, *s.draft_widths)}
    classes: dict[int, int] = {}
    for t in sorted(tokens):
        n = t * vocab
        classes.setdefault(1 if n == 1 else 16 if n % 16 == 0 else 0, t)
    for t in sorted(classes.values()):
        yield f"{COMPONENT}/cast_to_float32_logits[T={t}]", lambda t=t: _cast(t, vocab, device)


def _cast(tokens: int, vocab: int, device: str) -> None:
    """``_copy_logits_to_buffer`` with the graph's buffer: bf16 logits (contiguous, the lm_head's matmul) into the
    fp32 buffer's first ``tokens`` rows."""
    import torch

    from sglang.kernels.ops.activation.softcap import cast_to_float32_logits

    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16, device=device)
    buffer = torch.zeros(tokens + 1, vocab, dtype=torch.float32, device=device)[:tokens]
    cast_to_float32_logits(logits, buffer)


def coverage(spec: dict) -> dict:
    """This component's entry of the provider's coverage hook."""
    vocab = ((spec.get("sglang") or {}).get("model") or {}).get("vocab_size")
    if vocab is None:
        return {"component": COMPONENT, "planned": [], "not_planned": [
            {"what": "sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel (the logits cast)",
             "why": "no [spec.sglang.model] vocab_size: the model's widths are not stated"}]}
    return {"component": COMPONENT, "planned": list(KERNELS), "not_planned": [
        {"what": "eager batches' logits (no graph buffer)", "why": "torch's .float(): nothing to compile"}]}
