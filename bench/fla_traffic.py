"""Zero compiles for fla-core's KDA under independent traffic: fresh processes on an installed bundle (H200).

    python3 bench/fla_traffic.py [--bundle BUNDLE] --seeds 1,2,3 [--device-runs N] [--expect-zero] [--out JSON]

The traffic is ``traffic.fla_kda.calls``: written from fla's public API and the manifest's envelope
only, independently of the provider's call builder (``prewarm.providers.fla.kda``); every call draws every option of
its entry point (chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd, fused_kda_gate) on its own, and each run's
JSON row says which values it drew (``options_drawn``: option -> value -> calls). ``tests/test_fla.py`` runs the
same generator on ``meta`` tensors against the plan.

For each seed: ``prewarm install BUNDLE`` into a fresh node dir, then a fresh process with ``TRITON_CACHE_DIR`` =
that dir counts every compile with Triton's compilation listener. ``first_step_s`` starts after torch, the CUDA
context and triton are up and stops when ``import fla`` and the first ``--calls`` calls have run and the device
synchronized: with an offline bundle it includes fla's autotuner benchmarking each autotuned kernel once
(``autotune_s``), which a ``--mode device`` bundle removes (``--device-runs N`` builds one here and runs the first
N seeds on it; every process runs with TRITON_CACHE_AUTOTUNING=1, without which fla keeps no autotune results).
Writes ``{"runs": [{"bundle", "seed", "compiles", "first_step_s", ...}]}`` after every process; exits 1 if a
process or the device build failed, and with ``--expect-zero`` if any process compiled.
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, add_seed_options, bench_parser, bundle_for, child_env, child_main, init_device, load_spec, log,
    parse_seed_options, run_calls, run_child, seed_runs, timed_steps, traffic_start, write_json,
)
from traffic.fla_kda import calls  # noqa: E402

DEFAULT_FLA_MANIFEST = REPO / "manifests" / "kimi-linear-h200-fla.toml"


# --- the measurement ---------------------------------------------------------------------------------------------


def child(args) -> dict:
    torch = init_device()
    probes = Probes()
    spec = load_spec(Path(args.manifest))
    drawn: dict[str, Counter] = defaultdict(Counter)

    def tallied(traffic):
        for call in traffic:
            for option, value in call.options.items():
                drawn[option][str(value)] += 1
            yield call

    first_step, first = timed_steps(lambda: tallied(calls(spec, args.seed, args.calls * args.steps, "cuda")),
                                    lambda traffic: run_calls(traffic, args.calls, probes, torch.cuda.synchronize),
                                    args.steps, probes)  # imports fla: part of the first step
    return {"seed": args.seed, **first_step, "first_step_calls": first, **probes.snapshot(), **probes.details(),
            "options_drawn": {option: dict(sorted(values.items())) for option, values in sorted(drawn.items())}}


def drive(label: str, bundle: Path, seeds: list[int], args, work: Path, out: dict) -> None:
    """One fresh install and one fresh process per seed; the JSON is rewritten after each."""

    def measure_on(node: Path, seed: int) -> dict:
        # autotune results are read (device bundle) or written (offline) only with this set before fla imports
        env = child_env(work, TRITON_CACHE_DIR=str(node), TRITON_CACHE_AUTOTUNING="1")
        run = run_child(Path(__file__), ["--child", "--seed", str(seed), "--manifest", args.manifest,
                                         "--calls", str(args.calls), "--steps", str(args.steps)],
                        env, work / f"result-{label}-{seed}.json", timeout=args.timeout)
        log(f"{label} seed {seed}: {run['compiles']} compiles, first step {run['first_step_s']} s "
            f"(autotune {run['first_step']['autotune_s']} s), {run['cache_hits']} disk hits")
        return run

    for run in seed_runs(label, bundle, seeds, work, measure_on):
        out["runs"].append(run)
        write_json(args.out, out)


def main() -> int:
    p = bench_parser(__doc__, "fla_traffic", manifest=DEFAULT_FLA_MANIFEST)
    add_seed_options(p, seeds="1,2,3", calls=30)
    p.set_defaults(steps=2)
    args = parse_seed_options(p)
    if args.child:
        return child_main(child, args)
    if not args.bundle and not args.device_runs:
        p.error("give --bundle (runs every seed on it), --device-runs N, or both")
    work, manifest, out = traffic_start(args, "fla")
    seeds = args.seeds
    if args.bundle:
        bundle, out["bundles"]["offline"] = bundle_for(args.bundle, manifest, work, args.timeout)
        drive("offline", bundle, seeds, args, work, out)
    if args.device_runs:
        try:
            device, out["bundles"]["device"] = bundle_for(None, manifest, work, args.timeout, fallback=False)
            drive("device", device, seeds[:args.device_runs], args, work, out)
        except Exception as e:  # noqa: BLE001 - keep the offline runs
            out["device_error"] = f"{type(e).__name__}: {e}"
            log(f"device bundle FAILED: {out['device_error']}")
    write_json(args.out, out)
    failed = "device_error" in out or any("error" in r for r in out["runs"])
    return 1 if failed or (args.expect_zero and any(r.get("compiles") for r in out["runs"])) else 0


if __name__ == "__main__":
    sys.exit(main())
