"""Zero compiles and autotune benchmarks for vLLM's own KDA kernels under independent traffic, fresh processes (H200).

    python3 bench/vllm_traffic.py --bundle BUNDLE [--vllm-path DIR] [--seeds 1,2,3,4,5] [--expect-zero] [--out JSON]

The traffic is ``traffic.vllm_kda.calls``: vLLM 0.34.0's KDA entry points called as its Kimi-Linear
layer (``KimiGatedDeltaNetAttention``) calls them, written independently of the provider's call builder
(``prewarm.providers.vllm.kda``, which this bench never imports); ``tests/test_vllm.py`` runs the same generator on
fake tensors against the plan. Each call draws on its own the batch's make-up (prefill, decode, spec verify, spec
beside either), each index pointer's dtype, prefill sequence counts and lengths up to the token budget, and the decode
batch size as a seeded permutation of 1..the largest batch (``--max-num-seqs``: past the largest CUDA-graph capture
size, batches run eager), so a process of enough calls (the default: 10 steps of 64) sees every size. Each run's row
says what its process drew (``calls_by_kind``, ``decode_batch_sizes``, ``prefill_lengths``, ``index_dtypes``: each
index pointer a call passed -> dtype -> calls); the JSON's ``coverage`` says what the runs saw together against the
manifest's envelope (every decode batch size and those past the capture sizes, odd prefill lengths, both index dtypes
of each pointer, every path) and what they missed.

For each seed: ``prewarm install BUNDLE`` into a fresh node dir, then a fresh process with ``TRITON_CACHE_DIR`` = that
dir and ``TRITON_CACHE_AUTOTUNING=1`` (see :func:`_common.traffic_env`; ``VLLM_TRITON_FORCE_FIRST_CONFIG`` removed:
by default vLLM's autotuners benchmark) counts every compile with Triton's compilation listener and every autotune
benchmark (``autotune_benchmarks``: configs measured by ``Autotuner._bench``; none where the bundle's autotune results
are read). vLLM need not be installed: ``--vllm-path`` (or PYTHONPATH) names a dir holding its package (the kernel
modules; ``.ci/setup``'s ``build/vllm``). ``first_step_s`` starts after torch, the CUDA context and triton are up and
stops when vLLM's kernels are imported and the first ``--calls`` calls have run and the device synchronized. Writes
``{"runs": [{"seed", "compiles", "autotune_benchmarks", ...}], "coverage": {...}}`` after every process; exits 1 if a
process failed, and with ``--expect-zero`` if any process compiled or benchmarked or the runs missed any coverage.
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, child_main, guard_env, import_kernels, init_device, load_spec, parse_seed_options, run_calls,
    server_traffic_parser, server_traffic_start, timed_steps, traffic_env, traffic_runs,
)

DEFAULT_VLLM_MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
# the index pointers each path of the layer passes (names as the traffic's options draw them)
POINTERS = {"prefill": ("query_start_loc",), "decode": ("state_indices",),
            "spec_verify": ("spec_query_start_loc", "spec_state_indices", "num_accepted_tokens")}


def paths_of(kind: str) -> list[str]:
    """The layer's paths a call of the traffic's ``kind`` runs ("spec+decode": the verify and the decode)."""
    return ["spec_verify" if part == "spec" else part for part in kind.split("+")]


# --- the measurement ---------------------------------------------------------------------------------------------


def child(args) -> dict:
    from traffic.vllm_kda import calls

    head, drawn, probes = drawn_steps(args, calls)  # vLLM's import: in the first step
    return {**head, **what_was_drawn(drawn), **probes.snapshot(), **probes.details()}


def drawn_steps(args, calls) -> tuple[dict, list[dict], Probes]:
    """A measuring process's steps of ``calls(spec, seed, n, device)`` (vLLM's import, where the calls make it: in
    the first step): the seed, the first step's figures and the number of calls; each call's options as drawn; the
    probes that counted them."""
    torch = init_device()
    probes = Probes()
    spec = load_spec(Path(args.manifest))
    drawn: list[dict] = []

    def tallied(traffic):
        for call in traffic:
            drawn.append(call.options)
            yield call

    first_step, _ = timed_steps(lambda: tallied(calls(spec, args.seed, args.calls * args.steps, "cuda")),
                                lambda traffic: run_calls(traffic, args.calls, probes, torch.cuda.synchronize),
                                args.steps, probes)
    return {"seed": args.seed, **first_step, "calls": len(drawn)}, drawn, probes


def what_was_drawn(drawn: list[dict]) -> dict:
    """A process's calls by what they drew: kinds, decode batch sizes, prefill lengths, each passed pointer's dtype."""
    dtypes: dict[str, Counter] = defaultdict(Counter)
    for d in drawn:
        for path in paths_of(d["kind"]):
            for pointer in POINTERS[path]:
                dtypes[pointer][d[pointer]] += 1
    return {"calls_by_kind": dict(Counter(d["kind"] for d in drawn)),
            "decode_batch_sizes": sorted({d["decode_batch"] for d in drawn if "decode_batch" in d}),
            "prefill_lengths": sorted({n for d in drawn for n in d.get("lengths", ())}),
            "index_dtypes": {p: dict(sorted(c.items())) for p, c in sorted(dtypes.items())}}


def coverage(runs: list[dict], spec: dict) -> dict:
    """What the runs saw together, against the envelope the traffic draws within (read as the traffic reads it) and
    the manifest's capture sizes (``serving.decode_batch_buckets``); ``missed`` lists what is still to be seen."""
    import_kernels()
    from traffic.vllm_kda import read_spec

    s = read_spec(spec)  # checks the spec, the capture sizes too
    largest_capture = max(spec["serving"].get("decode_batch_buckets", []), default=0)
    batches = set().union(*(r.get("decode_batch_sizes", []) for r in runs))
    odd = {n for r in runs for n in r.get("prefill_lengths", []) if n % 2}
    seen = {p: set().union(*(r.get("index_dtypes", {}).get(p, {}) for r in runs)) for ps in POINTERS.values()
            for p in ps}
    reached = {path for r in runs for kind in r.get("calls_by_kind", {}) for path in paths_of(kind)}
    missed = {"decode_batch_sizes": sorted(set(range(1, s.max_batch + 1)) - batches) if "decode" in s.paths else [],
              "odd_prefill_lengths": "none seen" if "prefill" in s.paths and not odd else "",
              "index_dtypes": {p: sorted(set(s.dtypes["index"]) - seen[p]) for path in s.paths
                               for p in POINTERS[path] if set(s.dtypes["index"]) - seen[p]},
              "paths": sorted(set(s.paths) - reached)}
    return {"max_batch": s.max_batch, "largest_capture_size": largest_capture, "paths": list(s.paths),
            "index_dtypes": list(s.dtypes["index"]),
            "decode_batch_sizes_past_capture": {"seen": len({b for b in batches if b > largest_capture}),
                                                "of": max(0, s.max_batch - largest_capture)},
            "odd_prefill_lengths": len(odd), "missed": {k: v for k, v in missed.items() if v}}


def said(run: dict) -> str:
    return (f"{run['compiles']} compiles, {run['autotune_benchmarks']} autotune benchmarks, {run['cache_hits']} "
            f"disk hits, {run['calls']} calls ({run['calls_by_kind']}), {len(run['decode_batch_sizes'])} decode "
            f"batch sizes, index dtypes {run['index_dtypes']}, first step {run['first_step_s']} s")


def vllm_bench(script: Path, doc: str, name: str, work_name: str, steps: int, child, coverage, said,
               guarded: bool = False) -> int:
    """A vLLM traffic bench's main (this one's and vllm_layer_traffic's): in a measuring process, ``child``; else,
    on ``--bundle`` alone, per seed a fresh install and ``script --child`` with vLLM's default autotuning (and, where
    ``guarded``, under prewarm guard, counting JIT builds), ``coverage(runs, spec)`` in the JSON, ``said(run)`` in the
    log. Exits 1 where a process failed, and with ``--expect-zero`` where one compiled or benchmarked (``guarded``:
    or built, or ran unguarded) or the runs missed coverage."""
    p = server_traffic_parser(doc, name, DEFAULT_VLLM_MANIFEST, "vllm", calls=64, steps=steps)
    args = parse_seed_options(p)
    if args.child:
        return child_main(child, args)
    if not args.bundle or args.device_runs:
        p.error("give --bundle (a bundle of the manifest, built and packed without a GPU), no --device-runs")
    work, manifest, out, bundle, vllm_path = server_traffic_start(p, args, work_name, "vllm")

    def node_env(node: Path) -> dict:
        env = traffic_env(work, node, vllm_path)
        env.pop("VLLM_TRITON_FORCE_FIRST_CONFIG", None)  # vLLM's default: its autotuners benchmark
        return env | guard_env(node, env) if guarded else env

    traffic_runs(script, args, bundle, work, out, node_env, lambda runs: coverage(runs, load_spec(manifest)), said)
    failed = any("error" in r for r in out["runs"])
    counted = any(r.get("compiles") or r.get("autotune_benchmarks") or
                  guarded and (r.get("jit_builds") or not r.get("guarded")) for r in out["runs"])
    return 1 if failed or (args.expect_zero and (out["coverage"]["missed"] or counted)) else 0


if __name__ == "__main__":
    sys.exit(vllm_bench(Path(__file__), __doc__, "vllm_traffic", "vllm", 10, child, coverage, said))
