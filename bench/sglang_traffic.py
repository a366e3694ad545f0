"""Zero compiles for sglang's own KDA kernels under independent traffic: fresh processes on an installed bundle (H200).

    python3 bench/sglang_traffic.py --bundle BUNDLE [--sglang-path DIR] [--seeds 1,2,3,4,5] [--expect-zero] [--out JSON]
        [--jit-bundle sglang-jit=BUNDLE --jit-bundle flashinfer-aot=BUNDLE --sampling N]

The traffic is ``traffic.sglang_cuda.calls``: TritonKDAKernel's public methods called as sglang
0.5.23's KDA backend and Kimi-Linear's layer call them, written independently of the provider's call builder
(``prewarm.providers.sglang.cuda``); ``tests/test_sglang.py`` runs the same generator on fake tensors against the plan.
Every process draws its batch sizes as seeded permutations of 1..the manifest's largest batch, so a process of
enough calls (the default: 4 steps of 64) sees every size; the JSON's ``coverage`` says which batch sizes and draft
widths the runs together saw, and what they missed.

For each seed: ``prewarm install BUNDLE`` into a fresh node dir, then a fresh process with ``TRITON_CACHE_DIR`` =
that dir (and ``TRITON_CACHE_AUTOTUNING=1``, as deploy/prelaunch.sh exports it) counts every compile with Triton's
compilation listener. sglang need not be installed: ``--sglang-path`` (or PYTHONPATH) names a dir holding its
package (the kernel modules; ``.ci/setup``'s ``build/sglang``). Calls that reach sglang's CUDA JIT packed decode
(tvm_ffi + nvcc, not Triton: batches of 8 or more) are counted per run as ``jit_calls``; where that kernel cannot be
built (``JitKernelUnavailable`` from the test stand-in, or any error of sglang's JIT loader) the call is counted in
``jit_unavailable`` and the run goes on: nothing Triton would compile for it is hidden, because the JIT kernel
replaces the Triton one for that call. ``first_step_s`` starts after torch, the CUDA context and triton are up and
stops when sglang's kernels are imported and the first ``--calls`` calls have run and the device synchronized (an
offline bundle without the manifest's autotune table includes the autotuner benchmarking each autotuned kernel once:
``autotune_s``). Writes ``{"runs": [{"seed", "compiles", ...}], "coverage": {...}}`` after every process; exits 1 if
a process failed, and with ``--expect-zero`` if any process compiled or the runs missed a batch size or a draft
width.

Past Triton (``--jit-bundle LAYOUT=BUNDLE``, the bundles of the dirs ``prewarm build`` puts beside its cache dir):
each is installed per seed like the Triton one, sglang-jit into a fresh dir the process gets as
``SGLANG_JIT_CACHE_DIR``, flashinfer-aot into the AOT dir of the process's FlashInfer (emptied first), and the process
runs under ``prewarm guard`` (warn, armed at import) with a metrics file: its JIT build count is the guard's
``prewarm_guard_jit_builds_total`` (each library's build step hooked: prewarm.jit), so a module the bundles lack is
counted by the code a node runs, not by this script. The JIT packed decode then really runs (its failure is the run's
failure), and each step ends with ``--sampling`` calls of sglang's FlashInfer sampling at temperature > 0
(``traffic.sampling_calls``). ``--expect-zero`` then also needs 0 JIT builds (and each process guarded);
``--jit-cold`` is the control: the dirs stay empty, and the guard counts what a node without the bundles builds.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, Probes, child_main, describe_bundle, guard_env, init_device, load_spec, parse_seed_options, run_cli,
    server_traffic_parser, server_traffic_start, timed_steps, traffic_env, traffic_runs,
)

DEFAULT_SGLANG_MANIFEST = REPO / "manifests" / "kimi-linear-h200-sglang.toml"


# --- the measurement ---------------------------------------------------------------------------------------------


def child(args) -> dict:
    from prewarm.providers.sglang.common import jit_skipped
    from traffic.sglang_cuda import calls, sampling_calls

    torch = init_device()
    probes = Probes()
    spec = load_spec(Path(args.manifest))
    drawn: list[dict] = []
    jit_unavailable: Counter = Counter()
    reached_jit: list[str] = []

    sampling = sampling_calls(64, args.seed, args.sampling * args.steps, "cuda")

    def step(traffic, n: int) -> None:
        for call in [*(next(traffic) for _ in range(n)), *(next(sampling) for _ in range(args.sampling))]:
            probes.during = call.label
            drawn.append(call.options)
            try:
                with jit_skipped() if args.skip_jit else _counting_jit(reached_jit, args.jit_bundle):
                    call.run()
            except _JitFailed as e:  # sglang's CUDA JIT kernel could not be built or run here: counted, said
                jit_unavailable[f"{type(e.__cause__).__name__}: {call.options['kind']} batch "
                                f"{call.options.get('batch')}"] += 1
            except Exception as e:
                raise RuntimeError(f"the call {call.label!r} raised {type(e).__name__}: {e}") from e
        torch.cuda.synchronize()

    first_step, _ = timed_steps(lambda: calls(spec, args.seed, args.calls * args.steps, "cuda"),  # imports sglang
                                lambda traffic: step(traffic, args.calls), args.steps, probes)
    return {"seed": args.seed, **first_step, "calls": len(drawn),
            "calls_by_kind": dict(Counter(d["kind"] for d in drawn)),
            "batch_sizes": sorted({d["batch"] for d in drawn if "batch" in d}),
            "draft_widths": sorted({d["width"] for d in drawn if "width" in d}),
            "jit_calls": len(reached_jit), "jit_unavailable": dict(jit_unavailable),
            "sampling_calls": sum(d["kind"] == "sample" for d in drawn), **_jit_builds(),
            **probes.snapshot(), **probes.details()}


def _jit_builds() -> dict:
    """The guard's count of builds past Triton in this process (its metrics file), where it guards it."""
    from prewarm.node.metrics import JIT_BUILDS, TEXTFILE, read

    from prewarm.node import guard

    if not os.environ.get(TEXTFILE):
        return {}
    built = read(os.environ[TEXTFILE])[0].get(JIT_BUILDS, {})
    return {"guarded": guard.armed(), "jit_builds": int(sum(built.values())), "jit_built": built}


class _JitFailed(Exception):
    """sglang's CUDA JIT packed decode raised (its cause): e.g. JitKernelUnavailable from the test stand-in."""


class _counting_jit:
    """Counts each call of sglang's CUDA JIT packed decode and lets it run (on a node with sglang's toolchain it is
    the kernel serving that batch); whatever it raises comes out as :class:`_JitFailed`, unless the node has the
    module installed (``installed``: the run's --jit-bundle), where a failure is the run's."""

    def __init__(self, calls: list[str], installed: list):
        self.calls, self.installed = calls, bool(installed)

    def __enter__(self):
        import sglang.kernels.ops.attention.kda_packed_decode as jit

        self.module, self.original = jit, jit.kda_packed_decode

        def counted(mixed_qkv, *args, **kwargs):
            self.calls.append(f"batch {mixed_qkv.shape[0]}")
            if self.installed:
                return self.original(mixed_qkv, *args, **kwargs)
            try:
                return self.original(mixed_qkv, *args, **kwargs)
            except Exception as e:
                raise _JitFailed(f"{type(e).__name__}: {e}") from e

        jit.kda_packed_decode = counted
        return self

    def __exit__(self, *exc):
        self.module.kda_packed_decode = self.original
        return False


def coverage(runs: list[dict], spec: dict) -> dict:
    """Which batch sizes and draft widths the runs saw together, against the manifest's envelope."""
    from prewarm.providers.sglang.common import read_spec

    s = read_spec(spec)
    batches = set().union(*(r.get("batch_sizes", []) for r in runs))
    widths = set().union(*(r.get("draft_widths", []) for r in runs))
    return {"max_batch": s.max_batch, "draft_widths": list(s.draft_widths),
            "batch_sizes_missed": sorted(set(range(1, s.max_batch + 1)) - batches),
            "draft_widths_missed": sorted(set(s.draft_widths) - widths)}


def main() -> int:
    p = server_traffic_parser(__doc__, "sglang_traffic", DEFAULT_SGLANG_MANIFEST, "sglang", calls=64)
    p.add_argument("--skip-jit", action="store_true", help="skip sglang's CUDA JIT packed decode instead of calling "
                                                           "it (what the planner does)")
    p.add_argument("--jit-bundle", action="append", default=[], metavar="LAYOUT=BUNDLE",
                   help="a bundle of modules past Triton (sglang-jit, flashinfer-aot), installed per seed; the "
                        "process runs under the guard, which counts their builds")
    p.add_argument("--jit-cold", action="store_true",
                   help="the control: the --jit-bundle dirs stay empty (a node without them), the guard counts what "
                        "each process builds")
    p.add_argument("--sampling", type=int, default=0, metavar="N",
                   help="N calls of sglang's FlashInfer sampling (temperature > 0) at the end of each step")
    args = parse_seed_options(p)
    if args.child:
        return child_main(child, args)
    if not args.bundle:
        p.error("give --bundle: a bundle of the manifest, built and packed (on a CPU box, say)")
    work, manifest, out, bundle, sglang_path = server_traffic_start(p, args, "sglang", "sglang")
    jit_bundles = _jit_bundles(args.jit_bundle, out)

    def said(run: dict) -> str:
        return (f"{run['compiles']} compiles, {run['cache_hits']} disk hits, {run['calls']} calls "
                f"({run['calls_by_kind']}), {len(run['batch_sizes'])} batch sizes, JIT calls {run['jit_calls']} "
                f"(unavailable: {sum(run['jit_unavailable'].values())}), JIT builds {run.get('jit_builds', '-')}, "
                f"first step {run['first_step_s']} s (autotune {run['first_step']['autotune_s']} s)")

    def env(node: Path) -> dict:
        e = traffic_env(work, node, sglang_path)
        if jit_bundles:  # the modules past Triton installed beside the node dir, the process guarded
            e |= _install_jit(jit_bundles, node, work, e, install=not args.jit_cold)
        return e

    child_args = (("--skip-jit",) if args.skip_jit else ()) + ("--sampling", str(args.sampling)) + \
        tuple(x for pair in args.jit_bundle for x in ("--jit-bundle", pair))
    traffic_runs(Path(__file__), args, bundle, work, out, env, lambda runs: coverage(runs, load_spec(manifest)),
                 said, child_args)
    cov = out["coverage"]
    failed = any("error" in r for r in out["runs"])
    missed = bool(cov.get("batch_sizes_missed") or cov.get("draft_widths_missed"))
    built = any(r.get("compiles") or r.get("jit_builds") or r.get("autotune_benchmarks") or
                (jit_bundles and not r.get("guarded")) for r in out["runs"])
    return 1 if failed or (args.expect_zero and (missed or built)) else 0


def _jit_bundles(given: list[str], out: dict) -> dict[str, str]:
    """The ``--jit-bundle LAYOUT=BUNDLE`` options as {layout: bundle}, each described in ``out["jit_bundles"]``."""
    jit_bundles = dict(pair.split("=", 1) for pair in given)
    out["jit_bundles"] = {layout: describe_bundle(Path(b)) for layout, b in jit_bundles.items()}
    return jit_bundles


def _install_jit(bundles: dict[str, str], node: Path, work: Path, env: dict, install: bool = True) -> dict:
    """Each JIT bundle installed for the process on ``node`` (sglang-jit: a fresh dir beside it; flashinfer-aot: the
    AOT dir of the FlashInfer that process imports, emptied first; ``install=False``: left empty); the process's added
    environment: those dirs, and the guard (warn, armed at import) with a metrics file, whose JIT build count the
    child reads back."""
    import shutil

    from prewarm import jit

    added = guard_env(node, env)
    for layout, bundle in bundles.items():
        lib = jit.for_layout(layout)
        if lib.env_var:  # a dir the process is pointed at: a fresh one beside the node's
            where = Path(f"{node}.{layout}")
            added[lib.env_var] = str(where)
        else:  # inside the library's package (FlashInfer's AOT dir): where that process's copy reads
            where = lib.node_dir(env)
        shutil.rmtree(where, ignore_errors=True)
        if install:
            run_cli(["install", bundle, "--cache-dir", str(where)], env, 120)
    return added


if __name__ == "__main__":
    sys.exit(main())
