"""No benchmarking on the node: a CPU-built bundle with the manifest's autotune table, installed at another path,
under processes started together (a node's ranks) and one after another (H200).

    python3 bench/offline_autotune.py --bundle .carry/kl-bundle [--manifest manifests/kimi-linear-h200.toml]
        [--together 5] [--sequential 5] [--calls 32] [--steps 2] [--out bench/results/offline_autotune.json]

The bundle is `prewarm build MANIFEST --mode offline` (on a machine without a GPU; the manifest names its table:
``[target] tuned``) + `prewarm pack`. Here: `prewarm install` into one fresh node dir, `prewarm verify --plan
MANIFEST --require-autotune` (exit 0 expected: every planned tuning key's result is shipped), then ``--together``
fresh processes started at once on that dir, then ``--sequential`` more one after another, each with its own seed
(from the clock) of traffic the planner did not write: ``prewarm_kernels.kda.traffic`` for this project's kernels,
``traffic.fla_kda`` for fla-core's (chosen by the manifest's provider). Every process runs with
TRITON_CACHE_AUTOTUNING=1 under `prewarm guard` (warn mode), as deploy/prelaunch.sh starts a server.

Counted in each process, for real: compiles (Triton's compilation listener, ``cache_hit=False``), autotune
benchmark runs (Triton's own benchmarking, hooked through ``prewarm.building.tritoncompat.watch_autotune_benchmarks``: one
per call that starts timing configs) and the first step's wall time: the first ``--calls`` calls, run and
synchronized, once torch, the CUDA context, triton and the kernel library are up. Importing the library (and making
the traffic generator) is timed apart as ``import_s``: a server pays it at start, before it reports ready, and the
cache cannot change it (fla-core's import pulls in torch's compiler stack: 7-11 s on the H200). ``--profile`` adds
the first step's cProfile (the 30 functions of most cumulative and of most own time) to each process's result.

Writes ``{"runs": [{"seed", "compiles", "benchmarks", "first_step_s", "group", ...}], "verify": ..., "criteria"}``
after every group; exits 1 unless every process compiled nothing, benchmarked nothing and took at most
``--first-step-limit`` s (default 1.0; 1.5 for fla), and verify passed.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, bench_parser, bundle_for, child_env, child_main, files_under, init_device,
    install_bundle, load_spec, log, result_header, run_calls, write_json,
)

FLA_PROVIDER = "prewarm.providers.fla.kda"


def uses_fla(manifest: Path) -> bool:
    from prewarm.planning.manifest import load

    return any(k.ref == FLA_PROVIDER for k in load(manifest).kernels if k.kind == "provider")


# --- the measuring process -------------------------------------------------------------------------------------


def measure(args) -> dict:
    torch = init_device()
    from prewarm.building import tritoncompat

    probes = Probes()
    benchmarked: list[str] = []
    tritoncompat.watch_autotune_benchmarks(lambda tuner, a, k: benchmarked.append(tritoncompat.kernel_ref(tuner)))
    spec = load_spec(Path(args.manifest))
    t0 = time.perf_counter()
    if args.fla:
        import fla.ops.kda  # noqa: F401  (fla reads the device at import: part of the first step)
        from traffic.fla_kda import calls

        traffic = calls(spec, args.seed, args.calls * args.steps, "cuda")
    else:
        import prewarm_kernels.kda  # noqa: F401
        from prewarm_kernels.kda.traffic import Envelope, calls

        traffic = calls(Envelope.from_spec(spec), args.seed, args.calls * args.steps, "cuda")
    import_s = time.perf_counter() - t0
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    t1 = time.perf_counter()
    labels = run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    first_s = time.perf_counter() - t1
    if profiler:
        profiler.disable()
    first_benchmarks = len(benchmarked)
    for _ in range(args.steps - 1):
        run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    total = probes.snapshot()
    return {"seed": args.seed, "compiles": total["compiles"], "benchmarks": len(benchmarked),
            "first_step_s": round(first_s, 4), "import_s": round(import_s, 4),
            "first_step_benchmarks": first_benchmarks, "benchmarked": benchmarked, "hits": total["cache_hits"],
            "autotune_s": total["autotune_s"], "launcher_builds": total["launcher_builds"],
            "first_step_calls": labels, "gpu": torch.cuda.get_device_name(), **probes.details()} | (
            {"profile": profile_top(profiler)} if profiler else {})


def profile_top(profiler, n: int = 30) -> dict:
    """The profiled step's functions of most cumulative and most own time: [where, calls, own s, cumulative s]."""
    stats = pstats.Stats(profiler).stats
    rows = [[f"{Path(f).name}:{line}({name})", nc, round(tt, 4), round(ct, 4)]
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    return {"cumulative": sorted(rows, key=lambda r: -r[3])[:n], "own": sorted(rows, key=lambda r: -r[2])[:n]}


# --- the driver --------------------------------------------------------------------------------------------------


def start(args, node: Path, seed: int, work: Path) -> tuple[subprocess.Popen, Path]:
    result = work / f"result-{seed}.json"
    result.unlink(missing_ok=True)
    # as the pre-launch job starts a node's server: under `prewarm guard` (warn), compiles recorded to the work dir
    cmd = [sys.executable, "-m", "prewarm.cli", "guard", "--record", str(work / "guard.jsonl"), "--",
           sys.executable, str(Path(__file__).resolve()), "--child", "--seed", str(seed), "--manifest", args.manifest,
           "--calls", str(args.calls), "--steps", str(args.steps), "--result", str(result)] + ["--fla"] * args.fla + (
        ["--profile"] * args.profile)
    env = child_env(work, TRITON_CACHE_DIR=str(node), TRITON_CACHE_AUTOTUNING="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env), result


def finish(proc: subprocess.Popen, result: Path, seed: int, group: str, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    run = {"group": group, "seed": seed, "rc": rc}
    if result.exists():
        run |= json.loads(result.read_text())
    else:
        run["error"] = f"exited {rc} without a result"
    if "error" not in run:
        log(f"{group} seed {seed}: {run['compiles']} compiles, {run['benchmarks']} benchmarks, first step "
            f"{run['first_step_s']:.3f} s (after importing the library: {run['import_s']:.3f} s)")
    else:
        log(f"{group} seed {seed}: FAILED {run['error']}")
    return run


def summarize(res: dict, limit: float) -> None:
    runs = res["runs"]
    ok_runs = [r for r in runs if "error" not in r]
    res["criteria"] = {
        "verify --require-autotune exit 0": res.get("verify", {}).get("rc") == 0,
        f"{len(ok_runs)} of {len(runs)} processes ran": bool(runs) and len(ok_runs) == len(runs),
        "0 compiles in every process": all(r["compiles"] == 0 for r in ok_runs),
        "0 autotune benchmarks in every process": all(r["benchmarks"] == 0 for r in ok_runs),
        f"first step <= {limit} s in every process": all(r["first_step_s"] <= limit for r in ok_runs),
    }
    res["first_step_s"] = {g: [r["first_step_s"] for r in ok_runs if r["group"] == g]
                           for g in ("together", "sequential")}
    res["ok"] = all(res["criteria"].values())


def orchestrate(args) -> dict:
    work = Path(args.work_dir).resolve() / "offline-autotune"
    work.mkdir(parents=True, exist_ok=True)
    manifest = Path(args.manifest).resolve()
    limit = args.first_step_limit or (1.5 if args.fla else 1.0)
    bundle, described = bundle_for(args.bundle, manifest, work, args.timeout)
    res = {**result_header(manifest), "bundle": described, "traffic": "traffic.fla_kda" if args.fla
           else "prewarm_kernels.kda.traffic", "calls_per_step": args.calls, "steps": args.steps,
           "first_step_limit_s": limit, "runs": []}
    node = work / "node"
    res["install_s"] = round(install_bundle(bundle, node, work), 3)
    before = files_under(node)
    env = child_env(work, TRITON_CACHE_DIR=str(node), TRITON_CACHE_AUTOTUNING="1")
    verify = subprocess.run([sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(node), "--plan",
                             str(manifest), "--require-autotune"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=args.timeout)
    res["verify"] = {"rc": verify.returncode, "summary": verify.stdout.strip().splitlines()[:8]}
    log("verify: " + " | ".join(res["verify"]["summary"]))
    seed = int(time.time()) % 100000
    started = [(start(args, node, seed + i, work), seed + i) for i in range(args.together)]
    for (proc, result), s in started:
        res["runs"].append(finish(proc, result, s, "together", args.timeout))
    write_json(args.out, res)
    for i in range(args.sequential):
        s = seed + args.together + i
        proc, result = start(args, node, s, work)
        res["runs"].append(finish(proc, result, s, "sequential", args.timeout))
        write_json(args.out, res)
    res["new_cache_files"] = sorted(files_under(node) - before)  # a benchmark or a compile would have left some
    summarize(res, limit)
    return res


def main() -> int:
    p = bench_parser(__doc__, "offline_autotune")
    p.add_argument("--bundle", help="the CPU-built bundle dir (built with the manifest's autotune table)")
    p.add_argument("--together", type=int, default=5, help="processes started at once on the node dir")
    p.add_argument("--sequential", type=int, default=5, help="processes started one after another, after those")
    p.add_argument("--calls", type=int, default=32, help="calls per step (the first step: the first CALLS calls)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--first-step-limit", type=float, help="seconds (default 1.0; 1.5 for an fla manifest)")
    p.add_argument("--profile", action="store_true", help="the first step's cProfile in each process's result")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fla", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(measure, args)
    if not args.bundle:
        p.error("--bundle is required: the bundle of an offline build with the manifest's autotune table")
    args.fla = uses_fla(Path(args.manifest))
    try:
        res = orchestrate(args)
    except RuntimeError as e:
        raise SystemExit(f"offline_autotune: {e}") from None
    log(f"wrote {write_json(args.out, res)}")
    for k, ok in res["criteria"].items():
        log(f"  {'PASS' if ok else 'FAIL'}  {k}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
