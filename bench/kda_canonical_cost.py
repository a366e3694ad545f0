"""What the KDA wrappers' canonical form costs a caller (H200): casts of the small parameters, copies of views.

The wrappers turn beta / A_log / dt_bias of any float dtype into fp32 and int64 indices into int32 (so they never
make another compiled variant), and copy a strided or unaligned q/k/v/g into a contiguous aligned tensor. Each
point times one call three ways, interleaved ``do_bench`` medians in the same process: ``baseline`` (already
canonical: fp32 parameters, int32 indices, contiguous tensors: the wrappers do nothing), ``cast`` (bf16 beta,
A_log, dt_bias, int64 indices: the casts) and ``views`` (q, k, v, g split out of one fused projection: the copies).

    python bench/kda_canonical_cost.py [--out bench/results/kda_canonical_cost.json] [--reps 7]
"""
from __future__ import annotations

import platform
import statistics
import sys
import time

import torch

from _common import cuda_missing, import_kernels, kernel_bench_parser, write_json  # noqa: E402  (same directory)

import_kernels()

import triton  # noqa: E402
from kda_accuracy import fresh_triton_cache, prebuild  # noqa: E402  (same directory)
from prewarm_kernels.kda import chunk_kda_fwd, recurrent_kda  # noqa: E402

K = V = 128
PREFILL = [(32, 16384), (6, 65536)]  # (H, T): one packed sequence, as kda_speed
RECURRENT = [(32, 64, 1), (32, 64, 4)]  # (H, sequences, draft width): decode and verify at the largest bucket


def tensors(H: int, T: int, N: int, form: str, gen: torch.Generator) -> dict:
    """The call's tensors in one of the three forms (same values where the forms share them)."""
    bf, dev = torch.bfloat16, "cuda"
    if form == "views":
        proj = torch.randn(1, T, 4 * H * K, device=dev, dtype=bf, generator=gen)
        q, k, v, g = (p.view(1, T, H, K) for p in proj.split(H * K, dim=-1))
    else:
        q, k, v, g = (torch.randn(1, T, H, K, device=dev, dtype=bf, generator=gen) for _ in range(4))
    small = torch.bfloat16 if form == "cast" else torch.float32
    beta = torch.sigmoid(torch.randn(1, T, H, device=dev, generator=gen)).to(small)
    A_log = (torch.rand(H, device=dev, generator=gen) * 2 - 1).to(small)
    dt_bias = (torch.randn(H * K, device=dev, generator=gen) * 0.5).to(small)
    idx = torch.arange(N, device=dev, dtype=torch.int64 if form == "cast" else torch.int32)
    pool = torch.zeros(N + 8, H, K, V, device=dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, idx=idx, pool=pool)


def prefill_call(H: int, T: int, form: str, gen):
    t = tensors(H, T, 1, form, gen)
    cu = torch.tensor([0, T], dtype=torch.int32)
    return lambda: chunk_kda_fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["pool"],
                                 initial_state_indices=t["idx"], output_final_state=True, cu_seqlens=cu,
                                 use_qk_l2norm=True, A_log=t["A_log"], dt_bias=t["dt_bias"])


def recurrent_call(H: int, N: int, D: int, form: str, gen):
    t = tensors(H, N * D, N, form, gen)
    return lambda: recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], t["pool"], t["idx"], draft_width=D,
                                 use_qk_l2norm=True, A_log=t["A_log"], dt_bias=t["dt_bias"])


def measure(name: str, make, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = {form: make(form, gen) for form in ("baseline", "cast", "views")}
    for fn in calls.values():  # compile / autotune outside the timing
        fn()
    torch.cuda.synchronize()
    runs = {form: [] for form in calls}
    for _ in range(reps):
        for form, fn in calls.items():
            runs[form].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    ms = {form: statistics.median(r) for form, r in runs.items()}
    point = {"call": name, **{f"{form}_ms": round(m, 4) for form, m in ms.items()},
             "cast_ratio": round(ms["cast"] / ms["baseline"], 4), "views_ratio": round(ms["views"] / ms["baseline"], 4),
             "runs_ms": runs}
    print(f"{name}: baseline {ms['baseline']:.4f} ms, cast {ms['cast']:.4f} ms ({point['cast_ratio']:.3f}x), "
          f"views {ms['views']:.4f} ms ({point['views_ratio']:.3f}x)", flush=True)
    return point


def main() -> int:
    ap = kernel_bench_parser(__doc__, "kda_canonical_cost")
    ap.add_argument("--reps", type=int, default=7, help="interleaved do_bench rounds per form")
    args = ap.parse_args()
    if cuda_missing():
        return 2
    t0 = time.time()
    pre = prebuild([{"heads": H, "decode": True, "drafts": [D for _, _, D in RECURRENT if D > 1]}
                    for H in dict.fromkeys(H for H, _ in PREFILL)], fresh_triton_cache(), args.workers)
    points = []
    with torch.inference_mode():
        for H, T in PREFILL:
            points.append(measure(f"prefill H={H} T={T}", lambda form, gen: prefill_call(H, T, form, gen), args.reps))
            torch.cuda.empty_cache()
        for H, N, D in RECURRENT:
            kind = "decode" if D == 1 else f"verify draft={D}"
            points.append(measure(f"{kind} H={H} N={N}", lambda form, gen: recurrent_call(H, N, D, form, gen),
                                  args.reps))
    report = {"benchmark": "kda_canonical_cost", "K": K, "V": V, "activation": "bfloat16",
              "forms": {"baseline": "fp32 beta/A_log/dt_bias, int32 indices, contiguous q/k/v/g (nothing to do)",
                        "cast": "bf16 beta/A_log/dt_bias, int64 indices (cast by the wrapper)",
                        "views": "q/k/v/g split out of one fused projection (copied by the wrapper)"},
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "prebuild": pre, "points": points,
              "wall_s": round(time.time() - t0, 1)}
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
