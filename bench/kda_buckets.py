"""What the prefill kernels' token buckets buy (H200): prefill ours / fla-core 0.6.0 at points no other bench uses,
on a fresh cache and after a history of small batches, each in a fresh process on its own fresh cache.

    PYTHONPATH=/tmp/site python3 bench/kda_buckets.py [--out bench/results/kda_buckets.json] [--reps 5]

The prefill kernels' autotune keys carry the batch's token bucket (``prewarm_kernels.kda.common.TOKEN_BUCKETS``).
Before, they held only heads and head dims: a process's first prefill decided the configs of every later one, and on
a node whose first traffic was small batches prefill ran 1.45-1.61x fla at T = 6k-30k, against 0.88-1.15x on a fresh
cache tuned at T = 12000 first (issue 25). Here, with Triton's runtime autotuning (no autotune table: the question is
what a node that tunes for itself gets):

- ``fresh``: a fresh process on a freshly installed cache (kernels compiled, no autotune result) measures the points;
- ``history``: the same, after 40 calls of ``prewarm_kernels.kda.traffic`` (the planner's calls are never used)
  within an envelope of small batches (prefills of at most 1024 tokens, decode, verify) on our kernels only.

Points: H = 32, K = V = 128, bf16 q/k/v, raw bf16 gate with A_log / dt_bias in-kernel, in-kernel q/k L2 norm, a
state pool in and final states out, packed sequences (T = 3000 as 2 x 1500, 6000 as 3 x 2000, 9000 as 1, 12000 as
4 x 3000, 24000 as 6 x 4000, 40000 as 10 x 4000); kda_speed.py uses T = 4096 / 16384 / 32768 / 65536 in one
sequence. Each point: the first call of each side (tuning), then ``--reps`` interleaved rounds of
``triton.testing.do_bench`` medians (ours, fla). fla keeps no token count in its keys either; its history is the same
in both scenarios (its first call is the first point in both), so the ratio moves with ours only.

Pass: for every point, the history ratio is within 5% of the fresh one. Compiles come from ``prewarm build
--mode offline`` (``kda_accuracy.prebuild``, both providers, H = 32) packed once and installed per scenario.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, child_env, cuda_missing, install_bundle, kernel_bench_parser, load_spec, log, run_cli, write_json,
)

H, K, V = 32, 128, 128
POINTS = ((1500,) * 2, (2000,) * 3, (9000,), (3000,) * 4, (4000,) * 6, (4000,) * 10)  # sequence lengths
TOLERANCE = 0.05
HISTORY_CALLS = 40


def prefill_pair(lens: tuple[int, ...], seed: int):
    """(ours, fla): one packed prefill of ``lens`` on the same tensors, as a server calls each."""
    import torch
    from fla.ops.kda import chunk_kda
    from prewarm_kernels.kda import chunk_kda_fwd

    T, N, dev, bf = sum(lens), len(lens), "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, raw = (torch.randn(1, T, H, K, device=dev, dtype=bf, generator=g) for _ in range(3))
    v = torch.randn(1, T, H, V, device=dev, dtype=bf, generator=g)
    beta = torch.sigmoid(torch.randn(1, T, H, device=dev, generator=g)).to(bf)
    A_log, dt_bias = torch.rand(H, device=dev, generator=g) * 2 - 1, torch.randn(H * K, device=dev, generator=g) * .5
    pool = torch.randn(N, H, K, V, device=dev, generator=g) * 0.1
    cu_cpu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    cu_gpu, idx = cu_cpu.to(dev, torch.long), torch.arange(N, dtype=torch.int32, device=dev)

    def ours():
        return chunk_kda_fwd(q, k, v, raw, beta, initial_state=pool, initial_state_indices=idx,
                             output_final_state=True, cu_seqlens=cu_cpu, use_qk_l2norm=True, A_log=A_log,
                             dt_bias=dt_bias)

    def fla():
        return chunk_kda(q, k, v, raw, beta, initial_state=pool, output_final_state=True, cu_seqlens=cu_gpu,
                         cu_seqlens_cpu=cu_cpu.long(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         A_log=A_log, dt_bias=dt_bias)

    return ours, fla


def child(args) -> int:
    """One scenario in this fresh process (TRITON_CACHE_DIR: its own freshly installed cache)."""
    import torch
    import triton

    from prewarm_kernels.kda.common import token_bucket

    out: dict = {"scenario": args.scenario, "points": []}
    with torch.inference_mode():
        if args.scenario == "history":
            from prewarm_kernels.kda.traffic import Envelope, calls

            env = dataclasses.replace(Envelope.from_spec(load_spec(REPO / "manifests" / "kimi-linear-h200.toml")),
                                      gate=(torch.bfloat16,), max_seq_len=256, long_seq_len=256,
                                      max_prefill_tokens=1024)
            t0 = time.perf_counter()
            out["history"] = []
            for call in calls(env, 11, HISTORY_CALLS, "cuda"):
                call.run()
                out["history"].append(call.label)
            torch.cuda.synchronize()
            out["history_s"] = round(time.perf_counter() - t0, 2)
        for n, lens in enumerate(POINTS):
            ours, fla = prefill_pair(lens, seed=n)
            t0 = time.perf_counter()
            ours(), fla()  # each side's first call: compiles nothing (prebuilt), tunes what its keys lack
            torch.cuda.synchronize()
            runs = {"ours": [], "fla": []}
            for _ in range(args.reps):
                for side, fn in (("ours", ours), ("fla", fla)):
                    runs[side].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            o, f = statistics.median(runs["ours"]), statistics.median(runs["fla"])
            point = {"T": sum(lens), "seqs": len(lens), "bucket": token_bucket(sum(lens)), "ours_ms": o,
                     "fla_ms": f, "ratio": o / f, "first_calls_s": round(time.perf_counter() - t0, 2), "runs": runs}
            print(f"[{args.scenario}] T={point['T']} ({len(lens)} seqs, bucket {point['bucket']}): ours {o:.3f} ms, "
                  f"fla {f:.3f} ms, ratio {o / f:.3f}", flush=True)
            out["points"].append(point)
            del ours, fla
            torch.cuda.empty_cache()
    Path(args.result).write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = kernel_bench_parser(__doc__, "kda_buckets")
    ap.add_argument("--reps", type=int, default=5, help="interleaved do_bench rounds per side and point")
    ap.add_argument("--scenario", choices=("fresh", "history"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scenario:
        return child(args)
    if cuda_missing():
        return 2
    from kda_accuracy import FLA, prebuild

    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="kda-buckets-"))
    base = work / "base"
    pre = prebuild([{"heads": H, "decode": True, "drafts": [2, 4]}, {"heads": H, "like": FLA}], str(base), args.workers)
    run_cli(["pack", str(base), "-o", str(work / "bundle")], child_env(work), 300)
    res = {"benchmark": "kda_buckets", "H": H, "K": K, "V": V, "tolerance": TOLERANCE, "prebuild": pre,
           "history": f"{HISTORY_CALLS} calls of prewarm_kernels.kda.traffic, prefills <= 1024 tokens (seed 11)",
           "scenarios": {}}
    for scenario in ("fresh", "history"):
        node = work / f"node-{scenario}"
        install_bundle(work / "bundle", node, work)
        result = work / f"{scenario}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--scenario", scenario, "--reps", str(args.reps),
               "--result", str(result)]
        rc = subprocess.run(cmd, cwd=REPO, env=child_env(work, TRITON_CACHE_DIR=str(node))).returncode
        res["scenarios"][scenario] = json.loads(result.read_text()) if result.exists() else {"error": f"exit {rc}"}
        write_json(args.out, res)
    fresh, hist = (res["scenarios"][s].get("points", []) for s in ("fresh", "history"))
    res["points"] = [{"T": f["T"], "seqs": f["seqs"], "bucket": f["bucket"], "ratio_fresh": round(f["ratio"], 4),
                      "ratio_history": round(h["ratio"], 4), "history_over_fresh": round(h["ratio"] / f["ratio"], 4),
                      "ours_history_over_fresh": round(h["ours_ms"] / f["ours_ms"], 4)} for f, h in zip(fresh, hist)]
    res["ok"] = len(res["points"]) == len(POINTS) and all(abs(p["history_over_fresh"] - 1) <= TOLERANCE
                                                          for p in res["points"])
    res["wall_s"] = round(time.time() - t_start, 1)
    write_json(args.out, res)
    for p in res["points"]:
        log(f"T={p['T']}: ours/fla fresh {p['ratio_fresh']:.3f}, after small batches {p['ratio_history']:.3f} "
            f"({p['history_over_fresh']:.3f})")
    log(f"{'PASS' if res['ok'] else 'FAIL'}: history within {TOLERANCE:.0%} of fresh at every point; wrote {args.out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
