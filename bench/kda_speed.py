"""H200 speed of ``chunk_kda_fwd`` against fla-core 0.6.0's ``chunk_kda`` (the public implementation).

B=1 varlen single sequence, K = V = 128, bf16, q/k L2 norm in-kernel, final state out, at (H=32, T=16384) and
(H=6, T=65536). Both run in this process; warmup includes autotune; then ``triton.testing.do_bench`` runs are
interleaved (ours, fla, ours, fla, ...) and the medians compared: ratio = ours / fla, target <= 1.5.

    PYTHONPATH=/tmp/site python bench/kda_speed.py [--out bench/results/kda_speed.json] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from _common import import_kernels  # noqa: E402  (same directory)

import_kernels()

import triton  # noqa: E402
from kda_accuracy import precompile  # noqa: E402  (same directory)
from prewarm_kernels.kda import chunk_kda_fwd  # noqa: E402

TARGET = 1.5
POINTS = [(32, 16384), (6, 65536)]
K = V = 128


def make(H: int, T: int):
    g = torch.Generator(device="cuda").manual_seed(H + T)
    bf = torch.bfloat16
    q = torch.randn(1, T, H, K, device="cuda", dtype=bf, generator=g)
    k = torch.randn(1, T, H, K, device="cuda", dtype=bf, generator=g)
    v = torch.randn(1, T, H, V, device="cuda", dtype=bf, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, device="cuda", generator=g) + 3).to(bf)
    beta = torch.sigmoid(torch.randn(1, T, H, device="cuda", generator=g)).to(bf)
    return q, k, v, gate, beta


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
            per[e.key] = round(t / 1000 / calls, 4)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/kda_speed.json")
    ap.add_argument("--reps", type=int, default=7, help="interleaved do_bench rounds per implementation")
    ap.add_argument("--workers", type=int, default=None, help="parallel compile processes (default: min(16, CPUs))")
    ap.add_argument("--points", nargs="+", default=[f"{h}:{t}" for h, t in POINTS], metavar="H:T",
                    help="heads:tokens of the single-sequence varlen calls to time")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in p.split(":")) for p in args.points]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    try:
        from fla.ops.kda import chunk_kda
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:
        print(f"cannot import fla (install fla-core 0.6.0 and set PYTHONPATH): {e!r}", file=sys.stderr)
        return 2
    print(f"fla {fla_version} from {os.path.dirname(fla.__file__)}", flush=True)
    pre = precompile([dict(H=H, lens=[T], varlen=True, fused_gate=False, lower_bound=None, h0=False,
                           beta_dtype="bfloat16") for H, T in shapes], args.workers)
    points, errors = [], []
    with torch.inference_mode():
        for H, T in shapes:
            try:
                q, k, v, gate, beta = make(H, T)
                cu_cpu = torch.tensor([0, T], dtype=torch.int32)
                cu_gpu = cu_cpu.to("cuda", torch.long)

                def ours():
                    return chunk_kda_fwd(q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu_cpu,
                                         use_qk_l2norm=True)

                def theirs():
                    return chunk_kda(q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu_gpu,
                                     cu_seqlens_cpu=cu_cpu.long(), use_qk_l2norm_in_kernel=True)

                t0 = time.time()
                o1, s1 = ours()
                torch.cuda.synchronize()
                warm_ours = time.time() - t0
                t0 = time.time()
                o2, s2 = theirs()
                torch.cuda.synchronize()
                warm_fla = time.time() - t0
                agree_o = float(((o1.float() - o2.float()).pow(2).mean().sqrt() / o2.float().pow(2).mean().sqrt()))
                agree_s = float(((s1.float() - s2.float()).pow(2).mean().sqrt() / s2.float().pow(2).mean().sqrt()))
                print(f"H={H} T={T}: warmup ours {warm_ours:.1f}s fla {warm_fla:.1f}s; rel RMS ours vs fla: o "
                      f"{agree_o:.2e} state {agree_s:.2e}", flush=True)
                t_ours, t_fla = [], []
                for _ in range(args.reps):
                    t_ours.append(triton.testing.do_bench(ours, warmup=25, rep=100))
                    t_fla.append(triton.testing.do_bench(theirs, warmup=25, rep=100))
                m_ours, m_fla = statistics.median(t_ours), statistics.median(t_fla)
                ratio = m_ours / m_fla
                kernels = {"ours": kernel_breakdown(ours), "fla": kernel_breakdown(theirs)}
                for who, per in kernels.items():
                    print(f"  {who}: " + ", ".join(f"{k[:40]} {v:.3f}" for k, v in list(per.items())[:10]), flush=True)
                points.append({"H": H, "T": T, "ours_ms": m_ours, "fla_ms": m_fla, "ratio": ratio,
                               "pass": ratio <= TARGET, "ours_runs_ms": t_ours, "fla_runs_ms": t_fla,
                               "warmup_s": {"ours": round(warm_ours, 2), "fla": round(warm_fla, 2)},
                               "rel_rms_vs_fla": {"o": agree_o, "final_state": agree_s},
                               "kernel_ms_per_call": kernels})
                print(f"H={H} T={T}: ours {m_ours:.3f} ms, fla {m_fla:.3f} ms, ratio {ratio:.2f} "
                      f"({'PASS' if ratio <= TARGET else 'FAIL'} <= {TARGET})", flush=True)
                del q, k, v, gate, beta, o1, o2, s1, s2
                torch.cuda.empty_cache()
            except Exception as e:
                errors.append({"H": H, "T": T, "error": repr(e), "traceback": traceback.format_exc()})
                print(f"H={H} T={T}: ERROR {e!r}", flush=True)
    ok = not errors and all(p["pass"] for p in points)
    report = {"benchmark": "kda_speed", "target_ratio": TARGET, "baseline": f"fla-core {fla_version} chunk_kda",
              "K": K, "V": V, "dtype": "bfloat16", "layout": "B=1 varlen single sequence",
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "all_pass": ok, "precompile": pre, "points": points,
              "errors": errors,
              "wall_s": round(time.time() - t_start, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'ALL PASS' if ok else 'NOT ALL PASS'}: " + ", ".join(f"H={p['H']} T={p['T']} ratio {p['ratio']:.2f}"
                                                            for p in points) + f"; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
