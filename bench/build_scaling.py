"""Build throughput (compiles per second) against the number of worker processes, CUDA offline mode.

    python bench/build_scaling.py [--manifest manifests/kimi-linear-h200.toml] [--workers 1,2,4,8]
                                  [--max-compiles 48] [--budget-s 300] [--out bench/results/build_scaling.json]

The manifest is planned and expanded once (every autotune config is a compile); the same list of compiles
(--max-compiles of them, evenly spread over the expansion) is then built with 1, 2, 4, 8 worker processes, each
time into a fresh empty cache dir, through the real JIT path with a target-only driver (no GPU used, even on a GPU machine). The time of each run
includes starting the process pool (what a user waits for). The speedup is against the 1-worker run measured in
the same invocation. A run that would start after --budget-s seconds is skipped (marked in the JSON) so the whole
bench stays inside its time slot; the 1-worker run goes first.
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--max-compiles", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--out", default=str(REPO / "bench/results/build_scaling.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child:  # re-run with the kernels shim on PYTHONPATH (inherited by the spawned build workers)
        import subprocess

        env = child_env(DEFAULT_WORK)
        return subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, cwd=REPO).returncode

    from prewarm.build import CompileResult, compile_into
    from prewarm.manifest import load
    from prewarm.plan import expand_all, plan
    from prewarm.targets import CudaOfflineTarget

    start = time.perf_counter()
    m = load(args.manifest)
    target = CudaOfflineTarget(m.backend, m.arch)
    target.activate()
    every = expand_all(plan(m).requests)
    count = min(args.max_compiles, len(every))
    compiles = [every[i * len(every) // count] for i in range(count)]  # evenly spread: every kernel is represented
    log(f"{m.name}: {len(compiles)} of the plan's {len(every)} compiles per run, {os.cpu_count()} CPUs")
    runs = []
    base = None
    for n in [int(x) for x in args.workers.split(",")]:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            log(f"workers={n}: skipped (budget of {args.budget_s:.0f} s spent)")
            runs.append({"workers": n, "skipped": f"budget spent after {elapsed:.0f} s"})
            continue
        cache = tempfile.mkdtemp(prefix=f"prewarm-scaling-{n}-")
        results: list[CompileResult] = []
        t0 = time.perf_counter()
        compile_into(compiles, cache, target, n, lambda i, r: results.append(r))
        seconds = time.perf_counter() - t0
        shutil.rmtree(cache, ignore_errors=True)
        failed = [r for r in results if r.status != "compiled"]
        rps = len(compiles) / seconds
        base = base or rps
        runs.append({"workers": n, "seconds": round(seconds, 3), "compiles": len(compiles),
                     "compiles_per_s": round(rps, 3), "speedup": round(rps / base, 3),
                     "compile_seconds_sum": round(sum(r.seconds for r in results), 3),
                     "not_compiled": [(r.label, r.status, r.message[:300]) for r in failed]})
        log(f"workers={n}: {seconds:.1f} s, {rps:.2f} compiles/s, speedup {rps / base:.2f}x"
            + (f", {len(failed)} not compiled" if failed else ""))
    doc = {"manifest": m.name, "mode": "cuda offline (target-only driver)", "cpus": os.cpu_count(),
           "compiles_per_run": len(compiles), "compiles_in_plan": len(every), "baseline": "1 worker, same invocation", "runs": runs,
           "total_seconds": round(time.perf_counter() - start, 1)}
    write_json(args.out, doc)
    log(f"wrote {args.out}")
    return 0 if all(not r.get("not_compiled") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
