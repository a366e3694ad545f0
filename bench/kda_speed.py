"""H200 speed of the KDA kernels against fla-core 0.6.0: decode, speculative verify and chunked prefill.

All calls as a server makes them: H heads, K = V = 128, bf16 q/k/v, the raw bf16 gate activated in-kernel with fp32
A_log / dt_bias, bf16 beta (our wrappers cast it to fp32: that cast is timed), q/k L2 norm in-kernel, fp32 states.

- decode (bs 1, 8, 64, 256; H=32): ours ``recurrent_kda`` on a state pool indexed per sequence (int32 indices, a
  permutation of the pool's slots), updated in place; fla ``fused_recurrent_kda_fwd`` (what vLLM calls) with the
  same pool as ``initial_state``, ``ssm_state_indices`` and ``inplace_final_state=True``, q/k/v as [bs, 1, H, *].
- verify (draft 2 and 4 at bs 8 and 64; H=32): ours ``recurrent_kda(draft_width=D)`` reads the pool and writes the
  state after every draft token to a new [N, D, H, K, V] tensor; fla's spec-decoding path: ``ssm_state_indices``
  [N, D] (the D slots each sequence's per-token states go to, in place) and ``num_accepted_tokens`` (all 1: the
  start state is slot [n, 0]). Both read one state and write D per sequence.
- prefill (H, T) at (32, 16384), (6, 65536), (16, 32768), (64, 4096): one packed sequence, state pool in, final
  state out; ours ``chunk_kda_fwd``, fla ``chunk_kda`` (use_gate_in_kernel with A_log / dt_bias). Then ``--draws``
  (default 4) points drawn at run time by a generator seeded with ``--seed`` (default: the clock; in the JSON):
  H among those four, 1-24 packed sequences of random lengths, 1k-32k tokens in all, one state per sequence.

Both implementations run in this process on the same tensors; warmup (compile, autotune) comes first; then
``triton.testing.do_bench`` medians are taken in interleaved rounds (ours, fla, ours, ...) and, for decode and
verify, ``do_bench_cudagraph`` medians too (a server replays decode in CUDA graphs: host time is gone there, only
GPU time counts). ratio = ours / fla. A point passes when every ratio measured for it is <= 1.0 (decode and verify:
both the eager and the graph ratio) and so is the summed device time of every kernel of one call (torch.profiler:
what a CUDA graph replay costs, fla's host work and zero fills aside; its per-kernel breakdown is in the JSON).

Compiles come from the library: ``kda_accuracy.prebuild`` runs ``prewarm build --mode offline`` for one manifest
per head count into this process's fresh TRITON_CACHE_DIR (a cache filled by another bench holds autotune results
tuned at other shapes; a token bucket's first call tunes it for every later one).

    PYTHONPATH=/tmp/site python bench/kda_speed.py [--out bench/results/kda_speed.json] [--reps 7] [--only ...]
                                                   [--draws 4] [--seed N]
"""
from __future__ import annotations

import os
import platform
import itertools
import random
import statistics
import sys
import time
import traceback

import torch

from _common import cuda_missing, import_kernels, kernel_bench_parser, write_json  # noqa: E402  (same directory)

import_kernels()

import triton  # noqa: E402
from kda_accuracy import FLA, fresh_triton_cache, prebuild, rel_rms  # noqa: E402  (same directory)
from prewarm_kernels.kda import chunk_kda_fwd, recurrent_kda  # noqa: E402

TARGET = 1.0
K = V = 128
H_DECODE = 32
DECODE_BS = (1, 8, 64, 256)
VERIFY = ((2, 8), (2, 64), (4, 8), (4, 64))  # (draft width, sequences)
PREFILL = ((32, 16384), (6, 65536), (16, 32768), (64, 4096))  # (H, T)


def layer_inputs(H: int, T: int, pool_slots: int, seed: int) -> dict:
    """One layer's server-side tensors: bf16 activations / gate / beta, fp32 A_log, dt_bias and a state pool."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf, dev = torch.bfloat16, "cuda"
    q, k, graw = (torch.randn(1, T, H, K, device=dev, dtype=bf, generator=g) for _ in range(3))
    return dict(q=q, k=k, g=graw, v=torch.randn(1, T, H, V, device=dev, dtype=bf, generator=g),
                beta=torch.sigmoid(torch.randn(1, T, H, device=dev, generator=g)).to(bf),
                A_log=torch.rand(H, device=dev, generator=g) * 2 - 1,
                dt_bias=torch.randn(H * K, device=dev, generator=g) * 0.5,
                pool=torch.randn(pool_slots, H, K, V, device=dev, generator=g) * 0.1)


def recurrent_pair(N: int, D: int):
    """(ours, fla, outputs) for decode (D == 1) or verify (D > 1) of N sequences; separate pools, same values."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    H = H_DECODE
    slots = N * D + 8
    t = layer_inputs(H, N * D, slots, seed=N * 10 + D)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(N + D)).to("cuda", torch.int32)
    idx = perm[:N].contiguous()
    pool_ours, pool_fla = t["pool"], t["pool"].clone()
    # fla's per-token slots: [n, 0] is where sequence n's start state is (ours: idx[n]), then D - 1 other free slots
    fla_idx = torch.cat([idx[:, None], perm[N:N * D].view(N, D - 1)], 1).contiguous() if D > 1 else idx
    accepted = torch.ones(N, dtype=torch.int32, device="cuda") if D > 1 else None
    per_seq = {x: t[x].view(N, D, *t[x].shape[2:]) for x in ("q", "k", "v", "g", "beta")}

    def ours():
        return recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], pool_ours, idx, draft_width=D,
                             use_qk_l2norm=True, A_log=t["A_log"], dt_bias=t["dt_bias"])

    def fla():
        return fused_recurrent_kda_fwd(q=per_seq["q"], k=per_seq["k"], v=per_seq["v"], g=per_seq["g"],
                                       beta=per_seq["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                       initial_state=pool_fla, inplace_final_state=True, ssm_state_indices=fla_idx,
                                       num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True)

    def agreement() -> dict:
        o1, inter = ours()
        o2, _ = fla()
        s1 = pool_ours[idx.long()] if D == 1 else inter[:, -1]
        s2 = pool_fla[idx.long()] if D == 1 else pool_fla[fla_idx[:, -1].long()]
        return {"o": rel_rms(o1.view_as(o2), o2), "state": rel_rms(s1, s2)}

    return ours, fla, agreement


def drawn_prefills(seed: int, n: int) -> list[tuple[int, list[int]]]:
    """``n`` prefills (H, sequence lengths) no fixed point has: H among the fixed points' head counts (their
    compiles are prebuilt), 1-24 sequences, 1,024-32,768 tokens cut at random places."""
    rng = random.Random(seed)
    points = []
    for _ in range(n):
        H, seqs, T = rng.choice([H for H, _ in PREFILL]), rng.randint(1, 24), rng.randint(1024, 32768)
        cuts = sorted(rng.sample(range(1, T), seqs - 1))
        points.append((H, [b - a for a, b in zip([0] + cuts, cuts + [T])]))
    return points


def prefill_pair(H: int, lens: list[int]):
    from fla.ops.kda import chunk_kda
    T, N = sum(lens), len(lens)
    t = layer_inputs(H, T, N, seed=H + T + N)
    cu_cpu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    cu_gpu = cu_cpu.to("cuda", torch.long)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")

    def ours():
        return chunk_kda_fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["pool"],
                             initial_state_indices=idx, output_final_state=True, cu_seqlens=cu_cpu,
                             use_qk_l2norm=True, A_log=t["A_log"], dt_bias=t["dt_bias"])

    def fla():
        return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["pool"], output_final_state=True,
                         cu_seqlens=cu_gpu, cu_seqlens_cpu=cu_cpu.long(), use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"])

    def agreement() -> dict:
        (o1, s1), (o2, s2) = ours(), fla()
        return {"o": rel_rms(o1, o2), "state": rel_rms(s1, s2)}

    return ours, fla, agreement


def kernel_breakdown(fn, calls: int = 5) -> dict[str, float]:
    """Device time per kernel name (ms per call), from torch.profiler over ``calls`` calls: where the time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            per[e.key[:120]] = round(t / 1000 / calls, 4)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def host_us(fn, calls: int = 500) -> float:
    """Host time per call (us) with the GPU queue never drained: what the wrapper and the launch cost the CPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return round(dt, 2)


def measure(label: str, ours, fla, agreement, reps: int, graphs: bool) -> dict:
    t0 = time.time()
    agree = agreement()  # the first call of each (compiles, autotunes) on the untouched pools
    torch.cuda.synchronize()
    warmup_s = time.time() - t0
    modes = {"eager": lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")}
    if graphs:
        modes["cudagraph"] = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    runs = {m: {"ours": [], "fla": []} for m in modes}
    for _ in range(reps):
        for m, bench in modes.items():
            runs[m]["ours"].append(bench(ours))
            runs[m]["fla"].append(bench(fla))
    point = {"label": label, "warmup_s": round(warmup_s, 2),
             "rel_rms_vs_fla": agree}
    for m in modes:
        o, f = statistics.median(runs[m]["ours"]), statistics.median(runs[m]["fla"])
        point[m] = {"ours_ms": o, "fla_ms": f, "ratio": o / f, "ours_runs_ms": runs[m]["ours"],
                    "fla_runs_ms": runs[m]["fla"]}
    if graphs:
        point["host_us_per_call"] = {"ours": host_us(ours), "fla": host_us(fla)}
    point["kernel_ms_per_call"] = {"ours": kernel_breakdown(ours), "fla": kernel_breakdown(fla)}
    o, f = (sum(point["kernel_ms_per_call"][who].values()) for who in ("ours", "fla"))
    point["kernel_sum"] = {"ours_ms": round(o, 4), "fla_ms": round(f, 4), "ratio": o / f}
    point["pass"] = all(point[m]["ratio"] <= TARGET for m in (*modes, "kernel_sum"))
    print(f"{label}: " + "; ".join(f"{m} ours {point[m]['ours_ms'] * 1e3:.1f} us fla {point[m]['fla_ms'] * 1e3:.1f} us"
                                   f" ratio {point[m]['ratio']:.3f}" for m in (*modes, "kernel_sum"))
          + f" ({'PASS' if point['pass'] else 'FAIL'}); rel RMS vs fla o {agree['o']:.1e} state {agree['state']:.1e}"
          + (f"; host us/call ours {point['host_us_per_call']['ours']} fla {point['host_us_per_call']['fla']}"
             if graphs else ""), flush=True)
    for who, per in point["kernel_ms_per_call"].items():
        print(f"  {who}: " + ", ".join(f"{k[:48]} {v * 1e3:.1f}us" for k, v in list(per.items())[:8]), flush=True)
    return point


def main() -> int:
    ap = kernel_bench_parser(__doc__, "kda_speed")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds per implementation and timing mode")
    ap.add_argument("--only", nargs="+", choices=("decode", "verify", "prefill"),
                    default=["decode", "verify", "prefill"])
    ap.add_argument("--draws", type=int, default=4, help="prefill points drawn at run time, besides the fixed ones")
    ap.add_argument("--seed", type=int, default=None, help="the draws' seed (default: from the clock)")
    args = ap.parse_args()
    seed = time.time_ns() % 100_000 if args.seed is None else args.seed
    if cuda_missing():
        return 2
    t_start = time.time()
    try:
        import fla
        from fla.ops.kda import chunk_kda  # noqa: F401
        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:
        print(f"cannot import fla (install fla-core 0.6.0 and set PYTHONPATH): {e!r}", file=sys.stderr)
        return 2
    print(f"fla {fla_version} from {os.path.dirname(fla.__file__)}", flush=True)
    cache = fresh_triton_cache()
    recurrent = {"decode", "verify"} & set(args.only)
    heads = ([H_DECODE] if recurrent else []) + [H for H, _ in PREFILL if "prefill" in args.only]
    drafts = sorted({d for d, _ in VERIFY})
    specs = [{"heads": H, "decode": H == H_DECODE, "drafts": drafts} for H in dict.fromkeys(heads)]
    # fla's prefill kernels too (its own provider): fla would otherwise compile ~170 variants serially per head count
    specs += [{"heads": H, "like": FLA} for H, _ in PREFILL if "prefill" in args.only]
    pre = prebuild(specs, cache, args.workers)
    cases = []
    if "decode" in args.only:
        cases += [("decode", f"decode bs={bs}", dict(batch=bs, draft=1), lambda bs=bs: recurrent_pair(bs, 1))
                  for bs in DECODE_BS]
    if "verify" in args.only:
        cases += [("verify", f"verify draft={d} bs={bs}", dict(batch=bs, draft=d),
                   lambda d=d, bs=bs: recurrent_pair(bs, d)) for d, bs in VERIFY]
    if "prefill" in args.only:
        cases += [("prefill", f"prefill H={H} T={T}", dict(H=H, T=T, lens=[T]),
                   lambda H=H, T=T: prefill_pair(H, [T])) for H, T in PREFILL]
        drawn = drawn_prefills(seed, args.draws)
        cases += [("prefill", f"prefill H={H} T={sum(lens)} seqs={len(lens)} (drawn)",
                   dict(H=H, T=sum(lens), lens=lens, drawn=True), lambda H=H, lens=lens: prefill_pair(H, lens))
                  for H, lens in drawn]
    points, errors = [], []
    with torch.inference_mode():
        for kind, label, where, make in cases:
            try:
                ours, theirs, agreement = make()
                p = measure(label, ours, theirs, agreement, args.reps, graphs=kind != "prefill")
                points.append({"kind": kind, **where, **({"H": H_DECODE} if kind != "prefill" else {}), **p})
            except Exception as e:
                errors.append({"case": label, "error": repr(e), "traceback": traceback.format_exc()})
                print(f"{label}: ERROR {e!r}", flush=True)
            torch.cuda.empty_cache()
            # a killed run keeps its points
            write_json(args.out, report(points, errors, pre, fla_version, t_start, seed))
    ok = not errors and all(p["pass"] for p in points)
    write_json(args.out, report(points, errors, pre, fla_version, t_start, seed))
    print(f"{'ALL PASS' if ok else 'NOT ALL PASS'}: " + ", ".join(
        f"{p['label']} {'/'.join(f'{p[m]['ratio']:.2f}' for m in ('eager', 'cudagraph', 'kernel_sum') if m in p)}"
        for p in points)
        + f"; wrote {args.out}")
    return 0 if ok else 1


def report(points: list, errors: list, pre: dict, fla_version: str, t_start: float, seed: int) -> dict:
    """The JSON written after every point and at the end."""
    return {"benchmark": "kda_speed", "target_ratio": TARGET, "seed": seed,
            "pass_rule": "every ratio of a point <= target: eager do_bench median, summed device time of the kernels "
                         "of one call (profiler), and for decode / verify also the do_bench_cudagraph median",
            "baseline": f"fla-core {fla_version}: fused_recurrent_kda_fwd (decode, verify), chunk_kda (prefill)",
            "K": K, "V": V, "dtype": "bfloat16", "beta_dtype": "bfloat16", "gate": "raw bf16, fused (A_log, dt_bias)",
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "all_pass": not errors and all(p["pass"] for p in points),
            "prebuild": pre, "points": points, "errors": errors, "wall_s": round(time.time() - t_start, 1)}


if __name__ == "__main__":
    sys.exit(main())
