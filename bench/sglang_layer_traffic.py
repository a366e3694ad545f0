"""Zero compiles and zero JIT builds for sglang's CUDA KDA layer under independent layer-level traffic: fresh
processes on installed bundles (H200).

    python3 bench/sglang_layer_traffic.py --bundle BUNDLE --jit-bundle sglang-jit=BUNDLE [--sglang-path DIR]
        [--graph] [--seeds 1,2,3,4,5] [--calls 48] [--steps 4] [--expect-zero] [--out JSON]

The traffic is ``tests/traffic/sglang_layer.py``: forwards of sglang 0.5.23's ``KDAAttnBackend`` (prefill with and
without prefix state and with the radix cache's tracking, decode with its tracking, target verify dense, ragged,
chain and tree, and the commit after it) and Kimi-Linear's o_norm, written from sglang's sources independently of the
provider (``prewarm.providers.sglang.cuda``); ``tests/test_sglang_layer.py`` runs the same generator on fake
tensors against the plan. Every process draws decode and verify batch sizes as seeded permutations of 1..the
manifest's largest batch; the JSON's ``coverage`` says which batch sizes (per forward mode) and draft widths the runs
together saw, and what they missed.

With ``--graph`` the traffic is ``tests/traffic/sglang_graph.py`` instead (``tests/test_sglang_graph.py`` runs it on
fake tensors): the serving path around the same layer, written from sglang's CUDA graph runner, model runner and
EAGLE worker: decode and target verify (chain and tree, draft widths 2-4) captured into real CUDA graphs per
``--cuda-graph-bs`` bucket (``init_cuda_graph_state``, the capture-time metadata, a warm-up run, ``torch.cuda.graph``)
and replayed padded to the bucket (the replay metadata's ``fused_replay_state_indices`` before each replay), eager
verify, the projections as views of Kimi-Linear's fused projection, the mamba pool's slot clear / copy and extend
positions before a prefill, the EAGLE verify commit (``prepare_verify_commit_outputs``) after a verify. Graph batch
sizes are seeded permutations of 1..the largest bucket; ``coverage`` then says which sizes (per graph kind) were
missed.

With ``--model`` the layer's calls are interleaved with the model-level generators' (``MODEL_TRAFFIC``, as many
calls of each): ``tests/traffic/sglang_cuda_model.py`` (the MoE at every token count, its router, the logits cast)
and ``tests/traffic/sglang_cuda_step.py`` (the scheduler's slot writes, an MLA layer's KV store, read-back and concat
with FA3's graph metadata, the EAGLE v2 worker's kernels, the grammar mask, sglang's JIT ``silu_and_mul``, KV store
and tree verify); ``coverage`` then also names each generator's kinds no run drew.

Per seed (as ``bench/sglang_traffic.py`` does, whose installers this reuses): ``prewarm install BUNDLE`` into a fresh
node dir, each ``--jit-bundle`` into a fresh dir beside it (sglang's JIT dir: ``SGLANG_JIT_CACHE_DIR``), then a fresh
process with ``TRITON_CACHE_DIR`` = the node dir and ``TRITON_CACHE_AUTOTUNING=1`` under ``prewarm guard`` (warn,
armed at import, a metrics file): Triton compiles are counted by Triton's compilation listener, autotune benchmarks
by the Autotuner, JIT builds by the guard (each library's build step hooked), and every call into sglang's CUDA JIT
packed decode is counted and really runs. ``cache_hits_by_kernel`` lists the kernels the process loaded from the
installed cache (the conv, tracking, commit and norm kernels among them). Writes ``{"runs": [...], "coverage":
{...}}`` after every process; exits 1 if a process failed, and with ``--expect-zero`` if any process compiled, built,
benchmarked, ran unguarded, or the runs missed a batch size, a draft width or a forward mode.
"""
from __future__ import annotations

import importlib
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, child_main, init_device, load_spec, parse_seed_options, server_traffic_parser,
    server_traffic_start, timed_steps, traffic_env, traffic_runs,
)
from sglang_traffic import _counting_jit, _install_jit, _jit_builds, _jit_bundles  # noqa: E402

DEFAULT_MANIFEST = REPO / "manifests" / "kimi-linear-h200-sglang.toml"
KINDS = ("extend", "decode", "target_verify")
GRAPH_KINDS = ("extend", "graph_decode", "graph_verify", "target_verify")  # --graph
# --model: the model-level generators interleaved with the layer's (tests/traffic: each has calls() and kinds())
MODEL_TRAFFIC = ("sglang_cuda_model", "sglang_cuda_step")


def child(args) -> dict:
    from traffic import interleave, sglang_graph, sglang_layer

    torch = init_device()
    probes = Probes()
    spec = load_spec(Path(args.manifest))
    drawn: list[dict] = []
    reached_jit: list[str] = []

    def step(traffic, n: int) -> None:
        for call in (next(traffic) for _ in range(n)):
            probes.during = call.label
            drawn.append(call.options)
            try:
                with _counting_jit(reached_jit, args.jit_bundle):
                    call.run()
            except Exception as e:
                raise RuntimeError(f"the call {call.label!r} raised {type(e).__name__}: {e}") from e
        torch.cuda.synchronize()

    def traffic():
        n = args.calls * args.steps
        if args.graph:
            layer = sglang_graph.calls(spec, args.seed, n, "cuda", graphs=True)
        else:
            layer = sglang_layer.calls(spec, args.seed, n, "cuda")
        if not args.model:
            return layer
        return interleave(random.Random(args.seed), layer=layer, **{
            name: importlib.import_module(f"traffic.{name}").calls(spec, args.seed, n, "cuda")
            for name in MODEL_TRAFFIC})

    first_step, _ = timed_steps(traffic,
                                lambda traffic: step(traffic, args.calls * (1 + len(MODEL_TRAFFIC) * args.model)),
                                args.steps, probes)
    model = [d for d in drawn if d.get("traffic", "layer") != "layer"]
    drawn = [d for d in drawn if d.get("traffic", "layer") == "layer"]
    return {"seed": args.seed, **first_step, "calls": len(drawn) + len(model),
            "model_calls_by_kind": {name: dict(Counter(d["kind"] for d in model if d["traffic"] == name))
                                    for name in MODEL_TRAFFIC if args.model},
            "calls_by_kind": dict(Counter(d["kind"] for d in drawn)),
            "batch_sizes": {kind: sorted({d["batch"] for d in drawn if d["kind"] == kind})
                            for kind in (GRAPH_KINDS if args.graph else KINDS)[1:]},
            "draft_widths": sorted({d["width"] for d in drawn if "width" in d}),
            "extend": {"with_prefix": sum(any(d["prefix"]) for d in drawn if d["kind"] == "extend"),
                       "tracked": sum(any(d["track_at"]) for d in drawn if d["kind"] == "extend"),
                       "most_tokens": max([sum(d["lengths"]) for d in drawn if d["kind"] == "extend"], default=0)},
            "verify": {"tree": sum(d.get("tree", False) for d in drawn),
                       "ragged": sum(d["kind"] == "target_verify" and any(n != d["width"] for n in d["lens"])
                                     for d in drawn)},
            "jit_calls": len(reached_jit), **_jit_builds(), **probes.snapshot(), **probes.details()}


def coverage(runs: list[dict], spec: dict, graph: bool = False) -> dict:
    """What the runs saw together, against the manifest's envelope."""
    from prewarm.providers.sglang.common import read_spec

    from traffic.sglang_graph import capture_buckets

    s = read_spec(spec)
    kinds_run = GRAPH_KINDS if graph else KINDS
    seen = {kind: set().union(*(r.get("batch_sizes", {}).get(kind, []) for r in runs)) for kind in kinds_run[1:]}
    # an eager batch may hold up to the largest batch; a graph replay up to the largest bucket
    most = {kind: capture_buckets(spec)[-1] if kind.startswith("graph_") else s.max_batch for kind in seen}
    widths = set().union(*(r.get("draft_widths", []) for r in runs))
    kinds = set().union(*(r.get("calls_by_kind", {}) for r in runs))
    model_kinds = {name: set().union(*(r.get("model_calls_by_kind", {}).get(name, {}) for r in runs))
                   for name in MODEL_TRAFFIC if any("model_calls_by_kind" in r for r in runs)}
    model_missed = {name: sorted(set(importlib.import_module(f"traffic.{name}").kinds(spec)) - k)
                    for name, k in model_kinds.items()}
    return {"max_batch": s.max_batch, "draft_widths": list(s.draft_widths),
            **({"model_kinds_seen": {name: sorted(k) for name, k in model_kinds.items()},
                "model_kinds_missed": {name: kinds for name, kinds in model_missed.items() if kinds}}
               if model_kinds else {}),
            "kinds_missed": sorted(set(kinds_run) - kinds),
            "batch_sizes_missed": {kind: sorted(set(range(1, most[kind] + 1)) - seen[kind]) for kind in seen},
            "draft_widths_missed": sorted(set(s.draft_widths) - widths)}


def main() -> int:
    p = server_traffic_parser(__doc__, "sglang_layer_traffic", DEFAULT_MANIFEST, "sglang", calls=48)
    p.add_argument("--jit-bundle", action="append", default=[], metavar="LAYOUT=BUNDLE",
                   help="a bundle of modules past Triton (sglang-jit), installed per seed; the process runs under "
                        "the guard, which counts their builds")
    p.add_argument("--model", action="store_true",
                   help="the model's step around the layer: the layer's calls interleaved with each model-level "
                        "generator's (MODEL_TRAFFIC: the MoE, the router and the logits cast; the scheduler, MLA, "
                        "EAGLE worker, sampler and JIT modules' steps), as many of each; the --jit-bundle must then "
                        "hold every sglang module the manifest plans (bench/h200_proof.sh sglang-model builds them)")
    p.add_argument("--graph", action="store_true",
                   help="drive the serving path around the layer (tests/traffic/sglang_graph.py): real CUDA graphs "
                        "captured and replayed, the runner's and the EAGLE worker's kernels")
    args = parse_seed_options(p)
    if args.child:
        return child_main(child, args)
    if not args.bundle or not args.jit_bundle:
        p.error("give --bundle (the manifest's Triton bundle, built and packed without a GPU) and --jit-bundle "
                "sglang-jit=BUNDLE (sglang's modules, built in the node's image)")
    work, manifest, out, bundle, sglang_path = server_traffic_start(p, args, "sglang-layer", "sglang")
    jit_bundles = _jit_bundles(args.jit_bundle, out)

    def said(run: dict) -> str:
        return (f"{run['compiles']} compiles, {run['autotune_benchmarks']} autotune benchmarks, JIT builds "
                f"{run.get('jit_builds', '-')}, {run['cache_hits']} disk hits, {run['calls']} calls "
                f"({run['calls_by_kind']}), JIT calls {run['jit_calls']}, first step {run['first_step_s']} s")

    def env(node: Path) -> dict:
        e = traffic_env(work, node, sglang_path)
        return e | _install_jit(jit_bundles, node, work, e)

    traffic_runs(Path(__file__), args, bundle, work, out, env,
                 lambda runs: coverage(runs, load_spec(manifest), args.graph), said,
                 tuple(x for pair in args.jit_bundle for x in ("--jit-bundle", pair)) + ("--graph",) * args.graph +
                 ("--model",) * args.model)
    cov = out["coverage"]
    failed = any("error" in r for r in out["runs"])
    missed = bool(cov["kinds_missed"] or any(cov["batch_sizes_missed"].values()) or cov["draft_widths_missed"] or
                  cov.get("model_kinds_missed"))
    built = any(r.get("compiles") or r.get("jit_builds") or r.get("autotune_benchmarks") or not r.get("guarded")
                for r in out["runs"])
    return 1 if failed or (args.expect_zero and (missed or built)) else 0


if __name__ == "__main__":
    sys.exit(main())
