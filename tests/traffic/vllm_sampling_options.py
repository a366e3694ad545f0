"""Seeded engine steps of vLLM 0.34.0's V2 sampler and MTP rejection sampler under per-request ``SamplingParams``
options (greedy / temperature / explicit seed, top-k, top-p, min-p, logit bias, allowed token ids, min tokens with
stop ids, bad words, logprobs and logprob token ids, prompt logprobs and prompt logprob token ids, a structured
output's grammar bitmask), for the Kimi-Linear H200 manifest (``max_running_requests`` requests at most, MTP
``draft_widths``, the model's vocab).

Written only from vLLM's own sources (``vllm/v1/worker/gpu/sample/``: sampler.py, states.py, logit_bias.py,
bad_words.py, logprob.py, prompt_logprob.py, thinking_budget.py, gumbel.py, min_p.py; ``vllm/v1/sample/ops/
topk_topp_sampler.py``; ``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``; ``vllm/v1/worker/gpu/
structured_outputs.py``; ``vllm/v1/worker/gpu/buffer_utils.py``; ``vllm/sampling_params.py``), never from
``prewarm.providers.vllm`` nor the other vLLM traffic modules. Every kernel is reached through vLLM's own function
(``apply_logit_bias``, ``apply_bad_words``, ``apply_temperature``, ``apply_min_p``, ``apply_top_k_top_p``,
``gumbel_sample``, ``compute_topk_scores``, ``compute_token_logprobs``, ``get_prompt_logprobs_token_ids``,
``compute_prompt_logprobs_with_chunking``, ``gather_draft_sampled``, ``rejection_sample``) with the arguments its
caller builds; the callers are methods of state classes that need the serving stack (``Sampler``, ``SamplingStates``,
``LogitBiasState``, ``BadWordsState``, ``RejectionSampler``, ``PromptLogprobsWorker``), so their host decisions
(which launch, with which tables) are transcribed below, each naming its file and function. Three launches are
transcribed whole, as their methods make them: ``StagedWriteTensor.apply_write`` (buffer_utils.py),
``StructuredOutputsWorker.apply_grammar_bitmask`` (its copy stream and pinned mapping) and
``RejectionSampler._get_logprobs_tensors``' flattening.

Stand-ins: vLLM's ``UvaBackedTensor`` (a pinned host array seen by the GPU through UVA) is a device tensor of the
same dtype and shape, as its non-UVA fallback (``buffer_utils.NonUvaBuffer``) makes it, beside a host numpy array
(the state's ``.np``); a ``StagedWriteTensor``'s ``apply_write`` is transcribed with its write indices, starts,
cumulative lengths (int32) and contents (the table's dtype) as device tensors, as its ``UvaBufferPool`` hands them
without UVA. (The real classes call ``.numpy()`` on their host tensors, which fake tensors refuse.) Values are
those of a real run (token ids inside the vocab, request slots inside ``max_num_reqs``, each option table's counts
matching its rows, bad words' cumulative offsets, positions and lengths inside ``max_model_len``), so the same calls
can run on a GPU (not yet run on one).

Deployment facts read from the sources: the sampler copies the bf16 model logits to fp32 only when a request needs
processing (``Sampler.apply_sampling_params``); greedy requests have top-k / top-p / min-p reset
(``SamplingParams.__post_init__``); top-k / top-p go to FlashInfer's fused sampler (not Triton) when
``VLLM_USE_FLASHINFER_SAMPLER`` leaves it on and no request in the batch is greedy or explicitly seeded
(``Sampler.sample``): the step draws that switch; the rejection sampler always applies top-k / top-p through Triton
(``RejectionSampler._verify`` -> ``apply_sampling_params`` without ``skip_top_k_top_p``); logprobs are of the raw
bf16 logits (``logprobs_mode`` ``raw_logprobs``, the default), at most ``max_logprobs`` = 20 (ModelConfig's default;
``SamplingParams`` refuses more, also for prompt logprobs and prompt logprob token ids per row; logprob token ids
have their own limit, 128, and a request setting both has ``logprobs`` = their count); the grammar bitmask's
``MASK_STRIDE`` is the runner's ``decode_query_len`` (draft width with MTP, else 1).

Not driven (named for the reader): thinking budget (``ThinkingBudgetState`` is enabled only with a reasoning
config's start / end token ids, i.e. ``--reasoning-parser``, which the manifest's launch line does not pass: its
constexprs are the parser's token-id lengths); penalties (the other model-level traffic's); ``--use-fp64-gumbel``,
the NaN counter, trace replay, watermarking, the rejection sampler's other methods (synthetic, block, FLy) and
adaptive verification, which no ``SamplingParams`` option selects. The rejection sampler's request chunking
(``_verify_in_chunks``) never splits this deployment's batches (asserted per step), so no sliced views reach it.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Iterator

from traffic import Call, cycle, short

AXES = ("seed", "top_k", "top_p", "min_p", "allowed", "bias", "min_tokens", "grammar", "bad_words", "logprobs",
        "logprob_ids", "prompt_logprobs", "prompt_logprob_ids")
DEFAULTS = {"temperature": 1.0, "seed": None, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "allowed": 0, "bias": 0,
            "min_tokens": 0, "grammar": False, "bad_words": [], "logprobs": None, "logprob_ids": 0,
            "prompt_logprobs": None, "prompt_logprob_ids": 0}  # SamplingParams' (a call's ``options`` lists the rest)
PROCESSING_AXES = ("top_k", "top_p", "min_p", "allowed", "bias", "min_tokens", "bad_words")  # need the fp32 copy
TEMPERATURE_MODES = ("greedy", "sampled", "mixed", "plain")  # plain: greedy or 1.0, nothing to process
SPLIT_MAX_BATCH = 64  # topk_topp_triton.py _SPLIT_MAX_BATCH: the split top-p pipeline's batches
MAX_LOGPROBS = 20  # vllm/config/model.py ModelConfig.max_logprobs default (logprobs, prompt logprobs and their ids)
# the deployment's --max-logprobs where its launch line sets one ([spec.vllm] max_logprobs; -1: no cap, the vocabulary)
MAX_LOGPROB_TOKEN_IDS = 128  # sampling_params.py: logprob_token_ids' own limit (not max_logprobs)
MAX_SEQ = 4096  # the sequence lengths drawn (values, not keys)


@dataclass(frozen=True)
class Envelope:
    vocab: int
    max_reqs: int
    widths: tuple
    max_model_len: int
    max_tokens: int
    max_logprobs: int  # what SamplingParams lets a request ask (ModelConfig.max_logprobs; -1: the vocabulary)

    @classmethod
    def of(cls, spec: dict) -> "Envelope":
        serving, v = spec["serving"], spec["vllm"]
        return cls(vocab=v["vocab_size"], max_reqs=serving["max_running_requests"],
                   widths=tuple(serving.get("draft_widths") or ()), max_model_len=v["max_model_len"],
                   max_tokens=serving["max_prefill_tokens"],
                   max_logprobs=v["vocab_size"] if v.get("max_logprobs", MAX_LOGPROBS) < 0
                   else v.get("max_logprobs", MAX_LOGPROBS))


def kinds(spec: dict) -> list[str]:
    """The kinds of step :func:`calls` draws: the Sampler's (a step with no drafts: all prefill, or no MTP) and, per
    MTP draft width, the RejectionSampler's (model_runner.py sample)."""
    return ["sampler"] + [f"rejection_w{w}" for w in Envelope.of(spec).widths]


def step_cycle(spec: dict) -> int:
    """How many steps meet every (kind, batch class, temperature mode, fused sampler switch, top-p) once."""
    return len(kinds(spec)) * 2 * len(TEMPERATURE_MODES) * 2 * 2


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded sampling steps within ``spec``'s envelope, tensors on ``device`` (drawn when made, run when
    called)."""
    t = _Traffic(Envelope.of(spec), random.Random(seed), device)
    for i in range(n):
        yield t.draw(i)


def _offsets(words: list[int]) -> list[int]:
    """BadWordsState.add_request: a request's bad words' cumulative offsets, from 0."""
    out = [0]
    for n in words:
        out.append(out[-1] + n)
    return out


def _uses_bias(r: dict) -> bool:
    """LogitBiasState.add_request's return: allowed token ids, a logit bias, or min tokens with stop ids."""
    return bool(r["allowed"] or r["bias"] or (r["min_tokens"] and r["stop_ids"]))


def _may_mask(r: dict, vocab: int) -> bool:
    """Sampler.add_request's ``may_mask``: SamplingStates.masks_logits (a sampled request's min-p, top-k, top-p) or
    a logits processor that may set -inf (logit bias, bad words; penalties are not drawn)."""
    masks = r["temperature"] != 0.0 and (r["min_p"] != 0.0 or 0 < r["top_k"] < vocab or r["top_p"] != 1.0)
    return masks or _uses_bias(r) or bool(r["bad_words"])


def _needs(r: dict, vocab: int) -> bool:
    """Sampler.add_request's ``needs_logits_processing``: SamplingStates.add_request's return (a temperature other
    than 0 and 1, or a sampled request's filters) or ``may_mask``."""
    return (r["temperature"] not in (0.0, 1.0)) or _may_mask(r, vocab)


class _Traffic:
    def __init__(self, e: Envelope, rng: random.Random, device: str):
        self.e, self.rng, self.device = e, rng, device
        # every (kind, batch class, temperature mode, fused sampler switch: a rejection step ignores it, top-p on or
        # off) once per :func:`step_cycle` steps: the split top-p pipeline's small batches (a sampled step with top-p
        # on), the sampler's fused / Triton paths and the unprocessed bf16 logits are met within that many steps,
        # whatever the seed
        self.shapes = cycle(rng, list(itertools.product([None] + list(e.widths), ("small", "large"),
                                                        TEMPERATURE_MODES, (True, False), (True, False))))
        self.batches = {"small": cycle(rng, range(1, min(SPLIT_MAX_BATCH, e.max_reqs) + 1)),
                        "large": cycle(rng, range(min(SPLIT_MAX_BATCH, e.max_reqs - 1) + 1, e.max_reqs + 1))}
        self.axes = {axis: cycle(rng, [True, False]) for axis in AXES}
        self.servers = cycle(rng, list(e.widths) or [1])

    # ---------------------------------------------------------------- draws

    def profile(self, temperature: str, top_p: bool) -> dict:
        """The options a step's batch mixes: each axis on or off for the step (so a batch of any size meets top-k
        alone, top-p alone, both, neither...), greedy / sampled / mixed temperatures, and the step's logprob widths
        (a batch's largest request sets the kernels' constexprs)."""
        rng = self.rng
        p = {axis: next(self.axes[axis]) for axis in AXES}
        p["temperature"], p["top_p"] = temperature, top_p
        if p["temperature"] == "plain":  # nothing to process: the sampler samples the model's bf16 logits
            p.update({axis: False for axis in PROCESSING_AXES})
        p["logprobs_n"] = rng.randint(0, self.e.max_logprobs)
        p["logprob_ids_n"] = rng.choice([rng.randint(1, self.e.max_logprobs)] * bool(self.e.max_logprobs)
                                        + [rng.randint(1, MAX_LOGPROB_TOKEN_IDS)])
        p["prompt_logprobs_n"] = rng.randint(0, self.e.max_logprobs)
        return p

    def request(self, p: dict, first: bool) -> dict:
        """One request's SamplingParams options within the step's profile and vLLM's limits (logit_bias.py
        MAX_NUM_ALLOWED_TOKEN_IDS / MAX_NUM_LOGIT_BIAS_TOKENS / MAX_NUM_STOP_TOKEN_IDS, envs.py
        VLLM_MAX_NUM_BAD_WORDS / VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, sampling_params.py max_logprobs)."""
        rng, V = self.rng, self.e.vocab

        def some(axis, value, default):  # an axis on for the step: its first request uses it, others may
            return value if p[axis] and (first or rng.random() < 0.6) else default

        temps = {"greedy": [0.0], "sampled": [1.0, 0.7, 1.3], "mixed": [0.0, 1.0, 0.7],
                 "plain": [0.0, 1.0]}[p["temperature"]]
        r: dict = {"temperature": rng.choice(temps), "seed": some("seed", rng.randrange(1 << 31), None)}
        if first and p["temperature"] == "sampled":
            r["temperature"] = 0.7
        greedy = r["temperature"] == 0.0  # SamplingParams.__post_init__ resets the filters of a greedy request
        # a sampled step's first request with top-p alone (has_topp_only_rows: the split pipeline of small batches)
        topp_only = first and p["temperature"] == "sampled" and p["top_p"]
        r["top_k"] = 0 if greedy or topp_only else some("top_k", rng.choice([rng.randint(1, 1000), V - 1]), 0)
        r["top_p"] = 1.0 if greedy else some("top_p", rng.choice([0.9, 0.5]), 1.0)
        r["min_p"] = 0.0 if greedy else some("min_p", 0.05, 0.0)
        r["allowed"] = some("allowed", rng.randint(1, 1024), 0)
        r["bias"] = some("bias", rng.randint(1, 1024), 0)
        r["min_tokens"] = some("min_tokens", rng.randint(1, 64), 0)
        r["stop_ids"] = rng.randint(1, 128)  # all_stop_token_ids: the stop ids and EOS
        r["grammar"] = some("grammar", True, False)
        words = some("bad_words", rng.randint(1, 128), 0)
        r["bad_words"] = [rng.randint(1, 1024 // max(words, 1)) for _ in range(words)]
        r["logprobs"] = some("logprobs", rng.randint(0, p["logprobs_n"]), None)
        r["logprob_ids"] = some("logprob_ids", rng.randint(1, p["logprob_ids_n"]), 0)
        if r["logprob_ids"] and r["logprobs"] is not None:  # SamplingParams: both set, logprobs = len(ids)
            r["logprobs"] = r["logprob_ids"] if r["logprob_ids"] <= self.e.max_logprobs else None
        r["prompt_logprobs"] = some("prompt_logprobs", rng.randint(0, p["prompt_logprobs_n"]), None)
        r["prompt_logprob_ids"] = some("prompt_logprob_ids", rng.randint(1, self.e.max_logprobs), 0) \
            if self.e.max_logprobs else 0  # ids per row, at most max_logprobs
        return r

    def draw(self, i: int) -> Call:
        width, size, temperature, fused, top_p = next(self.shapes)
        bs = next(self.batches[size])
        profile = self.profile(temperature, top_p)
        reqs = [self.request(profile, j == 0) for j in range(bs)]
        d: dict = {"kind": "sampler" if width is None else f"rejection_w{width}", "batch": bs,
                   "width": width or 1, "temperature": temperature, "fused": fused}
        # the sampler works on the model's bf16 logits, or on their fp32 copy where any request needs processing
        d["logits"] = "float32" if any(_needs(r, self.e.vocab) for r in reqs) else "bfloat16"
        # the runner's decode_query_len (model_runner.py: num_speculative_steps + 1 new token): the grammar
        # bitmask's MASK_STRIDE in every step of a server, a step with drafts or not
        d["mask_stride"] = next(self.servers)
        # with drafts a request verifies width rows (one where its prefill ends); a step with no drafts (all prefill,
        # or no MTP) is the Sampler's (model_runner.py sample: num_draft_tokens == 0), one row each
        rng = self.rng
        d["prefill"] = [bool(j or width is None) and rng.random() < 0.3 for j in range(bs)]  # a chunk of its prompt
        d["rows"] = [1 if width is None or prefill or (j and rng.random() < 0.2) else width
                     for j, prefill in enumerate(d["prefill"])]
        # the scheduled tokens (--max-num-batched-tokens): a prefill chunk's, or the verified rows
        budget = max(1, (self.e.max_tokens - sum(d["rows"])) // max(1, sum(d["prefill"])))
        d["qlens"] = [rng.randint(1, min(budget, 2048)) if prefill else n
                      for prefill, n in zip(d["prefill"], d["rows"])]
        d["new"] = [self.rng.random() < 0.5 for _ in range(bs)]  # added this step: its tables are staged
        d["slots"] = self.rng.sample(range(self.e.max_reqs), bs)
        d["options"] = sorted({k for r in reqs for k, v in r.items() if k in DEFAULTS and v != DEFAULTS[k]})
        label = f"{d['kind']}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items()
                                               if k not in ("kind", "rows", "prefill", "new", "slots", "qlens"))
        label += "]"
        return Call(label, lambda: self.step(d, reqs), d)

    # ---------------------------------------------------------------- tensors

    def torch(self):
        import torch

        return torch

    def ids(self, values, dtype: str):
        """A host-known tensor (vLLM's host code made it from numpy; a GPU run reads its values)."""
        from prewarm.providers.capture import index_tensor

        return index_tensor(list(values), getattr(self.torch(), dtype), self.device)

    def zeros(self, shape, dtype: str):
        torch = self.torch()
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device)

    # ---------------------------------------------------------------- one step

    def step(self, d: dict, reqs: list[dict]) -> None:
        import numpy as np

        torch, e = self.torch(), self.e
        R, V, bs, slots = e.max_reqs, e.vocab, d["batch"], d["slots"]
        idx_np = np.array(slots)
        rows = d["rows"]
        num_logits = sum(rows)
        cu = [0]
        for n in rows:
            cu.append(cu[-1] + n)
        idx_mapping = self.ids(slots, "int64")  # model_runner.py prepare_inputs: async_tensor_h2d(..., int64)
        expanded = self.ids([s for s, n in zip(slots, rows) for _ in range(n)], "int64")  # idx_mapping.new_empty
        local_pos = self.ids([j for n in rows for j in range(n)], "int32")
        cu_num_logits = self.ids(cu, "int32")

        # the option tables, host side, as each state's add_request fills them
        temp, top_k = np.ones(R, np.float32), np.full(R, V, np.int32)
        top_p, min_p, seeded = np.ones(R, np.float32), np.zeros(R, np.float32), np.zeros(R, bool)
        temp[idx_np] = [r["temperature"] for r in reqs]
        top_k[idx_np] = [r["top_k"] if 0 < r["top_k"] <= V else V for r in reqs]  # SamplingStates.add_request
        top_p[idx_np] = [r["top_p"] for r in reqs]
        min_p[idx_np] = [r["min_p"] for r in reqs]
        seeded[idx_np] = [r["seed"] is not None for r in reqs]
        use_bias = [_uses_bias(r) for r in reqs]
        restore = [bool(r["min_tokens"] and r["grammar"]) for r in reqs]
        num_bad = [len(r["bad_words"]) for r in reqs]
        # SamplingStates.add_request / masks_logits, Sampler.add_request: needs_logits_processing
        needs = [_needs(r, V) for r in reqs]
        may_mask = [_may_mask(r, V) for r in reqs]

        # state tables on the device (each state's __init__: shapes and dtypes)
        from vllm.envs import VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, VLLM_MAX_NUM_BAD_WORDS
        from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

        t = {"allowed": self.zeros((R, 1024), "int32"), "bias_ids": self.zeros((R, 1024), "int32"),
             "bias": self.zeros((R, 1024), "float32"), "stop": self.zeros((R, 128), "int32"),
             "bad_ids": self.zeros((R, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS), "int32"),
             "bad_offsets": self.zeros((R, VLLM_MAX_NUM_BAD_WORDS + 1), "int32"),
             "logprob_ids": self.zeros((R, MAX_LOGPROB_TOKEN_IDS), "int32")}
        # the rows earlier steps wrote (token ids 0 and biases 0.0 are valid values; a bad word's offsets must be
        # its cumulative lengths, which the kernel reads)
        for r, slot in zip(reqs, slots):
            if r["bad_words"]:
                t["bad_offsets"][slot, :len(r["bad_words"]) + 1] = self.ids(_offsets(r["bad_words"]), "int32")
        # the UvaBackedTensors' values, host side (each add_request), as the device reads them
        host = {name: np.zeros(R, np.int32) for name in (
            "num_allowed", "num_bias", "min_lens", "num_stop", "restore", "num_bad", "num_logprob_ids", "prompt_len",
            "prefill_len", "total_len")}
        for j, (r, slot) in enumerate(zip(reqs, slots)):
            prompt = self.rng.randint(1, MAX_SEQ)
            host["prompt_len"][slot] = host["prefill_len"][slot] = prompt
            host["total_len"][slot] = prompt + (0 if d["prefill"][j] else self.rng.randint(0, MAX_SEQ))
            host["num_allowed"][slot], host["num_bias"][slot] = r["allowed"], r["bias"]
            host["min_lens"][slot] = prompt + r["min_tokens"]
            host["num_stop"][slot] = r["stop_ids"] if r["min_tokens"] else 0
            host["restore"][slot] = restore[j]
            host["num_bad"][slot], host["num_logprob_ids"][slot] = len(r["bad_words"]), r["logprob_ids"]
        seeds = [self.rng.randrange(-(1 << 63), 1 << 63) for _ in range(R)]
        uva = {name: self.ids(values.tolist(), "int32") for name, values in host.items()}
        uva.update(temperature=self.ids(temp.tolist(), "float32"), top_k=self.ids(top_k.tolist(), "int32"),
                   top_p=self.ids(top_p.tolist(), "float32"), min_p=self.ids(min_p.tolist(), "float32"),
                   seeds=self.ids(seeds, "int64"))
        self.staged_writes(d, reqs, t)

        # the step's inputs (InputBatch): int32 input ids, int64 positions and logits indices
        num_tokens = sum(d["qlens"])
        input_ids = self.zeros(num_tokens, "int32")
        positions = self.ids([self.rng.randint(0, MAX_SEQ) for _ in range(num_tokens)], "int64")
        logits_indices = self.ids(sorted(self.rng.sample(range(num_tokens), num_logits)), "int64")
        model_logits = torch.empty((num_logits, V), dtype=torch.bfloat16, device=self.device)  # compute_logits'

        # model_runner.py sample: the grammar bitmask on the model's logits (StructuredOutputsWorker)
        grammar = [i for i, r in enumerate(reqs) if r["grammar"]]
        if grammar:
            self.grammar_bitmask(model_logits, grammar, d["mask_stride"], cu_num_logits)

        if d["kind"] == "sampler":
            pos = positions[logits_indices]
            ids_in = input_ids[logits_indices]
            processed = self.apply_sampling_params(model_logits, expanded, idx_mapping, idx_np, pos, ids_in,
                                                   local_pos, reqs, needs, use_bias, restore, num_bad, temp, min_p,
                                                   uva, t, skip_top_k_top_p=True)
            # Sampler.sample / get_top_k_top_p / _sample_random
            do_k, do_p = bool(np.any(top_k[idx_np] != V)), bool(np.any(top_p[idx_np] != 1.0))
            fused = d["fused"] and (do_k or do_p) and not np.any(temp[idx_np] == 0.0) and not np.any(seeded[idx_np])
            if fused:
                sampled = torch.zeros(num_logits, dtype=torch.int64, device=self.device)  # FlashInfer's module
            else:
                from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
                from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

                k = uva["top_k"][expanded] if do_k else None
                p = uva["top_p"][expanded] if do_p else None
                only_p = bool(do_p and np.any((top_k[idx_np] >= V) & (top_p[idx_np] < 1.0)))
                if k is not None or p is not None:
                    processed = apply_top_k_top_p(processed, k, p, has_topp_only_rows=only_p)
                sampled = gumbel_sample(processed, expanded, uva["temperature"], uva["seeds"], pos,
                                        apply_temperature=False, is_drafting=False, use_fp64=False)
            self.logprobs(model_logits, sampled, reqs, expanded, None, t, uva)
        else:
            from vllm.v1.worker.gpu.spec_decode.rejection_sampler import (
                _flatten_sampled_kernel, gather_draft_sampled, get_max_chunk_logits)
            from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

            # RejectionSampler._verify_in_chunks: one chunk holds the batch (max_running_requests x width rows fit
            # its 1 GiB of fp32 logits at this vocab), so its slices are the whole tensors
            assert num_logits <= get_max_chunk_logits(V), (num_logits, V)
            draft_sampled, pos = gather_draft_sampled(input_ids, positions, logits_indices, expanded, local_pos,
                                                      uva["prefill_len"])
            processed = self.apply_sampling_params(model_logits, expanded, idx_mapping, idx_np, pos, draft_sampled,
                                                   local_pos, reqs, needs, use_bias, restore, num_bad, temp, min_p,
                                                   uva, t, skip_top_k_top_p=False, top_k=top_k, top_p=top_p)
            sampled, num_sampled = rejection_sample(
                processed, None, draft_sampled, cu_num_logits, pos, idx_mapping, expanded, local_pos,
                uva["temperature"], uva["seeds"], d["width"] - 1, None, use_fp64=False,
                use_block_verification=False, skip_masked_vocab_blocks=bool(any(may_mask)))
            if self.wants_logprobs(reqs):  # RejectionSampler._get_logprobs_tensors
                flat = torch.zeros(num_logits, dtype=sampled.dtype, device=sampled.device)
                _flatten_sampled_kernel[(bs,)](flat, sampled, sampled.stride(0), num_sampled, cu_num_logits,
                                               num_warps=1)
                self.logprobs(model_logits, flat, reqs, expanded, cu if num_logits != bs else None, t, uva)
        # model_runner.py: the prompt logprobs of the requests whose prompt this step holds, with or without MTP
        self.prompt_logprobs(d, reqs, idx_mapping)

    def wants_logprobs(self, reqs) -> bool:
        return any(r["logprobs"] is not None or r["logprob_ids"] for r in reqs)

    def staged_writes(self, d: dict, reqs: list[dict], t: dict) -> None:
        """Each new request's staged rows (LogitBiasState / BadWordsState / LogprobTokenIdsState.add_request), then
        ``StagedWriteTensor.apply_write`` per table (buffer_utils.py), transcribed."""
        from vllm.v1.worker.gpu.buffer_utils import _WRITE_BLOCK_SIZE, _apply_write_kernel, _num_write_chunks

        torch = self.torch()
        writes: dict = {name: [] for name in t}  # table -> [(row, length)]
        offsets = []  # the bad words' offsets rows, in order (the only contents the kernels read as more than ids)
        for r, slot, new in zip(reqs, d["slots"], d["new"]):
            if not new:
                continue
            if r["allowed"]:
                writes["allowed"].append((slot, r["allowed"]))
            if r["bias"]:
                writes["bias_ids"].append((slot, r["bias"]))
                writes["bias"].append((slot, r["bias"]))
            if r["min_tokens"]:
                writes["stop"].append((slot, r["stop_ids"]))
            if r["bad_words"]:
                writes["bad_ids"].append((slot, sum(r["bad_words"])))
                writes["bad_offsets"].append((slot, len(r["bad_words"]) + 1))
                offsets += _offsets(r["bad_words"])
            if r["logprob_ids"]:
                writes["logprob_ids"].append((slot, r["logprob_ids"]))
        for name, rows in writes.items():
            if not rows:
                continue
            gpu = t[name]
            n, total = len(rows), sum(length for _, length in rows)
            cu, acc = [], 0
            for _, length in rows:
                acc += length
                cu.append(acc)
            indices = self.ids([row for row, _ in rows], "int32")
            starts = self.ids([0] * n, "int32")
            cu_lens = self.ids(cu, "int32")
            contents = self.ids(offsets, "int32") if name == "bad_offsets" else \
                torch.zeros(total, dtype=gpu.dtype, device=self.device)  # token ids 0, biases 0.0
            _apply_write_kernel[(n, _num_write_chunks(max(length for _, length in rows)))](
                gpu, gpu.stride(0), indices, starts, contents, cu_lens, None, BLOCK_SIZE=_WRITE_BLOCK_SIZE,
                MULTI_GROUP=False)

    def grammar_bitmask(self, logits, grammar: list[int], mask_stride: int, cu_num_logits) -> None:
        """StructuredOutputsWorker.apply_grammar_bitmask (structured_outputs.py), transcribed: its int32 bitmask
        rows ``[max_num_logits, cdiv(vocab, 32)]`` sliced to the masks, the int32 row mapping (request index x
        ``mask_stride`` + position), the input batch's ``cu_num_logits``."""
        from vllm.v1.worker.gpu.structured_outputs import GRAMMAR_BITMASK_BLOCK_SIZE, _apply_grammar_bitmask_kernel

        V = logits.shape[-1]
        mapping = [i * mask_stride + p for i in grammar for p in range(mask_stride)]
        bitmask = self.zeros((self.e.max_reqs * mask_stride, (V + 31) // 32), "int32")[:len(mapping)]
        indices = self.ids(mapping, "int32")
        grid = (len(mapping), (V + GRAMMAR_BITMASK_BLOCK_SIZE - 1) // GRAMMAR_BITMASK_BLOCK_SIZE)
        _apply_grammar_bitmask_kernel[grid](logits, logits.stride(0), indices, cu_num_logits, bitmask,
                                            bitmask.stride(0), V, MASK_STRIDE=mask_stride,
                                            BLOCK_SIZE=GRAMMAR_BITMASK_BLOCK_SIZE)

    def apply_sampling_params(self, logits, expanded, idx_mapping, idx_np, pos, input_ids, local_pos, reqs, needs,
                              use_bias, restore, num_bad, temp, min_p, uva, t, skip_top_k_top_p: bool,
                              top_k=None, top_p=None):
        """Sampler.apply_sampling_params (sampler.py) with LogitBiasState.apply, BadWordsState.apply and the
        SamplingStates' temperature / min-p / top-k / top-p (states.py), host decisions transcribed."""
        import numpy as np

        torch = self.torch()
        if not any(needs):
            return logits
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        if any(use_bias):
            from vllm.v1.worker.gpu.sample.logit_bias import apply_logit_bias

            apply_logit_bias(logits, expanded, pos, uva["num_allowed"], t["allowed"], uva["num_bias"],
                             t["bias_ids"], t["bias"], uva["min_lens"], uva["num_stop"], uva["restore"], t["stop"],
                             bool(any(restore)))
        if max(num_bad) > 0:
            from vllm.v1.worker.gpu.sample.bad_words import apply_bad_words

            all_token_ids = self.zeros((self.e.max_reqs, self.e.max_model_len), "int32")  # RequestState's
            apply_bad_words(logits, expanded, t["bad_ids"], t["bad_offsets"], uva["num_bad"], all_token_ids,
                            uva["prompt_len"], uva["total_len"], input_ids, local_pos, max(num_bad))
        if not np.all((temp[idx_np] == 0.0) | (temp[idx_np] == 1.0)):
            from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

            apply_temperature(logits, expanded, uva["temperature"])
        if not np.all(min_p[idx_np] == 0.0):
            from vllm.v1.worker.gpu.sample.min_p import apply_min_p

            apply_min_p(logits, expanded, uva["min_p"])
        if skip_top_k_top_p:
            return logits
        V = self.e.vocab
        do_k, do_p = bool(np.any(top_k[idx_np] != V)), bool(np.any(top_p[idx_np] != 1.0))
        if not (do_k or do_p):
            return logits
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        only_p = bool(do_p and np.any((top_k[idx_np] >= V) & (top_p[idx_np] < 1.0)))
        return apply_top_k_top_p(logits, uva["top_k"][expanded] if do_k else None,
                                 uva["top_p"][expanded] if do_p else None, has_topp_only_rows=only_p)

    def logprobs(self, logits, sampled, reqs, expanded, cu, t, uva) -> None:
        """Sampler.get_logprobs_dims and compute_topk_scores (logprob.py) on the raw logits."""
        if not self.wants_logprobs(reqs):
            return
        from types import SimpleNamespace

        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        num = max((r["logprobs"] for r in reqs if r["logprobs"] is not None), default=0)
        ids = max(r["logprob_ids"] for r in reqs)
        state = SimpleNamespace(num_token_ids=SimpleNamespace(gpu=uva["num_logprob_ids"]),
                                token_ids=SimpleNamespace(gpu=t["logprob_ids"]))
        compute_topk_scores(logits, num, sampled, cu, logprob_token_ids_state=state, expanded_idx_mapping=expanded,
                            max_per_req_token_ids=ids, logits_mode=False)

    def prompt_logprobs(self, d: dict, reqs: list[dict], idx_mapping) -> None:
        """PromptLogprobsWorker (prompt_logprob.py) for the requests whose prompt this step holds:
        ``compute_prompt_logprobs`` (the int64 prompt token ids, then the model's bf16 ``compute_logits`` in chunks
        into ``compute_topk_scores``) and ``compute_prompt_token_id_logprobs`` (per request, its int64
        ``prompt_logprob_token_ids`` rows from ``prompt_logprob_start``, sliced per 1024-row chunk of this prefill
        chunk: views at the rows' offset, into ``compute_token_logprobs``)."""
        torch, e, rng = self.torch(), self.e, self.rng
        qsl = [0]
        for n in d["qlens"]:
            qsl.append(qsl[-1] + n)
        T = qsl[-1]
        hidden = torch.empty((T, 8), dtype=torch.bfloat16, device=self.device)  # the width is not a kernel's

        def logits_fn(h):  # the model's compute_logits: bf16 logits
            return torch.empty((h.shape[0], e.vocab), dtype=torch.bfloat16, device=self.device)

        wanted = [r["prompt_logprobs"] for r, p in zip(reqs, d["prefill"]) if p and r["prompt_logprobs"] is not None]
        if wanted:
            from vllm.v1.worker.gpu.sample.prompt_logprob import (
                compute_prompt_logprobs_with_chunking, get_prompt_logprobs_token_ids)

            token_ids = get_prompt_logprobs_token_ids(T, self.ids(qsl, "int32"), idx_mapping,
                                                      self.zeros(e.max_reqs, "int32"),
                                                      self.zeros((e.max_reqs, e.max_model_len), "int32"))
            compute_prompt_logprobs_with_chunking(token_ids, hidden, logits_fn, max(wanted), "raw_logprobs")

        for i, (r, prefill) in enumerate(zip(reqs, d["prefill"])):
            if not (prefill and r["prompt_logprob_ids"]):
                continue
            from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
            from vllm.v1.worker.gpu.sample.prompt_logprob import CHUNK_SIZE

            # this chunk's place in its prompt: the first chunk or a later one, ending the prompt or not
            chunk_start = rng.choice([0, rng.randint(1, 5000)])
            chunk_end = chunk_start + d["qlens"][i]
            prompt_len = chunk_end + rng.choice([0, rng.randint(1, 5000)])
            if prompt_len < 2:  # no scored row
                continue
            # prompt_logprob_start: the first row (the default) or a later one
            start = rng.choice([0, rng.randint(0, prompt_len - 2)])
            rows = self.zeros((prompt_len - 1 - start, r["prompt_logprob_ids"]), "int64")  # async_tensor_h2d
            ids_all = rows.clamp_min(0)  # _TokenIdScores(ids.clamp_min(0), ids < 0)
            lo, hi = max(start, chunk_start), min(chunk_end, prompt_len - 1)
            base = qsl[i] - chunk_start
            for a in range(lo, hi, CHUNK_SIZE):
                b = min(a + CHUNK_SIZE, hi)
                compute_token_logprobs(logits_fn(hidden[base + a:base + b]), ids_all[a - start:b - start])
