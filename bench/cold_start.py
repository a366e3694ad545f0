"""Cold start vs prewarmed start under independent traffic, each in a fresh process on the GPU.

    python3 bench/cold_start.py [--bundle DIR] [--seed 7] [--out bench/results/cold_start.json]

Phases (each a separate process):
1. prepare: ``prewarm build MANIFEST --mode device`` into a scratch dir (compiles, autotunes once, builds the
   launchers), ``prewarm pack`` it into a bundle, delete the scratch dir. Skipped with ``--bundle DIR``.
2. ``prewarm install BUNDLE --cache-dir WORK/warm-cache``: a fresh dir at a path the cache was never built in;
   then ``prewarm verify --plan`` on it (its exit code is recorded beside what the warm run really does).
3. warm: a fresh process with TRITON_CACHE_DIR = the installed dir runs two steps of traffic.
4. cold: a fresh process with TRITON_CACHE_DIR = an empty dir runs the same traffic.

Both runs draw the same traffic: ``--calls`` calls per step from ``prewarm_kernels.kda.traffic`` with ``--seed``
(server-like calls of the public API within the manifest's envelope, written independently of the planner's call
builder). What "first step" times (the same in both runs): the clock starts after ``import torch``, CUDA context
creation and ``import triton`` (none of which a Triton cache can change) and stops when the first ``--calls`` calls
have run and the device synchronized. It includes importing the kernel modules, Triton's driver init and launcher
loading, every compile or disk hit, autotuning or reading autotune results, and allocating the calls' random
inputs. Every kernel launch is timed between two synchronizations (per-kernel first-call latency); the syncs cost
both runs the same and make the warm step a little slower, so the cold/warm ratio is if anything understated.

Compiles are counted by ``triton.knobs.compilation.listener`` (cache_hit False); autotune seconds are the time
spent inside ``Autotuner._bench`` (compiling + benchmarking candidate configs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Probes, bench_parser, bundle_for, child_env, child_main, diff, fresh_dir, init_device, install_bundle, load_spec,
    log, open_traffic, result_header, run_calls, run_child, run_cli, write_json,
)

RATIO_GOAL = 20.0


def measure(args) -> dict:
    """Child: one fresh process, one cache dir: time the first and second step of traffic."""
    torch = init_device()
    probes = Probes()
    if Path(probes.cache_dir).resolve() != Path(args.cache_dir).resolve():
        raise RuntimeError(f"Triton reads {probes.cache_dir}, expected {args.cache_dir}")
    probes.wrap_launch(torch.cuda.synchronize)
    spec = json.loads(Path(args.spec).read_text())

    t0 = time.perf_counter()
    traffic = open_traffic(spec, args.seed, 2 * args.calls, "cuda")
    labels = run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    first_s = time.perf_counter() - t0
    first = probes.snapshot()
    first_calls = {k: round(v["first_call_s"], 6) for k, v in probes.launches.items()}

    t1 = time.perf_counter()
    run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    second_s = time.perf_counter() - t1
    return {
        "cache_dir": probes.cache_dir,
        "triton": probes.triton_version,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "seed": args.seed,
        "first_step_s": round(first_s, 4),
        "second_step_s": round(second_s, 4),
        "first_step_calls": labels,
        "first_step": first,
        "second_step": diff(probes.snapshot(), first),
        "first_call_s_by_kernel": first_calls,
        **probes.details(),
    }


def orchestrate(args) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    manifest = Path(args.manifest).resolve()
    res: dict = {**result_header(manifest), "ok": False}
    try:
        bundle, res["bundle"] = bundle_for(args.bundle, manifest, work, args.timeout)
        warm_dir, cold_dir = work / "warm-cache", work / "cold-cache"
        res["install_s"] = round(install_bundle(bundle, warm_dir, work), 3)
        # The integrity check a node runs (hashes, fingerprint, will-hit): its verdict is recorded next to what
        # the runtime then really does, not required.
        rc, t = run_cli(["verify", "--cache-dir", str(warm_dir), "--plan", str(manifest)], child_env(work), 300,
                        check=False)
        res["verify"] = {"exit_code": rc, "seconds": round(t, 3)}
        fresh_dir(cold_dir)
        spec_file = work / "spec.json"
        spec = load_spec(manifest)
        write_json(spec_file, spec)
        res["spec"], res["seed"], res["calls_per_step"] = spec, args.seed, args.calls

        me = Path(__file__).resolve()
        for name, cache in (("warm", warm_dir), ("cold", cold_dir)):
            log(f"{name}: fresh process, TRITON_CACHE_DIR={cache}")
            env = child_env(work, TRITON_CACHE_DIR=str(cache))
            child_args = ["--child", "--cache-dir", str(cache), "--spec", str(spec_file), "--seed", str(args.seed),
                          "--calls", str(args.calls)]
            res[name] = run_child(me, child_args, env, work / f"{name}.json", args.timeout)
            r = res[name]
            log(f"{name}: first step {r['first_step_s']:.3f}s, {r['first_step']['compiles']} compiles, "
                f"autotune {r['first_step']['autotune_s']:.2f}s, launcher builds {r['first_step']['launcher_builds']}")
        summarize(res)
    except Exception as e:  # noqa: BLE001 - keep whatever was measured, with the reason
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {res['error']}")
    finally:
        if not args.keep_work:
            for d in ("warm-cache", "cold-cache"):
                shutil.rmtree(work / d, ignore_errors=True)
    return res


def summarize(res: dict) -> None:
    cold, warm = res["cold"], res["warm"]
    for side, r in (("cold", cold), ("warm", warm)):
        res[f"{side}_compiles"] = r["first_step"]["compiles"] + r["second_step"]["compiles"]
        res[f"{side}_autotune_s"] = round(r["first_step"]["autotune_s"] + r["second_step"]["autotune_s"], 4)
        res[f"{side}_first_step_s"] = r["first_step_s"]
        res[f"{side}_second_step_s"] = r["second_step_s"]
        res[f"{side}_launcher_builds"] = r["first_step"]["launcher_builds"] + r["second_step"]["launcher_builds"]
        res[f"{side}_cache_hits"] = r["first_step"]["cache_hits"]
    res["first_step_ratio"] = round(cold["first_step_s"] / warm["first_step_s"], 2)
    names = sorted(set(cold["first_call_s_by_kernel"]) | set(warm["first_call_s_by_kernel"]))
    res["per_kernel_first_call_s"] = {
        n: {"cold": cold["first_call_s_by_kernel"].get(n), "warm": warm["first_call_s_by_kernel"].get(n)} for n in names
    }
    criteria = {
        "warm_compiles == 0": res["warm_compiles"] == 0,
        "warm_autotune_s == 0": res["warm_autotune_s"] == 0,
        f"first_step_ratio >= {RATIO_GOAL:g}": res["first_step_ratio"] >= RATIO_GOAL,
        "cold run compiled (a real cold start)": res["cold_compiles"] > 0,
    }
    res["criteria"] = criteria
    res["ok"] = all(criteria.values())
    log(f"cold/warm time to the first completed step: {res['first_step_ratio']}x")
    for k, v in criteria.items():
        log(f"  {'PASS' if v else 'FAIL'}  {k}")


def main() -> int:
    p = bench_parser(__doc__, "cold_start")
    p.add_argument("--bundle", help="reuse this bundle instead of building one (skips prepare)")
    p.add_argument("--seed", type=int, default=7, help="traffic seed (both runs draw the same calls)")
    p.add_argument("--calls", type=int, default=32, help="calls per step")
    p.add_argument("--keep-work", action="store_true", help="keep the installed and cold cache dirs")
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(measure, args)
    res = orchestrate(args)
    log(f"wrote {write_json(args.out, res)}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
