"""vLLM 0.34.0's MTP drafter in the V2 model runner (``--speculative-config {"method": "mtp", ...}``:
``MTPSpeculator``, ``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py``): the component
``speculator`` of ``prewarm.providers.vllm.kda``.

After each verify step ``GPUModelRunner`` calls ``propose``, which launches, around the draft model's forwards:

- ``prepare_prefill_inputs`` (``_prepare_prefill_inputs_kernel``): the draft prefill's inputs from the target's
  batch (its input buffers, the sampled / rejected counts, the last sampled tokens);
- the draft sample (``sample_draft``): ``greedy_argmax`` (``sample/greedy_argmax.py``: ``_argmax_partial``,
  ``_argmax_finish``) on the draft head's logits in the model dtype (``draft_sample_method`` greedy, vLLM's default);
- with more than one speculative token, ``_run_multi_step_decode``: ``_prepare_decode_inputs`` (its
  ``_prepare_decode_inputs_kernel``) once, then per draft step the sample and ``update_draft_inputs``
  (``_update_draft_inputs_kernel``) on the draft model's hidden states.

Planned here by calling those functions (and the ``_prepare_decode_inputs`` method, on the drafter's own buffers)
as ``propose`` does, on the buffers ``DraftModelSpeculator`` / ``TargetDependentARSpeculator`` allocate
(``InputBuffers``, ``draft_tokens`` ``[max_num_seqs, num_speculative_tokens]`` int64, ``hidden_states`` ``[max
tokens, hidden]`` in the model dtype, ``max_model_len_gpu`` int32). What specializes them: the vocabulary (the
argmax's split count and row stride), the hidden size, ``max_model_len``, ``max_num_seqs``, the speculative steps,
the model dtype; the request count sizes the grids only.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Callable, Iterator

from prewarm_kernels.spec import SpecError

from ..capture import batch_sizes

DRAFTER = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"
ARGMAX = "vllm.v1.worker.gpu.sample.greedy_argmax"
PLANNED = [f"{DRAFTER}:{k}" for k in ("_prepare_prefill_inputs_kernel", "_prepare_decode_inputs_kernel",
                                      "_update_draft_inputs_kernel")] + \
    [f"{ARGMAX}:_argmax_partial", f"{ARGMAX}:_argmax_finish"]
SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
NOT_PLANNED = [
    {"what": "the draft model's forward (the MTP module's layers and head)",
     "why": "not driven here: where its layers are the target's kinds their kernels' keys are the target's (the "
            "MoE's fused_moe_kernel is planned over 1..the step budget); its attention (MLA) is the target's kind: "
            "no Triton on the H200 (the mla component)"},
    {"what": f"{SPEC_DECODE}.draft_logits (DraftLogitsCache writes), vllm.v1.worker.gpu.sample.gumbel with "
             "is_drafting (the drafter's Gumbel sampling)",
     "why": "draft_sample_method probabilistic, not vLLM's default (greedy)"},
    {"what": f"{SPEC_DECODE}.acceptance_estimator, {SPEC_DECODE}.adaptive_verification",
     "why": "enable_adaptive_verification: off by default"},
    {"what": f"{SPEC_DECODE}.multi_module_mtp, eagle / dflash / dspark / ngram / suffix / xpress speculators",
     "why": "other --speculative-config methods (multi-module MTP: a checkpoint with several MTP modules)"},
    {"what": "the drafter's local argmax reduction (get_draft_top_tokens), draft watermarking",
     "why": "use_local_argmax_reduction (tensor parallel drafts) and watermarking: off in this deployment"},
]


@dataclass(frozen=True)
class DrafterSpec:
    """The MTP drafter's geometry on one rank."""

    hidden_size: int
    dtype: str


def read_spec(table: dict, dtype: str) -> DrafterSpec | None:
    """``[spec.vllm]`` ``draft_hidden_size`` (the MTP layer's width: config.json hidden_size); None where absent (the
    drafter is not planned)."""
    if "draft_hidden_size" not in table:
        return None
    value = table["draft_hidden_size"]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError("vllm.draft_hidden_size", value, "a positive integer: the MTP drafter's hidden size "
                        "(config.json hidden_size)")
    return DrafterSpec(hidden_size=value, dtype=dtype)


def calls(d: DrafterSpec, r, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call): one ``propose`` per request count (``r``: the runner's spec, ``r.num_spec`` >= 1)."""
    import torch

    drafter = importlib.import_module(DRAFTER)
    argmax = importlib.import_module(ARGMAX)
    ib = importlib.import_module("vllm.v1.worker.gpu.input_batch")
    dtype, i32, i64 = getattr(torch, d.dtype), torch.int32, torch.int64
    R, S = r.max_num_reqs, r.num_spec
    made = {}

    def state():
        """The drafter's buffers (``DraftModelSpeculator.__init__`` and its subclasses') and the target's."""
        if "s" not in made:
            buffers = lambda: ib.InputBuffers(max_num_reqs=R, max_num_tokens=r.max_num_tokens,  # noqa: E731
                                              device=torch.device(device))
            made["s"] = types.SimpleNamespace(
                target=buffers(), input_buffers=buffers(), max_num_reqs=R, max_model_len=r.max_model_len,
                last_token_indices=torch.zeros(R, dtype=i64, device=device),
                current_draft_step=torch.tensor(0, dtype=i64, device=device),
                draft_tokens=torch.zeros(R, S, dtype=i64, device=device),
                hidden_states=torch.zeros(r.max_num_tokens, d.hidden_size, dtype=dtype, device=device),
                sample_src_positions=torch.zeros(R, dtype=i64, device=device),
                max_model_len_gpu=torch.tensor(r.max_model_len, dtype=i32, device=device),
                advance_draft_positions=True,  # AutoRegressiveSpeculator's (the MTP drafter's)
                # the runner's RequestState rows propose reads
                last_sampled=torch.zeros(R, 1, dtype=i64, device=device),
                next_prefill_tokens=torch.zeros(1, R, dtype=i32, device=device))
        return made["s"]

    for reqs in batch_sizes(R):
        def call(reqs=reqs):
            s = state()
            tokens = reqs * (1 + S)
            t = s.target
            batch = types.SimpleNamespace(num_reqs=reqs, input_ids=t.input_ids[:tokens],
                                          positions=t.positions[:tokens],
                                          idx_mapping=torch.zeros(reqs, dtype=i64, device=device),
                                          query_start_loc=t.query_start_loc[:reqs + 1], seq_lens=t.seq_lens[:reqs])
            num_sampled = torch.ones(reqs, dtype=i32, device=device)  # get_num_sampled_and_rejected's
            num_rejected = torch.empty_like(num_sampled)
            drafter.prepare_prefill_inputs(s.last_token_indices, s.current_draft_step, s.input_buffers, batch,
                                           num_sampled, num_rejected, s.last_sampled, s.next_prefill_tokens, R)
            logits = lambda: torch.zeros(reqs, r.vocab_size, dtype=dtype, device=device)  # noqa: E731
            argmax.greedy_argmax(logits())  # _prefill's sample_draft
            if S <= 1:
                return
            drafter.TargetDependentARSpeculator._prepare_decode_inputs(s, batch, num_rejected, reqs, False, None)
            for _ in range(1, S):  # _decode
                out = torch.zeros(reqs, d.hidden_size, dtype=dtype, device=device)  # the draft model's hidden states
                drafter.update_draft_inputs(argmax.greedy_argmax(logits()), s.current_draft_step, out,
                                            s.draft_tokens, s.hidden_states, s.input_buffers,
                                            s.sample_src_positions, reqs, s.max_model_len_gpu, S,
                                            advance_draft_positions=s.advance_draft_positions)

        yield f"drafter[mtp,reqs={reqs},num_spec={S},hidden={d.hidden_size}]", call
