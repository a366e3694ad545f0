"""What `prewarm guard` costs a process whose kernels are all in the cache: the first call of each kernel (a disk
hit: Triton's JIT misses its in-memory cache, the guard's hook looks the key up, Triton loads the entry) and the
steady call rate afterwards (in-memory hits: the hook is not on that path), with and without the guard armed.

A cache of VARIANTS compiles of one kernel is built with `prewarm build --mode offline`; then fresh processes, the
two conditions interleaved, each make the first call of every variant (timed one by one) and then CALLS more calls
over them. The guarded processes run under `prewarm guard --mode warn` (its sitecustomize, env settings, armed at
import), as a server does. Every process must report 0 compiles (Triton's compilation listener) and the guard must
log nothing.

    python bench/guard_overhead.py [--rounds 5] [--out bench/results/guard_overhead.json]      # CPU box
    python bench/guard_overhead.py --device cuda --out bench/results/guard_overhead_h200.json  # on a GPU node

On the CPU box the calls go through the real JIT path with a target-only driver (``warmup``: everything up to the
launch); with ``--device cuda`` they are real launches on GPU tensors, each first call synchronized.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, DEFAULT_WORK, child_env, fresh_dir, log, write_json  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"  # prewarm_toy: small kernels importable by name
MANIFEST = Path(__file__).with_suffix(".toml")  # the variants: the kernel's dtypes x BLOCK values
ARGS = tomllib.loads(MANIFEST.read_text())["kernels"][0]["args"]
DTYPES, BLOCKS, N = [x["tensor"] for x in ARGS["x_ptr"]], ARGS["BLOCK"], ARGS["n"]


def child(args) -> None:
    """One fresh process: first call of every variant, then ``args.calls`` more; prints one JSON line."""
    import torch
    from triton import knobs

    from prewarm_toy.kernels import add_kernel

    compiles: list[bool] = []
    knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: compiles.append(cache_hit)
    if args.device == "cpu":
        from prewarm.building.backends import CudaOfflineTarget

        CudaOfflineTarget("cuda", "sm_90").activate()

        def call(dtype, block):
            add_kernel.warmup(dtype, torch.float32, torch.float32, N, BLOCK=block, grid=(1,))

        sync = lambda: None  # noqa: E731
    else:
        tensors = {d: torch.ones(N, dtype=getattr(torch, d), device=args.device) for d in DTYPES}
        y, out = torch.ones(N, device=args.device), torch.empty(N, device=args.device)

        def call(dtype, block):
            add_kernel[(N // block,)](tensors[str(dtype).removeprefix("torch.")], y, out, N, BLOCK=block)

        sync = torch.cuda.synchronize
        sync()
    import prewarm.node.guard as guard

    guarded = guard._guard is not None and guard._guard.armed
    variants = [(getattr(torch, d), b) for d in DTYPES for b in BLOCKS]
    first_ms = []
    for dtype, block in variants:
        t0 = time.perf_counter()
        call(dtype, block)
        sync()
        first_ms.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for i in range(args.calls):
        call(*variants[i % len(variants)])
    sync()
    rate = args.calls / (time.perf_counter() - t0)
    print(json.dumps({"guarded": guarded, "first_call_ms": first_ms, "calls_per_s": rate,
                      "compiles": compiles.count(False), "disk_hits": compiles.count(True)}))


def run_child(cond: str, cache: Path, work: Path, args) -> dict:
    env = child_env(work, TRITON_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(FIXTURES), env["PYTHONPATH"]])
    for k in [k for k in env if k.startswith("PREWARM_GUARD")]:
        del env[k]
    record = work / "guard.jsonl"
    command = [sys.executable, __file__, "--child", "--device", args.device, "--calls", str(args.calls)]
    if cond == "guard":  # as a server runs under it: `prewarm guard` execs the command with its hook installed
        command = [sys.executable, "-m", "prewarm.cli", "guard", "--mode", "warn", "--record", str(record), "--",
                   *command]
    p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(f"{cond} child failed:\n{p.stderr[-3000:]}")
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    if doc["guarded"] != (cond == "guard"):
        raise RuntimeError(f"{cond} child: guard armed = {doc['guarded']}")
    if doc["compiles"] or record.exists() or "prewarm guard:" in p.stderr:
        raise RuntimeError(f"{cond} child compiled {doc['compiles']} kernels or the guard logged: not all disk hits")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per condition (interleaved)")
    ap.add_argument("--calls", type=int, default=20000, help="calls after the first ones (in-memory hits)")
    ap.add_argument("--device", default="cpu", help="cpu (target-only driver, JIT path) or cuda (real launches)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK / "guard_overhead")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "guard_overhead.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    work = fresh_dir(args.work)
    env = child_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(FIXTURES), env["PYTHONPATH"]])
    cache = work / "cache"
    log(f"building {len(BLOCKS) * len(DTYPES)} variants into {cache}")
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "build", str(MANIFEST), "--cache-dir", str(cache),
                        "--mode", "offline", "--workers", "2"], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"prewarm build failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    runs: dict[str, list[dict]] = {"off": [], "guard": []}
    for r in range(args.rounds):
        for cond in (("off", "guard") if r % 2 == 0 else ("guard", "off")):
            runs[cond].append(run_child(cond, cache, work, args))
            log(f"round {r} {cond}: first calls {sum(runs[cond][-1]['first_call_ms']):.1f} ms, "
                f"{runs[cond][-1]['calls_per_s']:.0f} calls/s")

    def summary(cond: str) -> dict:
        firsts = [sum(d["first_call_ms"]) for d in runs[cond]]
        per_call = [statistics.median(d["first_call_ms"]) for d in runs[cond]]
        rates = [d["calls_per_s"] for d in runs[cond]]
        return {"first_calls_total_ms_median": statistics.median(firsts), "first_calls_total_ms": firsts,
                "first_call_ms_median": statistics.median(per_call), "calls_per_s_median": statistics.median(rates),
                "calls_per_s": rates, "disk_hits_per_process": runs[cond][0]["disk_hits"]}

    off, guard = summary("off"), summary("guard")
    doc = {
        "device": args.device,
        "variants": len(BLOCKS) * len(DTYPES),
        "rounds": args.rounds,
        "calls": args.calls,
        "what": "first call of every variant (disk hits) and the call rate after (in-memory hits), fresh processes, "
                "without and with `prewarm guard` armed (warn); 0 compiles and no guard line in every process",
        "off": off,
        "guard": guard,
        "ratio_first_call_total": guard["first_calls_total_ms_median"] / off["first_calls_total_ms_median"],
        "ratio_first_call_median": guard["first_call_ms_median"] / off["first_call_ms_median"],
        "ratio_calls_per_s": guard["calls_per_s_median"] / off["calls_per_s_median"],
    }
    write_json(args.out, doc)
    print(json.dumps({k: v for k, v in doc.items() if k.startswith("ratio")}, indent=2))


if __name__ == "__main__":
    main()
