"""Zero compiles under traffic the planner did not make: fresh processes of independent, seeded traffic on an
installed bundle (H200).

    python3 bench/serving_traffic.py --bundle .carry/kl-bundle --seeds 1,2,3,4,5 [--device-runs 2] [--expect-zero]

For each seed: ``prewarm install BUNDLE`` into a fresh node dir (a path the cache was never built in), then a fresh
process with ``TRITON_CACHE_DIR`` = that dir draws ``--steps`` x ``--calls`` calls from
``prewarm_kernels.kda.traffic`` (server-like calls of the public API within the manifest's envelope, written
independently of the planner's call builder) and counts, with Triton's compilation listener, every compile (the
kernel, the call that made it, its key dir) and every disk hit; the cache dir is listed before and after (new
launchers, autotune results, key dirs). One install per process: a compile in one process cannot hide a miss in
the next.

``first_step_s``: the clock starts after ``import torch``, CUDA context creation and ``import triton`` (nothing a
cache changes) and stops when the first ``--calls`` calls have run and the device synchronized: it includes
importing the kernels, loading binaries and launchers from disk, and (offline bundle) benchmarking each autotuned
kernel's configs once, which a ``--mode device`` bundle makes unnecessary. ``--device-runs N`` builds such a bundle
here (``prewarm build --mode device`` + ``prewarm pack`` into ``WORK/bundle``, the build dir deleted; reused by
``bench/cold_start.py --bundle WORK/bundle`` and ``bench/dp_stall.py``) and runs the first N seeds on it too.

Writes ``--out`` after every process (a stopped run keeps what it measured). Exits 1 if a process or the device
build failed, and with ``--expect-zero`` also if any process compiled anything.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    add_seed_options, bench_parser, bundle_for, child_env, child_main, files_under, init_device, load_spec, log,
    open_traffic, parse_seed_options, Probes, result_header, run_calls, run_child, seed_runs, write_json,
)


def measure(args) -> dict:
    """Child: one fresh process on one installed cache dir, one seed."""
    torch = init_device()
    probes = Probes()
    cache = Path(args.cache_dir).resolve()
    if Path(probes.cache_dir).resolve() != cache:
        raise RuntimeError(f"Triton reads {probes.cache_dir}, expected {cache}")
    before = files_under(cache)
    spec = json.loads(Path(args.spec).read_text())

    t0 = time.perf_counter()
    traffic = open_traffic(spec, args.seed, args.calls * args.steps, "cuda")
    labels = run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    first_s = time.perf_counter() - t0
    first = probes.snapshot()
    t1 = time.perf_counter()
    for _ in range(args.steps - 1):
        run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    rest_s = time.perf_counter() - t1
    total = probes.snapshot()
    new = sorted(files_under(cache) - before)
    return {
        "seed": args.seed,
        "compiles": total["compiles"],
        "hits": total["cache_hits"],
        "first_step_s": round(first_s, 4),
        "first_step": first,
        "process": total,
        "later_steps_s": round(rest_s, 4),
        "first_step_calls": labels,
        "new_cache_files": new,
        "new_key_dirs": sorted({f.split("/")[0] for f in new if "/" in f}),
        "cache_dir": str(cache),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": probes.triton_version,
        **probes.details(),
    }


def drive(label: str, bundle: Path, seeds: list[int], args, work: Path, spec_file: Path, res: dict) -> None:
    """One fresh install + one fresh measuring process per seed; results appended to ``res["runs"]``."""

    def measure_on(node: Path, seed: int) -> dict:
        log(f"{label} seed {seed}: fresh process, TRITON_CACHE_DIR={node}")
        child = ["--child", "--cache-dir", str(node), "--spec", str(spec_file), "--seed", str(seed),
                 "--calls", str(args.calls), "--steps", str(args.steps)]
        run = run_child(Path(__file__).resolve(), child, child_env(work, TRITON_CACHE_DIR=str(node)),
                        work / "child.json", args.timeout)
        log(f"{label} seed {seed}: {run['compiles']} compiles, {run['hits']} disk hits, first step "
            f"{run['first_step_s']:.3f} s (autotune {run['first_step']['autotune_s']:.2f} s), "
            f"{len(run['new_cache_files'])} new cache files")
        for c in run["compiled"]:
            log(f"  COMPILED {c['kernel']} during {c['during']} (key {c['key']})")
        if run["compiled"] and args.keep_compiled:  # for `prewarm explain KEY_DIR --plan M` elsewhere
            for key in {c["key"] for c in run["compiled"] if c["key"]}:
                shutil.copytree(node / key, Path(args.keep_compiled) / f"{label}-{seed}" / key)
        return run

    for run in seed_runs(label, bundle, seeds, work, measure_on):
        res["runs"].append(run)
        summarize(res)
        write_json(args.out, res)


def summarize(res: dict) -> None:
    """Per bundle: processes, compiles, first-step seconds; the criteria; ``ok``."""
    by_bundle = {}
    for label in dict.fromkeys(r["bundle"] for r in res["runs"]):
        runs = [r for r in res["runs"] if r["bundle"] == label and "error" not in r]
        firsts = [r["first_step_s"] for r in runs]
        by_bundle[label] = {
            "processes": len(runs),
            "failed": sum(r["bundle"] == label and "error" in r for r in res["runs"]),
            "compiles": sum(r["compiles"] for r in runs),
            "compiles_by_process": [r["compiles"] for r in runs],
            "hits_by_process": [r["hits"] for r in runs],
            "first_step_s": {"min": min(firsts), "median": round(statistics.median(firsts), 4), "max": max(firsts)}
            if firsts else None,
            "first_step_autotune_s": [r["first_step"]["autotune_s"] for r in runs],
        }
    res["summary"] = by_bundle
    fs = {k: v["first_step_s"]["median"] for k, v in by_bundle.items() if v["first_step_s"]}
    if "offline" in fs and "device" in fs:
        res["first_step_median_offline_over_device"] = round(fs["offline"] / fs["device"], 2)
    res["criteria"] = {
        f"{label}: {s['processes']} of {s['processes'] + s['failed']} processes ran, 0 compiles each":
            s["failed"] == 0 and s["compiles"] == 0 and s["processes"] > 0
        for label, s in by_bundle.items()
    }
    res["ok"] = bool(res["criteria"]) and all(res["criteria"].values())


def orchestrate(args) -> dict:
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    manifest = Path(args.manifest).resolve()
    try:
        bundle, described = bundle_for(args.bundle, manifest, work, args.timeout)
    except RuntimeError as e:
        raise SystemExit(f"serving_traffic: {e}") from None
    seeds = args.seeds
    res: dict = {**result_header(manifest), "calls_per_step": args.calls, "steps": args.steps,
                 "traffic": "prewarm_kernels.kda.traffic.calls(Envelope.from_spec(spec), seed)",
                 "bundles": {args.label: described}, "runs": [], "ok": False}
    spec_file = work / "spec.json"
    write_json(spec_file, load_spec(manifest))
    drive(args.label, bundle, seeds, args, work, spec_file, res)
    if args.device_runs:
        try:
            device, res["bundles"]["device"] = bundle_for(None, manifest, work, args.timeout, fallback=False)
            drive("device", device, seeds[:args.device_runs], args, work, spec_file, res)
        except Exception as e:  # noqa: BLE001 - keep the first bundle's runs
            res["device_error"] = f"{type(e).__name__}: {e}"
            log(f"device bundle FAILED: {res['device_error']}")
    summarize(res)
    if "device_error" in res:
        res["ok"] = False
    return res


def main() -> int:
    p = bench_parser(__doc__, "serving_traffic")
    add_seed_options(p, seeds="1,2,3,4,5", calls=32)
    p.add_argument("--label", default="offline", help="name of --bundle in the results (default: offline)")
    p.add_argument("--keep-compiled", metavar="DIR",
                   help="copy the key dir of every compile into DIR/<bundle>-<seed>/ (to run `prewarm explain` on)")
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = parse_seed_options(p)
    if args.child:
        return child_main(measure, args)
    if not args.bundle:
        p.error("--bundle is required")
    if args.device_runs and args.label == "device":
        p.error("--label device is the name of the bundle --device-runs builds: give --bundle another label")
    res = orchestrate(args)
    log(f"wrote {write_json(args.out, res)}")
    for k, ok in res["criteria"].items():
        log(f"  {'PASS' if ok else 'FAIL'}  {k}")
    if "first_step_median_offline_over_device" in res:
        s = res["summary"]
        log(f"first step (median): offline bundle {s['offline']['first_step_s']['median']} s, device bundle "
            f"{s['device']['first_step_s']['median']} s")
    failed = "device_error" in res or any("error" in r for r in res["runs"])
    return 1 if failed or (args.expect_zero and not res["ok"]) else 0


if __name__ == "__main__":
    sys.exit(main())
