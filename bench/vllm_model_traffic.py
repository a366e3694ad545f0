"""Zero compiles, JIT builds and autotune benchmarks for Kimi-Linear's model step on vLLM 0.34.0, fresh processes
(H100 / H200): the KDA layer's traffic interleaved with the model's around it.

    python3 bench/vllm_model_traffic.py --bundle BUNDLE [--vllm-path DIR] [--seeds 1,2,3,4,5] [--expect-zero] [--out JSON]

The traffic is ``tests/traffic/vllm_layer.py`` (``bench/vllm_layer_traffic.py``'s: the real
``KimiGatedDeltaNetAttention`` forward in every step make-up), ``tests/traffic/vllm_model.py`` (the MoE's Triton
GEMMs eager and graph-padded, the V2 runner's input preparation, block tables and slot mappings, the Gumbel sampler,
the rejection sampler and the post-step updates) and ``tests/traffic/vllm_step.py`` (the staged writes, the mamba
bookkeeping, the MTP drafter, the sampler's per-request options, the rejection sampler's draft gather),
``tests/traffic/vllm_runner_step.py`` (an engine step of the V2 runner, the KV-block zeroer included) and
``tests/traffic/vllm_sampling_options.py`` (what API requests' sampling options reach: logit bias, bad words,
logprobs, prompt logprobs, Triton top-k / top-p, the grammar bitmask), calls of all five in a seeded order
(``traffic.interleave``), as many of each; all written from vLLM's sources, independently of the providers (which
this bench never imports);
``tests/test_vllm_layer.py`` and ``tests/test_vllm_model.py`` run the same generators on fake tensors against the
plan. vLLM's CUDA ``moe_align_block_size`` (``_moe_C``, built for the server's torch) is not in a device image of
another torch: on a GPU the traffic writes what it writes in torch (``traffic.fill_expert_alignment``: the buffers the
wrapper sized, valid contents; the Triton keys do not depend on them).

Per seed, as ``bench/vllm_layer_traffic.py``: a fresh install of BUNDLE, a fresh guarded process counting every
Triton compile, autotune benchmark and JIT build. Exits 1 if a process failed, and with ``--expect-zero`` if any
compiled, built or benchmarked, ran unguarded, or the runs missed a layer step kind, a request count or a model kind.
"""
from __future__ import annotations

import importlib
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_layer_traffic import _jit_builds  # noqa: E402
from vllm_layer_traffic import coverage as layer_coverage  # noqa: E402
from vllm_traffic import drawn_steps, vllm_bench  # noqa: E402


# the model-level generators interleaved with the layer's (tests/traffic: each has calls() and kinds())
MODEL_TRAFFIC = ("vllm_model", "vllm_step", "vllm_runner_step", "vllm_sampling_options")


def calls(spec: dict, seed: int, n: int, device: str):
    """The layer's ``n`` steps and each model-level generator's ``n``, interleaved."""
    from traffic import interleave, vllm_layer

    return interleave(random.Random(seed), layer=vllm_layer.calls(spec, seed, n, device), **{
        name: importlib.import_module(f"traffic.{name}").calls(spec, seed, n, device) for name in MODEL_TRAFFIC})


def child(args) -> dict:
    args.calls *= 1 + len(MODEL_TRAFFIC)  # as many calls of each model-level generator as layer calls a step
    head, drawn, probes = drawn_steps(args, calls)
    layer = [d for d in drawn if d["traffic"] == "layer"]
    model = [d for d in drawn if d["traffic"] != "layer"]
    return {**head, "calls_by_kind": dict(Counter(d["kind"] for d in layer)),
            "model_calls_by_kind": dict(Counter(d["kind"] for d in model)),
            "request_counts": sorted({d["requests"] for d in layer}), "pages": sorted({str(d["page"]) for d in layer}),
            "graph_padded": sum(d["graph"] for d in layer), "with_prefix": sum(bool(d["prefix"]) for d in layer),
            **_jit_builds(), **probes.snapshot(), **probes.details()}


def coverage(runs: list[dict], spec: dict) -> dict:
    """The layer's coverage (``vllm_layer_traffic.coverage``) and the model kinds the runs saw and missed."""
    out = layer_coverage(runs, spec)
    seen = set().union(*(r.get("model_calls_by_kind", {}) for r in runs))
    wanted = {k for name in MODEL_TRAFFIC for k in importlib.import_module(f"traffic.{name}").kinds(spec)}
    missed = sorted(wanted - seen)
    out["model_kinds"] = sorted(seen)
    if missed:
        out["missed"]["model_kinds"] = missed
    return out


def said(run: dict) -> str:
    return (f"{run['compiles']} compiles, {run['autotune_benchmarks']} autotune benchmarks, JIT builds "
            f"{run.get('jit_builds', '-')}, guarded {run.get('guarded')}, {run['cache_hits']} disk hits, "
            f"{run['calls']} calls (layer {run['calls_by_kind']}, model {run['model_calls_by_kind']}), "
            f"{len(run['request_counts'])} request counts, first step {run['first_step_s']} s")


if __name__ == "__main__":
    sys.exit(vllm_bench(Path(__file__), __doc__, "vllm_model_traffic", "vllm-model", 5, child, coverage, said,
                        guarded=True))
