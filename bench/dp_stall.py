"""Data-parallel stall: how long a prewarmed rank waits in a collective for a rank that compiles (NCCL, 1 GPU/rank).

    python3 bench/dp_stall.py [--bundle DIR] [--ranks 2] [--scenarios A,B] [--out bench/results/dp_stall.json]

One process per GPU (``torch.distributed``, backend ``nccl``, rank r on ``cuda:r``). Each step is what a
data-parallel attention rank does: its own traffic (``--calls`` calls from ``prewarm_kernels.kda.traffic``, within
the manifest's envelope, none made by the planner's call builder), then an ``all_reduce`` of a CUDA tensor. Every
rank draws the same calls (``--seed``), so a wait measures what the cache decides, not the load imbalance of
different requests. A rank's *wait* is the time from entering
``all_reduce`` (after its own calls ran and its device synchronized) until the reduced value is on its device (a
synchronize after the call), so the slowest rank waits ~0 and the others wait for it.

Scenarios (each with fresh processes and fresh cache dirs):
- A: rank 0 starts with an empty TRITON_CACHE_DIR; the other ranks each installed the bundle into their own dir.
- B: every rank installed the bundle into its own dir (the pre-launch job ran everywhere).

Before the barrier each rank imports the kernels and does the per-process setup that no cache changes
(Triton's ``triton_key`` and backend hash; torch's lazily loaded kernels for making inputs; the NCCL communicator),
as a server does before its first request; step 0 then differs between ranks only by what the cache decides:
compile + autotune, or load from disk.

The bundle comes from ``--bundle``, else ``WORK/bundle`` if ``bench/serving_traffic.py --device-runs`` or
``bench/cold_start.py`` left one there, else it is built here (``prewarm build --mode device`` + pack, the scratch
build dir deleted before any rank starts). A bundle without autotune results (an offline build) makes every rank
benchmark its autotuned kernels once in step 0: B then shows the spread of that, not zero.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, bench_parser, bundle_for, child_env, child_main, diff, fresh_dir, init_device, install_bundle,
    load_spec, log, open_traffic, result_header, run_calls, write_json,
)

B_LIMIT_S = 0.050
SCENARIOS = ("A", "B")


def process_setup(torch, device: str) -> float:
    """Per-process setup that no Triton cache changes, done before the barrier so that step 0 differs between
    ranks only by what the cache decides (compile + autotune, or load): Triton's ``triton_key`` (a hash of its own
    sources and libtriton), backend hash (``ptxas --version``) and lazy imports, and torch's lazily loaded kernels
    for making inputs (random numbers, casts, fills, host-to-device copies)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    t0 = time.perf_counter()
    import triton.experimental.gluon  # noqa: F401  (imported by Triton's first argument specialization)

    triton_key()
    major, minor = torch.cuda.get_device_capability(device)
    make_backend(GPUTarget("cuda", major * 10 + minor, 32)).hash()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        torch.randn(64, 64).to(device, dtype)
        torch.randn(64, 64, device=device, dtype=dtype)
    torch.rand(64, device=device)
    torch.zeros(64, device=device)
    torch.arange(64, dtype=torch.int32).to(device)
    torch.randint(0, 64, (64,), device=device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def rank_main(args) -> dict:
    """Child: one rank on its own GPU. Import kernels, join the group, then steps of (traffic, all_reduce)."""
    device = f"cuda:{args.rank}"
    torch = init_device(device)
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    setup_s = process_setup(torch, device)
    probes = Probes()
    spec = json.loads(Path(args.spec).read_text())
    traffic = open_traffic(spec, args.seed, args.calls * args.steps, device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.collective_timeout),
                            device_id=torch.device(device))
    token = torch.ones(1, device=device)
    dist.all_reduce(token)  # build the communicator before measuring
    torch.cuda.synchronize(device)
    dist.barrier()
    steps = []
    for step in range(args.steps):
        before = probes.snapshot()
        t0 = time.perf_counter()
        run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
        t1 = time.perf_counter()
        arrive = time.time()
        dist.all_reduce(token)
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        rec = {"step": step, "compute_s": round(t1 - t0, 6), "wait_s": round(t2 - t1, 6), "arrive_wall": arrive,
               **diff(probes.snapshot(), before)}
        steps.append(rec)
        log(f"rank {args.rank} step {step}: traffic {rec['compute_s']:.3f}s ({rec['compiles']} compiles, autotune "
            f"{rec['autotune_s']:.2f}s), waited {rec['wait_s']:.3f}s in all_reduce")
    dist.destroy_process_group()
    return {"rank": args.rank, "cache_dir": probes.cache_dir,
            "gpu": torch.cuda.get_device_name(device), "setup_s": round(setup_s, 4), "steps": steps,
            **probes.details()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(name: str, args, work: Path, bundle: Path, spec_file: Path) -> dict:
    world = args.ranks
    root = fresh_dir(work / f"dp-{name}")
    dirs = [root / f"rank{r}-cache" for r in range(world)]
    cold = {0} if name == "A" else set()
    for r in cold:
        fresh_dir(dirs[r])
    with ThreadPoolExecutor(world) as pool:  # each rank's node installs for itself, all at once
        installs = [round(t, 3) for t in pool.map(lambda d: install_bundle(bundle, d, work),
                                                  [d for r, d in enumerate(dirs) if r not in cold])]
    port = free_port()
    me = Path(__file__).resolve()
    procs = []
    for r in range(world):
        cmd = [sys.executable, str(me), "--child", "--rank", str(r), "--world", str(world), "--port", str(port),
               "--spec", str(spec_file), "--steps", str(args.steps), "--calls", str(args.calls), "--seed",
               str(args.seed), "--result", str(root / f"rank{r}.json"), "--collective-timeout", str(args.timeout)]
        # NVLink multicast stays off (the device machines' rule; a child gets it even if the caller's env lost it)
        env = child_env(work, TRITON_CACHE_DIR=str(dirs[r]), NCCL_NVLS_ENABLE="0",
                        TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
    codes = wait_all(procs, deadline=time.monotonic() + args.timeout + 60)
    ranks, errors = [], []
    for r in range(world):
        f = root / f"rank{r}.json"
        data = json.loads(f.read_text()) if f.exists() else {"error": "no result written (stopped)"}
        if data.get("error") or codes[r] != 0:
            errors.append(f"rank {r} exited {codes[r]}: {data.get('error')}")
        ranks.append(data)
    if errors:
        raise RuntimeError(f"scenario {name}: " + "; ".join(errors))
    shutil.rmtree(root, ignore_errors=True)
    return summarize(name, ranks, installs)


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int]:
    """Wait for every rank; once one fails (or time is up) the others would block in the collective: stop them."""
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    return [p.wait() for p in procs]


def summarize(name: str, ranks: list[dict], installs: list[float]) -> dict:
    n_steps = len(ranks[0]["steps"])
    steps = []
    for s in range(n_steps):
        rows = [r["steps"][s] for r in ranks]
        first = min(row["arrive_wall"] for row in rows)
        steps.append({
            "step": s,
            "wait_s": [row["wait_s"] for row in rows],
            "compute_s": [row["compute_s"] for row in rows],
            "arrival_after_first_s": [round(row["arrive_wall"] - first, 6) for row in rows],
            "compiles": [row["compiles"] for row in rows],
            "compile_s": [row["compile_s"] for row in rows],
            "autotune_s": [row["autotune_s"] for row in rows],
            "launcher_builds": [row["launcher_builds"] for row in rows],
            "max_wait_s": max(row["wait_s"] for row in rows),
        })
    out = {
        "ranks": len(ranks),
        "gpus": [r["gpu"] for r in ranks],
        "install_s": installs,
        "steps": steps,
        "max_wait_s": max(st["max_wait_s"] for st in steps),
        "max_wait_s_by_rank": [max(st["wait_s"][r] for st in steps) for r in range(len(ranks))],
        "total_wait_s_by_rank": [round(sum(st["wait_s"][r] for st in steps), 6) for r in range(len(ranks))],
        "compiles_by_rank": [sum(st["compiles"][r] for st in steps) for r in range(len(ranks))],
        "compile_s_by_rank": [round(sum(st["compile_s"][r] for st in steps), 4) for r in range(len(ranks))],
        "autotune_s_by_rank": [round(sum(st["autotune_s"][r] for st in steps), 4) for r in range(len(ranks))],
        "setup_s_by_rank": [r["setup_s"] for r in ranks],
        "compiled_by_rank": [r["compiled"] for r in ranks],
    }
    log(f"scenario {name}: max wait {out['max_wait_s']:.3f}s, per rank {out['max_wait_s_by_rank']}, "
        f"compiles per rank {out['compiles_by_rank']}")
    return out


def judge(res: dict) -> dict:
    sc, crit = res["scenarios"], {}
    if "A" in sc:
        a = sc["A"]
        a["warm_ranks_max_wait_s"] = max(a["max_wait_s_by_rank"][1:])
        a["warm_ranks_total_wait_s"] = min(a["total_wait_s_by_rank"][1:])
        a["cold_rank_compile_s"] = a["compile_s_by_rank"][0]
        a["cold_rank_autotune_s"] = a["autotune_s_by_rank"][0]
        crit["A: cold rank compiled"] = a["compiles_by_rank"][0] > 0
        crit["A: prewarmed ranks compiled nothing"] = not any(a["compiles_by_rank"][1:])
        # the cold rank compiles whenever its traffic meets a new variant (any step): compare totals
        crit["A: each prewarmed rank waited in all >= the cold rank's compile time"] = \
            a["warm_ranks_total_wait_s"] >= a["cold_rank_compile_s"]
    if "B" in sc:
        b = sc["B"]
        crit["B: no rank compiled"] = not any(b["compiles_by_rank"])
        if res["bundle"]["autotune_results"]:  # an offline bundle autotunes in step 0 on every rank, by design
            crit["B: no autotune"] = not any(b["autotune_s_by_rank"])
            crit[f"B: every rank's max wait per step <= {B_LIMIT_S * 1000:g} ms"] = b["max_wait_s"] <= B_LIMIT_S
    for k, ok in crit.items():
        log(f"  {'PASS' if ok else 'FAIL'}  {k}")
    return crit


def orchestrate(args) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    manifest = Path(args.manifest).resolve()
    res: dict = {**result_header(manifest), "ok": False, "scenarios": {},
                 "ranks": args.ranks, "steps": args.steps, "calls_per_step": args.calls, "seed": args.seed,
                 "backend": "nccl",
                 "wait_definition": "seconds from entering dist.all_reduce (NCCL, CUDA tensor, one GPU per rank) "
                                    "after this rank's calls ran and its device synchronized, until a synchronize "
                                    "after it returned"}
    try:
        import torch

        if torch.cuda.device_count() < args.ranks:
            raise RuntimeError(f"--ranks {args.ranks}: one GPU per rank, but {torch.cuda.device_count()} visible")
        bundle, res["bundle"] = bundle_for(args.bundle, manifest, work, args.timeout, reuse_work=True)
        spec_file = work / "dp-spec.json"
        write_json(spec_file, load_spec(manifest))
        for name in args.scenarios.split(","):
            if name not in SCENARIOS:
                raise ValueError(f"--scenarios: unknown {name!r} (known: {', '.join(SCENARIOS)})")
            log(f"scenario {name}: {args.ranks} ranks, {args.steps} steps of {args.calls} calls")
            try:
                res["scenarios"][name] = run_scenario(name, args, work, bundle, spec_file)
            except Exception as e:  # noqa: BLE001 - record it, run the other scenarios
                res["scenarios"][name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"scenario {name} FAILED: {e}")
        done = {k: v for k, v in res["scenarios"].items() if "error" not in v}
        crit = judge({**res, "scenarios": done})
        res["criteria"] = crit
        res["ok"] = bool(crit) and all(crit.values()) and len(done) == len(res["scenarios"])
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {res['error']}")
    return res


def main() -> int:
    p = bench_parser(__doc__, "dp_stall")
    p.add_argument("--bundle", help="bundle dir to install (default: WORK/bundle, built if missing)")
    p.add_argument("--ranks", type=int, default=2, help="one process per GPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--calls", type=int, default=16, help="calls of traffic per rank and step")
    p.add_argument("--seed", type=int, default=100, help="traffic seed (every rank draws the same calls)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--collective-timeout", type=float, default=300, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(rank_main, args)
    if args.ranks < 2 or args.steps < 1 or args.calls < 1:
        p.error("--ranks must be >= 2, --steps and --calls >= 1")
    res = orchestrate(args)
    log(f"wrote {write_json(args.out, res)}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
