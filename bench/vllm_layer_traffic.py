"""Zero compiles, JIT builds and autotune benchmarks for vLLM's Kimi-Linear KDA layer under independent layer-level
traffic, fresh processes (H200).

    python3 bench/vllm_layer_traffic.py --bundle BUNDLE [--vllm-path DIR] [--seeds 1,2,3,4,5] [--expect-zero] [--out JSON]

The traffic is ``tests/traffic/vllm_layer.py``: server steps of vLLM 0.34.0's real ``KimiGatedDeltaNetAttention``
(the wheel's file, ``--vllm-path``: ``.ci/setup``'s ``build/vllm``) with its state bound as the model runner binds
it and ``GDNAttentionMetadata`` as vLLM's builder fills it, written independently of the provider
(``prewarm.providers.vllm.layer``, which this bench never imports); ``tests/test_vllm_layer.py`` runs the same
generator on fake tensors against the plan. Each step draws its make-up (prefill, chunked prefill with prefix state,
decodes beside prefills, decode eager or CUDA-graph padded, spec verify uniform or ragged, spec beside decodes or
prefills), the request count (a seeded permutation of 1..max_num_seqs: every count within a process of enough
steps), odd lengths, the mamba page size.

For each seed: ``prewarm install BUNDLE`` into a fresh node dir, then a fresh process with ``TRITON_CACHE_DIR`` = that
dir, ``TRITON_CACHE_AUTOTUNING=1``, under ``prewarm guard`` (warn, armed at import, a metrics file: its JIT build
count) counts every Triton compile (Triton's compilation listener), every autotune benchmark and every JIT build.
Writes ``{"runs": [...], "coverage": {...}}`` after every process; exits 1 if a process failed, and with
``--expect-zero`` if any process compiled, built or benchmarked, ran unguarded, or the runs missed a step kind or a
request count.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_traffic import drawn_steps, vllm_bench  # noqa: E402


def child(args) -> dict:
    from traffic.vllm_layer import calls

    head, drawn, probes = drawn_steps(args, calls)
    return {**head, "calls_by_kind": dict(Counter(d["kind"] for d in drawn)),
            "request_counts": sorted({d["requests"] for d in drawn}), "pages": sorted({str(d["page"]) for d in drawn}),
            "graph_padded": sum(d["graph"] for d in drawn), "with_prefix": sum(bool(d["prefix"]) for d in drawn),
            **_jit_builds(), **probes.snapshot(), **probes.details()}


def _jit_builds() -> dict:
    """The guard's count of builds past Triton in this process (its metrics file)."""
    from prewarm.node import guard
    from prewarm.node.metrics import JIT_BUILDS, TEXTFILE, read

    if not os.environ.get(TEXTFILE):
        return {"guarded": guard.armed()}
    built = read(os.environ[TEXTFILE])[0].get(JIT_BUILDS, {}) if Path(os.environ[TEXTFILE]).exists() else {}
    return {"guarded": guard.armed(), "jit_builds": int(sum(built.values())), "jit_built": built}


def coverage(runs: list[dict], spec: dict) -> dict:
    """What the runs saw together: step kinds, request counts 1..max_num_seqs, pages."""
    import random

    from traffic.vllm_layer import _Steps

    serving = spec.get("serving", {})
    top = serving.get("max_running_requests") or max(serving.get("decode_batch_buckets") or [1])
    kinds = {k for r in runs for k in r.get("calls_by_kind", {})}
    counts = set().union(*(r.get("request_counts", []) for r in runs))
    wanted = _Steps(spec, random.Random(0), "cpu").kinds
    return {"max_num_seqs": top, "kinds": sorted(kinds), "request_counts_seen": len(counts),
            "missed": {k: v for k, v in {"kinds": sorted(set(wanted) - kinds),
                                         "request_counts": sorted(set(range(1, top + 1)) - counts)}.items() if v}}


def said(run: dict) -> str:
    return (f"{run['compiles']} compiles, {run['autotune_benchmarks']} autotune benchmarks, JIT builds "
            f"{run.get('jit_builds', '-')}, guarded {run.get('guarded')}, {run['cache_hits']} disk hits, "
            f"{run['calls']} steps ({run['calls_by_kind']}), {len(run['request_counts'])} request counts, "
            f"first step {run['first_step_s']} s")


if __name__ == "__main__":
    sys.exit(vllm_bench(Path(__file__), __doc__, "vllm_layer_traffic", "vllm-layer", 5, child, coverage, said,
                        guarded=True))
