"""Build throughput (compiles per second) against the number of worker processes, CUDA offline mode.

    python bench/build_scaling.py [--manifest manifests/kimi-linear-h200.toml] [--workers 1,2,4,8,16]
                                  [--spawn-workers 1,8] [--max-compiles 48] [--budget-s 360]
                                  [--out bench/results/build_scaling.json]

Each run is a fresh process that plans and expands the manifest (every autotune config is a compile), takes the
same --max-compiles of them (evenly spread: every kernel is represented) and times one
``prewarm.building.build.compile_into`` over them into a fresh empty cache dir: the real JIT path with a target-only driver (no
GPU used, even on a GPU machine). The time includes starting the pool, a forkserver's preload too (what a user waits
for). Workers fork from the preloaded forkserver, as `prewarm build` does (--workers); then, as the before-picture,
they are spawned (--spawn-workers). Each speedup is against the 1-worker run of the same start method in the same
invocation. A run that would start after --budget-s seconds is skipped (marked in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_WORK, REPO, child_env, log, write_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", default=str(REPO / "manifests/kimi-linear-h200.toml"))
    p.add_argument("--workers", default="1,2,4,8,16")
    p.add_argument("--spawn-workers", default="1,8", help="the same with spawned workers (empty: skip)")
    p.add_argument("--max-compiles", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=360)
    p.add_argument("--out", default=str(REPO / "bench/results/build_scaling.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)  # METHOD:WORKERS:RESULT_FILE: one timed run
    args = p.parse_args()
    if args.child:
        return one_run(args)
    import subprocess

    env = child_env(DEFAULT_WORK)  # the kernels shim on PYTHONPATH, inherited by the build workers
    start = time.perf_counter()
    runs: list[dict] = []
    base: dict[str, float] = {}
    plan_runs = [("forkserver", int(x)) for x in args.workers.split(",") if x]
    plan_runs += [("spawn", int(x)) for x in args.spawn_workers.split(",") if x]
    doc: dict = {}
    for method, n in plan_runs:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            log(f"{method} workers={n}: skipped (budget of {args.budget_s:.0f} s spent)")
            runs.append({"start_method": method, "workers": n, "skipped": f"budget spent after {elapsed:.0f} s"})
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as res:
            argv = [sys.executable, __file__, "--child", f"{method}:{n}:{res.name}", "--manifest", args.manifest,
                    "--max-compiles", str(args.max_compiles)]
            subprocess.run(argv, env=env, cwd=REPO, check=True)
            doc = json.loads(Path(res.name).read_text())
        run = doc.pop("run")
        base.setdefault(method, run["compiles_per_s"])
        run["speedup"] = round(run["compiles_per_s"] / base[method], 3)
        runs.append(run)
        log(f"{method} workers={n}: {run['seconds']:.1f} s, {run['compiles_per_s']:.2f} compiles/s, speedup "
            f"{run['speedup']:.2f}x" + (f", {len(run['not_compiled'])} not compiled" if run["not_compiled"] else ""))
    doc |= {"mode": "cuda offline (target-only driver)", "cpus": os.cpu_count(),
            "baseline": "1 worker of the same start method, same invocation", "runs": runs,
            "total_seconds": round(time.perf_counter() - start, 1)}
    write_json(args.out, doc)
    log(f"wrote {args.out}")
    return 0 if all(not r.get("not_compiled") for r in runs) else 1


def one_run(args) -> int:
    """In a fresh process (so a forkserver's start is inside the time): plan, then time one pool over the compiles."""
    from prewarm.building.build import CompileResult, compile_into, start_workers
    from prewarm.planning.manifest import load
    from prewarm.planning.plan import expand_all, plan
    from prewarm.building.backends import CudaOfflineTarget

    method, n, result = args.child.split(":", 2)
    start_workers(method)  # where `prewarm build` starts it: before planning
    m = load(args.manifest)
    target = CudaOfflineTarget(m.backend, m.arch)
    target.activate()
    every = expand_all(plan(m).requests)
    count = min(args.max_compiles, len(every))
    compiles = [every[i * len(every) // count] for i in range(count)]  # evenly spread: every kernel is represented
    cache = tempfile.mkdtemp(prefix=f"prewarm-scaling-{method}-{n}-")
    results: list[CompileResult] = []
    t0 = time.perf_counter()
    compile_into(compiles, cache, target, int(n), lambda i, r: results.append(r), start_method=method)
    seconds = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    failed = [r for r in results if r.status != "compiled"]
    run = {"start_method": method, "workers": int(n), "seconds": round(seconds, 3), "compiles": len(compiles),
           "compiles_per_s": round(len(compiles) / seconds, 3),
           "compile_seconds_sum": round(sum(r.seconds for r in results), 3),
           "not_compiled": [(r.label, r.status, r.message[:300]) for r in failed]}
    Path(result).write_text(json.dumps({"manifest": m.name, "compiles_per_run": len(compiles),
                                        "compiles_in_plan": len(every), "run": run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
