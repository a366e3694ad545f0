"""Zero compiles for fla-core's KDA under independent traffic: fresh processes on an installed bundle (H200).

    python3 bench/fla_traffic.py [--bundle BUNDLE] --seeds 1,2,3 [--device-runs N] [--expect-zero] [--out JSON]

The traffic (:func:`calls`) is written from fla's public API and the manifest's envelope only, independently of
the provider's call builder (``prewarm.providers.fla_kda``): random packed prefill batches (sequence count, every
length, total up to the envelope's token budget, initial states or not, the CPU copy of ``cu_seqlens`` or not),
decode at any batch size (equal-length or packed), multi-token verify at the declared draft widths, q/k/v as views
of one fused projection, beta in bf16 or fp32, gate in each declared dtype.

For each seed: ``prewarm install BUNDLE`` into a fresh node dir, then a fresh process with ``TRITON_CACHE_DIR`` =
that dir counts every compile with Triton's compilation listener. ``first_step_s`` starts after torch, the CUDA
context and triton are up and stops when ``import fla`` and the first ``--calls`` calls have run and the device
synchronized: with an offline bundle it includes fla's autotuner benchmarking each autotuned kernel once
(``autotune_s``), which a ``--mode device`` bundle removes (``--device-runs N`` builds one here and runs the first
N seeds on it; every process runs with TRITON_CACHE_AUTOTUNING=1, without which fla keeps no autotune results).
Writes ``{"runs": [{"bundle", "seed", "compiles", "first_step_s", ...}]}`` after every process; exits 1 if a
process or the device build failed, and with ``--expect-zero`` if any process compiled.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_WORK, REPO, Probes, bundle_for, child_env, child_main, init_device, load_spec, log, run_calls, run_child,
    seed_runs, write_json,
)

DEFAULT_FLA_MANIFEST = REPO / "manifests" / "kimi-linear-h200-fla.toml"
TOKEN_BUDGET = 16384  # a serving engine's max batched tokens per prefill step (the manifest's envelope)


@dataclass
class Call:
    label: str
    run: Callable[[], object]


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded server-like calls of fla's public KDA API within ``spec``'s envelope, tensors on ``device``."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from prewarm_kernels.spec import read_kda

    rng = random.Random(seed)
    spec = read_kda(spec)  # the manifest's spec as the providers read it: heads per rank, dtypes per role
    H, K, V = spec["heads"], spec["head_k_dim"], spec["head_v_dim"]
    acts, gates = spec["dtypes"]["activation"], spec["dtypes"]["gate"]
    lb = spec["gate_lower_bound"]
    drafts = [d for d in spec["draft_widths"] if d > 1]
    max_batch = max(spec["decode_batch_buckets"] or [1])

    def tensor(*shape, dtype):
        if device == "meta":
            return torch.empty(*shape, dtype=dtype, device="meta")
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    def dtypes() -> tuple:
        """(activation, gate, beta): a deployment's activation and gate dtypes, beta as its model makes it."""
        return (getattr(torch, rng.choice(acts)), getattr(torch, rng.choice(gates)),
                rng.choice([torch.bfloat16, torch.float32]))

    def layer(B: int, T: int, act, gdt, bdt):
        qkv = tensor(B, T, H * (2 * K) + H * V, dtype=act)  # one fused projection: q, k, v are views of it
        q, k, v = (t.unflatten(-1, (H, -1)) for t in qkv.split([H * K, H * K, H * V], dim=-1))
        beta = tensor(B, T, H, dtype=bdt).sigmoid()
        gate = dict(A_log=tensor(H, dtype=torch.float32), dt_bias=tensor(H * K, dtype=torch.float32),
                    use_gate_in_kernel=True, lower_bound=lb)
        return (q, k, v, tensor(B, T, H, K, dtype=gdt), beta), gate

    def cu(lengths: list[int]):
        cpu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        return cpu.to(device), cpu

    for _ in range(n):
        types = dtypes()
        tag = ",".join(str(t).removeprefix("torch.") for t in types)
        kind = rng.choices(["prefill", "decode", "verify"], weights=[2, 3, 2 if drafts else 0])[0]
        if kind == "prefill":
            seqs = rng.randint(1, 12)
            lengths = [rng.randint(1, TOKEN_BUDGET // seqs) for _ in range(seqs)]
            with_state, cpu_copy = rng.random() < 0.7, device == "meta" or rng.random() < 0.5

            def prefill(lengths=lengths, with_state=with_state, cpu_copy=cpu_copy, types=types):
                (q, k, v, g, beta), gate = layer(1, sum(lengths), *types)
                dev, cpu = cu(lengths)
                h0 = tensor(len(lengths), H, K, V, dtype=torch.float32) if with_state else None
                return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=dev,
                                 cu_seqlens_cpu=cpu if cpu_copy else None, safe_gate=lb is not None, **gate)

            yield Call(f"prefill[{tag}] seqs={seqs} T={sum(lengths)} h0={with_state}", prefill)
        else:
            width = 1 if kind == "decode" else rng.choice(drafts)
            batch, packed = rng.randint(1, max_batch), rng.random() < 0.5

            def recurrent(width=width, batch=batch, packed=packed, types=types):
                (q, k, v, g, beta), gate = layer(1, batch * width, *types) if packed else layer(batch, width, *types)
                extra = {"cu_seqlens": cu([width] * batch)[0]} if packed else {}
                return fused_recurrent_kda(q, k, v, g, beta, initial_state=tensor(batch, H, K, V, dtype=torch.float32),
                                           output_final_state=True, use_qk_l2norm_in_kernel=True, **gate, **extra)

            yield Call(f"{kind}[{tag}] B={batch} T={width} packed={packed}", recurrent)


# --- the measurement ---------------------------------------------------------------------------------------------


def child(args) -> dict:
    torch = init_device()
    probes = Probes()
    spec = load_spec(Path(args.manifest))
    t0 = time.perf_counter()
    traffic = calls(spec, args.seed, args.calls * args.steps, "cuda")  # imports fla: part of the first step
    first = run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    first_step_s = time.perf_counter() - t0
    after_first = probes.snapshot()
    for _ in range(args.steps - 1):
        run_calls(traffic, args.calls, probes, torch.cuda.synchronize)
    return {"seed": args.seed, "first_step_s": round(first_step_s, 3), "first_step": after_first,
            "first_step_calls": first, **probes.snapshot(), **probes.details()}


def drive(label: str, bundle: Path, seeds: list[int], args, work: Path, out: dict) -> None:
    """One fresh install and one fresh process per seed; the JSON is rewritten after each."""

    def measure_on(node: Path, seed: int) -> dict:
        # autotune results are read (device bundle) or written (offline) only with this set before fla imports
        env = child_env(work, TRITON_CACHE_DIR=str(node), TRITON_CACHE_AUTOTUNING="1")
        run = run_child(Path(__file__), ["--child", "--seed", str(seed), "--manifest", args.manifest,
                                         "--calls", str(args.calls), "--steps", str(args.steps)],
                        env, work / f"result-{label}-{seed}.json", timeout=1800)
        log(f"{label} seed {seed}: {run['compiles']} compiles, first step {run['first_step_s']} s "
            f"(autotune {run['first_step']['autotune_s']} s), {run['cache_hits']} disk hits")
        return run

    for run in seed_runs(label, bundle, seeds, work, measure_on):
        out["runs"].append(run)
        write_json(args.out, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", default=str(DEFAULT_FLA_MANIFEST))
    ap.add_argument("--bundle", help="a packed bundle built on the CPU box (prewarm build + prewarm pack): every seed")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--device-runs", type=int, default=0,
                    help="also build a --mode device bundle here and run the first N seeds on it")
    ap.add_argument("--calls", type=int, default=8, help="calls per step (the first step is timed)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--work", default=str(DEFAULT_WORK / "fla"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "fla_traffic.json"))
    ap.add_argument("--expect-zero", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(child, args)
    if not args.bundle and not args.device_runs:
        ap.error("give --bundle (runs every seed on it), --device-runs N, or both")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    manifest = Path(args.manifest).resolve()
    out = {"manifest": args.manifest, "bundles": {}, "calls_per_step": args.calls, "steps": args.steps, "runs": []}
    if args.bundle:
        bundle, out["bundles"]["offline"] = bundle_for(args.bundle, manifest, work, 1800)
        drive("offline", bundle, seeds, args, work, out)
    if args.device_runs:
        try:
            device, out["bundles"]["device"] = bundle_for(None, manifest, work, 420, fallback=False)
            drive("device", device, seeds[:args.device_runs], args, work, out)
        except Exception as e:  # noqa: BLE001 - keep the offline runs
            out["device_error"] = f"{type(e).__name__}: {e}"
            log(f"device bundle FAILED: {out['device_error']}")
    write_json(args.out, out)
    failed = "device_error" in out or any("error" in r for r in out["runs"])
    return 1 if failed or (args.expect_zero and any(r.get("compiles") for r in out["runs"])) else 0


if __name__ == "__main__":
    sys.exit(main())
