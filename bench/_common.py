"""Helpers shared by the benches: environment for child processes, prewarm CLI calls, traffic, in-process probes.

The benches run from a plain checkout (the project is not pip-installed on the GPU box), so every child process
gets ``PYTHONPATH = <shim>:<repo>:...`` where ``<shim>/prewarm_kernels`` is a symlink to ``kernels/``: that makes
``prewarm`` and ``prewarm_kernels`` importable in the child *and* in the spawned build workers it starts, which an
in-process import hook would not reach.

Traffic: every bench drives the kernels with ``prewarm_kernels.kda.traffic`` (seeded, server-like calls of the
public API, written independently of the planner's call builder ``prewarm_kernels.kda.serving``, which no bench may
call: a proof driven by the planner's own calls cannot see what the plan misses).

Probes (installed inside a measuring child):
- compiles: ``triton.knobs.compilation.listener``; ``cache_hit=False`` is a real compile (kept with the label of the
  call that made it and its key dir), ``True`` a disk hit.
- autotune benchmarks and seconds: calls of ``Autotuner._bench`` (one per candidate config measured; none where
  the autotune results were read from the cache) and the time spent inside (compiling and benchmarking each).
- launcher builds: ``triton.runtime.build._build`` (the gcc build of a per-signature launcher / cuda_utils).
- per-launch latency: ``prewarm_kernels.launch.launch`` is the single launch point; it is wrapped before any
  kernel module imports it, and each launch is timed between two device synchronizations.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path(os.environ.get("PREWARM_BENCH_WORK", "/tmp/prewarm-bench"))
DEFAULT_MANIFEST = REPO / "manifests" / "kimi-linear-h200.toml"

TESTS = REPO / "tests"  # the independent traffic generators: ``traffic.<module>`` (tests/traffic/__init__.py)
for _path in (TESTS, REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from prewarm.shipping.bundle import INDEX, parse_index  # noqa: E402
from prewarm.shipping.cachedir import write_atomic  # noqa: E402


def import_kernels() -> None:
    """Make ``prewarm_kernels`` importable in this process when the project is not installed: map ``kernels/``
    to that name (the in-process counterpart of :func:`child_env`'s shim)."""
    try:
        import prewarm_kernels  # noqa: F401  (installed)
    except ImportError:
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "prewarm_kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["prewarm_kernels"] = mod
        spec.loader.exec_module(mod)


def log(msg: str) -> None:
    sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")  # one write: ranks share the terminal
    sys.stdout.flush()


def write_json(path: str | Path, obj) -> Path:
    """Rewritten after every measurement: whole or not at all (a stopped run keeps the last complete one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode(), durable=False)
    return path


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def files_under(path: Path) -> set[str]:
    """Every file below ``path``, relative to it (a cache dir's before/after listing)."""
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} if path.exists() else set()


# --- command lines -------------------------------------------------------------------------------------------


def bench_parser(doc: str, name: str, manifest: Path = DEFAULT_MANIFEST) -> argparse.ArgumentParser:
    """A GPU bench's command line: --manifest, --out (``bench/results/NAME.json``), --work-dir, --timeout, and the
    hidden options of its measuring child: --child, --result (the JSON the child writes)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--manifest", default=str(manifest))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / f"{name}.json"))
    p.add_argument("--work-dir", default=str(DEFAULT_WORK), help="scratch space: node dirs, bundles, child results")
    p.add_argument("--timeout", type=float, default=420, help="seconds allowed to a build or a measuring process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def kernel_bench_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """A kernel bench's command line: --out (``bench/results/NAME.json``) and --workers (its `prewarm build`)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / f"{name}.json"))
    p.add_argument("--workers", type=int, default=None, help="build processes (default: CPU count)")
    return p


def cuda_missing() -> bool:
    """True, said on stderr, when no CUDA GPU is visible (a kernel bench then exits 2)."""
    import torch

    if torch.cuda.is_available():
        return False
    print("needs a CUDA GPU", file=sys.stderr)
    return True


def add_seed_options(p: argparse.ArgumentParser, seeds: str, calls: int) -> None:
    """The options of a bench that runs one fresh process per seed on a fresh install (see :func:`seed_runs`)."""
    p.add_argument("--bundle", help="bundle dir to install (e.g. built and packed on a CPU box): every seed runs on it")
    p.add_argument("--seeds", default=seeds, help="comma-separated, distinct; one fresh process each")
    p.add_argument("--device-runs", type=int, default=0,
                   help="also build a --mode device bundle here and run the first N seeds on it")
    p.add_argument("--calls", type=int, default=calls, help="calls per step (the first step: the first CALLS calls)")
    p.add_argument("--steps", type=int, default=4, help="steps per process")
    p.add_argument("--expect-zero", action="store_true", help="exit 1 if any process compiled or failed")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)


def parse_seed_options(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse; outside the child, ``--seeds`` becomes a list and the options of :func:`add_seed_options` are checked
    (exit 2 naming the option)."""
    args = p.parse_args()
    if args.child:
        return args
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if len(set(args.seeds)) != len(args.seeds) or not args.seeds:
        p.error(f"--seeds {args.seeds}: expected distinct seeds, at least one")
    if args.calls < 1 or args.steps < 1 or not 0 <= args.device_runs <= len(args.seeds):
        p.error("--calls and --steps must be >= 1, --device-runs between 0 and the number of seeds")
    return args


# --- child processes -----------------------------------------------------------------------------------------


def child_env(work: Path, **extra: str) -> dict[str, str]:
    """Environment for any child: repo, kernels shim and tests/ (the traffic generators) on PYTHONPATH, no inherited
    Triton cache dir."""
    shim = work / "shim"
    link = shim / "prewarm_kernels"
    if link.is_symlink() and Path(os.readlink(link)) != REPO / "kernels":
        link.unlink()  # left by a run from another checkout
    if not link.exists():
        shim.mkdir(parents=True, exist_ok=True)
        link.symlink_to(REPO / "kernels", target_is_directory=True)
    env = dict(os.environ)
    env.pop("TRITON_CACHE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), str(REPO), str(TESTS), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def traffic_env(work: Path, node: Path, server_dir: str | None) -> dict[str, str]:
    """A measuring process on an installed node as the pre-launch job starts the server: ``TRITON_CACHE_DIR`` = the
    node dir, ``TRITON_CACHE_AUTOTUNING=1`` (deploy/prelaunch.sh exports it), the server's package dir (if given)
    first on PYTHONPATH."""
    env = child_env(work, TRITON_CACHE_DIR=str(node), TRITON_CACHE_AUTOTUNING="1")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (server_dir, env["PYTHONPATH"]) if x)
    return env


def run_cli(args: list[str], env: dict[str, str], timeout: float, check: bool = True) -> tuple[int, float]:
    """Run ``prewarm ARGS`` (as ``python -m prewarm.cli``) with live output; returns (exit code, wall seconds)."""
    cmd = [sys.executable, "-m", "prewarm.cli", *args]
    log("$ prewarm " + " ".join(args))
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout).returncode
    dt = time.perf_counter() - t0
    if check and rc != 0:
        raise RuntimeError(f"`prewarm {' '.join(args)}` exited {rc} after {dt:.1f}s")
    return rc, dt


def run_child(script: Path, args: list[str], env: dict[str, str], result: Path, timeout: float) -> dict:
    """Run ``python SCRIPT ARGS`` in a fresh process; it writes its measurement to ``result`` (JSON)."""
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), *args, "--result", str(result)]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout).returncode
    if not result.exists():
        raise RuntimeError(f"child {script.name} {' '.join(args)} exited {rc} without writing {result}")
    data = json.loads(result.read_text())
    data["process_wall_s"] = time.perf_counter() - t0
    if rc != 0 or data.get("error"):
        raise RuntimeError(f"child {script.name} {' '.join(args)} failed (rc {rc}): {data.get('error')}")
    return data


def prepare_bundle(manifest: Path, work: Path, timeout: float = 420, fallback: bool = True) -> dict:
    """Build the manifest's cache on this GPU (device mode: compile, autotune, launchers) in a scratch dir, pack
    it into ``work/bundle``, and delete the scratch dir so nothing can be read from the build path later. Where the
    device build fails: an offline build instead (``fallback``), else the error."""
    env = child_env(work)
    build_dir = fresh_dir(work / "build-cache")
    bundle = work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    mode = "device"
    rc, t_build = run_cli(["build", str(manifest), "--cache-dir", str(build_dir), "--mode", mode], env, timeout,
                          check=not fallback)
    if rc != 0:  # still measure something: an offline build has every kernel but no autotune results
        log(f"device build exited {rc}: falling back to an offline build (the warm run will autotune)")
        mode = f"offline (device build exited {rc})"
        build_dir = fresh_dir(build_dir)
        _, t_build = run_cli(["build", str(manifest), "--cache-dir", str(build_dir), "--mode", "offline"], env,
                             timeout)
    _, t_pack = run_cli(["pack", str(build_dir), "-o", str(bundle)], env, 120)
    shutil.rmtree(build_dir)
    return {"bundle": str(bundle), "build_mode": mode, "build_s": t_build, "pack_s": t_pack,
            "build_dir_deleted": not build_dir.exists()}


def bundle_for(given: str | None, manifest: Path, work: Path, timeout: float, reuse_work: bool = False,
               fallback: bool = True) -> tuple[Path, dict]:
    """The bundle a bench installs, and its description with ``prepare`` (how it came): ``given`` (``--bundle``: a
    dir without an index is refused, naming it); else ``WORK/bundle`` left by an earlier bench (``reuse_work``);
    else a device build made here (:func:`prepare_bundle`)."""
    if given:
        bundle, prepare = Path(given).resolve(), {"reused": True}
        if not (bundle / INDEX).is_file():
            raise RuntimeError(f"--bundle {bundle}: no {INDEX} there (expected a `prewarm pack` dir)")
    elif reuse_work and (work / "bundle" / INDEX).is_file():
        bundle, prepare = work / "bundle", {"reused": True}
    else:
        log("device build + pack of the manifest (the scratch build dir is deleted afterwards)")
        prepare = prepare_bundle(manifest, work, timeout, fallback)
        bundle = Path(prepare["bundle"])
    log(f"bundle {bundle}")
    return bundle, describe_bundle(bundle) | {"prepare": prepare}


def install_bundle(bundle: Path, cache_dir: Path, work: Path) -> float:
    """Install into a fresh dir through the real pre-launch path (verify hashes + fingerprint, relocate)."""
    fresh_dir(cache_dir)
    return run_cli(["install", str(bundle), "--cache-dir", str(cache_dir)], child_env(work), 120)[1]


def describe_bundle(bundle: Path) -> dict:
    """What a bundle holds, read by prewarm's own index reader: entries, files, bytes, and the autotune results in
    it (a ``--mode device`` build keeps them, an offline build has none: its nodes benchmark each autotuned kernel
    once per process)."""
    index = parse_index((bundle / INDEX).read_bytes(), str(bundle / INDEX))
    files = [f for e in index.entries for f in e.files]
    return {"bundle": str(bundle), "manifest": index.manifest, "entries": len(index.entries), "files": len(files),
            "bytes": index.total_size, "autotune_results": sum(f.path.endswith(".autotune.json") for f in files)}


def seed_runs(label: str, bundle: Path, seeds: list[int], work: Path, measure) -> Iterator[dict]:
    """Per seed, a fresh ``prewarm install`` of ``bundle`` into a new node dir and ``measure(node, seed) -> dict``
    (a fresh measuring process) on it; yields each run (``bundle``, ``seed``, ``install_s`` and what ``measure``
    returned, or ``error``: the next seed still runs) after its node dir is removed."""
    for seed in seeds:
        node = work / f"node-{label}-{seed}"
        run = {"bundle": label, "seed": seed}
        try:
            run["install_s"] = round(install_bundle(bundle, node, work), 3)
            run |= measure(node, seed)
        except Exception as e:  # noqa: BLE001 - record it, run the next seed
            run["error"] = f"{type(e).__name__}: {e}"
            log(f"{label} seed {seed} FAILED: {run['error']}")
        finally:
            shutil.rmtree(node, ignore_errors=True)
        yield run


def traffic_runs(script: Path, args: argparse.Namespace, bundle: Path, work: Path, out: dict, env, coverage, said,
                 child_args: tuple[str, ...] = ()) -> None:
    """A traffic bench's processes: per seed (:func:`seed_runs` on ``bundle``) ``script --child`` in ``env(node)``
    with the seed's options and ``child_args``, its run said in a log line (``said(run)``); after each, ``out``'s
    ``runs`` and ``coverage`` (``coverage(runs)``: what they saw together) are rewritten to ``args.out``."""

    def measure_on(node: Path, seed: int) -> dict:
        run = run_child(script, ["--child", "--seed", str(seed), "--manifest", args.manifest, "--calls",
                                 str(args.calls), "--steps", str(args.steps), *child_args],
                        env(node), work / f"result-{seed}.json", timeout=args.timeout)
        log(f"seed {seed}: {said(run)}")
        return run

    for run in seed_runs("offline", bundle, args.seeds, work, measure_on):
        out["runs"].append(run)
        out["coverage"] = coverage(out["runs"])
        write_json(args.out, out)
    log(f"coverage: {out['coverage']}")


def traffic_start(args: argparse.Namespace, name: str) -> tuple[Path, Path, dict]:
    """A traffic bench's start: its work dir ``WORK_DIR/name`` (made), the manifest's resolved path, and the head
    of its JSON (``out``: manifest as given, bundles, calls per step, steps, runs)."""
    work = Path(args.work_dir).resolve() / name
    work.mkdir(parents=True, exist_ok=True)
    out = {"manifest": args.manifest, "bundles": {}, "calls_per_step": args.calls, "steps": args.steps, "runs": []}
    return work, Path(args.manifest).resolve(), out


def server_traffic_parser(doc: str, name: str, manifest: Path, package: str, calls: int,
                          steps: int = 4) -> argparse.ArgumentParser:
    """A server traffic bench's command line: :func:`bench_parser`'s, :func:`add_seed_options`' (seeds 1..5, ``calls``
    per step, ``steps`` per process), and ``--PACKAGE-path DIR``: the server's package without installing it."""
    p = bench_parser(doc, name, manifest=manifest)
    add_seed_options(p, seeds="1,2,3,4,5", calls=calls)
    p.set_defaults(steps=steps)
    p.add_argument(f"--{package}-path", help=f"dir holding the {package} package (e.g. the carried build/{package}), "
                                             "put first on the measuring processes' PYTHONPATH")
    return p


def server_traffic_start(p: argparse.ArgumentParser, args: argparse.Namespace, name: str,
                         package: str) -> tuple[Path, Path, dict, Path, str | None]:
    """A server traffic bench's start: ``--PACKAGE-path`` resolved (a dir without the package is refused: exit 2,
    naming it), then :func:`traffic_start`'s work dir, manifest and JSON head, and the ``--bundle`` it installs
    (:func:`bundle_for`, described in ``out["bundles"]["offline"]``)."""
    server_dir = None
    if given := getattr(args, f"{package}_path"):
        server_dir = Path(given).resolve()
        if not (server_dir / package).is_dir():
            p.error(f"--{package}-path {server_dir}: no {package} package there (expected DIR/{package}/, "
                    f"e.g. build/{package})")
        server_dir = str(server_dir)
    work, manifest, out = traffic_start(args, name)
    bundle, out["bundles"]["offline"] = bundle_for(args.bundle, manifest, work, args.timeout)
    return work, manifest, out, bundle, server_dir


def guard_env(node: Path, env: dict[str, str]) -> dict[str, str]:
    """What a measuring process on ``node`` adds to ``env`` to run under ``prewarm guard`` as ``prewarm guard --``
    starts it (its sitecustomize first on PYTHONPATH, warn, armed at import) with a fresh metrics file beside the
    node dir, whose JIT build count the process reads back."""
    from prewarm.node.guard import MODE
    from prewarm.node.metrics import TEXTFILE
    from prewarm.planning.record import hooked_pythonpath

    site = hooked_pythonpath().split(os.pathsep)[0]
    added = {MODE: "warn", TEXTFILE: str(node) + ".prom", "PYTHONPATH": os.pathsep.join((site, env["PYTHONPATH"]))}
    Path(added[TEXTFILE]).unlink(missing_ok=True)
    return added


def result_header(manifest: Path) -> dict:
    """The first keys of a bench's JSON: which manifest (relative to the repo where it is in it), when."""
    return {"manifest": str(manifest.relative_to(REPO) if manifest.is_relative_to(REPO) else manifest),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def load_spec(manifest: Path) -> dict:
    """The spec a provider receives: the envelope the traffic generator draws calls within."""
    from prewarm.planning.manifest import load

    return load(manifest).spec()


# --- in-process probes (used inside a measuring child, after torch/CUDA init) ----------------------------------


class Probes:
    """Counts compiles, disk hits, autotune seconds, launcher builds and per-launch latency in this process."""

    def __init__(self):
        import triton
        from triton import knobs
        from triton.runtime import build
        from triton.runtime.autotuner import Autotuner

        self.compiles: dict[str, int] = defaultdict(int)
        self.compile_s: dict[str, float] = defaultdict(float)
        self.hits: dict[str, int] = defaultdict(int)
        self.autotune_s: dict[str, float] = defaultdict(float)
        self.autotune_benchmarks: dict[str, int] = defaultdict(int)
        self.launcher_builds = 0
        self.launcher_build_s = 0.0
        self.launchers_built: list[dict] = []  # one row per C module built (cuda_utils, a launcher): name, the call
        self.launches: dict[str, dict] = {}
        self.compiled: list[dict] = []  # one row per real compile: kernel, the call that made it, its key dir
        self.during = ""  # label of the call now running (set by :func:`run_calls`)
        self.triton_version = triton.__version__
        self.cache_dir = knobs.cache.dir

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            name = getattr(src, "name", "?")
            if cache_hit:
                self.hits[name] += 1
            else:
                self.compiles[name] += 1
                self.compile_s[name] += times.total / 1e6
                key = {Path(p).parent.name for p in metadata_group.values()} if metadata_group else set()
                self.compiled.append({"kernel": name, "during": self.during, "key": ",".join(sorted(key))})

        knobs.compilation.listener = listener

        orig_bench = Autotuner._bench

        def timed_bench(tuner, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig_bench(tuner, *args, **kwargs)
            finally:
                self.autotune_s[tuner.base_fn.__name__] += time.perf_counter() - t0
                self.autotune_benchmarks[tuner.base_fn.__name__] += 1

        Autotuner._bench = timed_bench

        orig_build = build._build

        def timed_build(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig_build(*args, **kwargs)
            finally:
                self.launcher_builds += 1
                self.launcher_build_s += time.perf_counter() - t0
                self.launchers_built.append({"module": args[0] if args else kwargs.get("name"), "during": self.during})

        build._build = timed_build

    def wrap_launch(self, sync) -> None:
        """Time every launch through ``prewarm_kernels.launch.launch``; must run before kernel modules import it."""
        import prewarm_kernels.launch as lm
        from prewarm.building.tritoncompat import jit_function

        if any(m.startswith("prewarm_kernels.") and m != "prewarm_kernels.launch" for m in sys.modules):
            raise RuntimeError("wrap_launch must run before any kernel module is imported")
        orig = lm.launch

        def timed_launch(kernel, grid, *args, **kwargs):
            if lm._sink.get() is not None:  # planning capture: nothing runs
                return orig(kernel, grid, *args, **kwargs)
            name = jit_function(kernel).fn.__name__
            sync()
            t0 = time.perf_counter()
            orig(kernel, grid, *args, **kwargs)
            sync()
            dt = time.perf_counter() - t0
            rec = self.launches.setdefault(name, {"calls": 0, "first_call_s": dt, "max_call_s": 0.0, "total_s": 0.0})
            rec["calls"] += 1
            rec["max_call_s"] = max(rec["max_call_s"], dt)
            rec["total_s"] += dt

        lm.launch = timed_launch

    def snapshot(self) -> dict:
        return {
            "compiles": sum(self.compiles.values()),
            "compile_s": round(sum(self.compile_s.values()), 4),
            "cache_hits": sum(self.hits.values()),
            "autotune_s": round(sum(self.autotune_s.values()), 4),
            "autotune_benchmarks": sum(self.autotune_benchmarks.values()),
            "launcher_builds": self.launcher_builds,
            "launcher_build_s": round(self.launcher_build_s, 4),
        }

    def details(self) -> dict:
        return {
            "compiles_by_kernel": dict(self.compiles),
            "compile_s_by_kernel": {k: round(v, 4) for k, v in self.compile_s.items()},
            "cache_hits_by_kernel": dict(self.hits),
            "autotune_s_by_kernel": {k: round(v, 4) for k, v in self.autotune_s.items()},
            "autotune_benchmarks_by_kernel": dict(self.autotune_benchmarks),
            "launches_by_kernel": {k: {f: round(x, 6) if isinstance(x, float) else x for f, x in v.items()}
                                   for k, v in self.launches.items()},
            "compiled": self.compiled,
            "launchers_built": self.launchers_built,
        }


def diff(after: dict, before: dict) -> dict:
    return {k: round(after[k] - before[k], 4) if isinstance(after[k], float) else after[k] - before[k] for k in after}


def init_device(device: str = "cuda:0"):
    """torch + triton imported, then the CUDA context on ``device`` (made current), in a server's order (its imports,
    then its device): done before any timer starts (not what a cache can change)."""
    import torch
    import triton  # noqa: F401  (a guarded process installs the guard here)

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible: these benches measure a GPU run")
    torch.cuda.set_device(device)
    torch.empty(1, device=device).add_(1)
    torch.cuda.synchronize()
    return torch


# --- traffic -------------------------------------------------------------------------------------------------


def open_traffic(spec: dict, seed: int, n: int, device: str):
    """``n`` seeded server-like calls within the manifest's envelope (imports the kernels: time it where the
    first step is timed)."""
    from prewarm_kernels.kda.traffic import Envelope, calls

    return calls(Envelope.from_spec(spec), seed, n, device)


def timed_steps(open_traffic, step, steps: int, probes: Probes) -> tuple[dict, object]:
    """A measuring process's steps: ``traffic = open_traffic()`` (what it imports is part of the first step), then
    ``steps`` times ``step(traffic)``. Returns the first step's wall seconds and the probes after it
    (``first_step_s``, ``first_step``), and what the first ``step`` returned."""
    t0 = time.perf_counter()
    traffic = open_traffic()
    first = step(traffic)
    first_step_s = time.perf_counter() - t0
    after_first = probes.snapshot()
    for _ in range(steps - 1):
        step(traffic)
    return {"first_step_s": round(first_step_s, 3), "first_step": after_first}, first


def run_calls(traffic, n: int, probes: Probes | None, sync) -> list[str]:
    """Run the next ``n`` calls of ``traffic``, then synchronize the device; returns their labels. Compiles are
    attributed to the call that made them (``probes.during``)."""
    labels = []
    for call in itertools.islice(traffic, n):
        if probes is not None:
            probes.during = call.label
        try:
            call.run()
        except Exception as e:
            raise RuntimeError(f"the call {call.label!r} raised {type(e).__name__}: {e}") from e
        labels.append(call.label)
    sync()
    if len(labels) < n:
        raise RuntimeError(f"the traffic generator ran dry after {len(labels)} of {n} calls")
    return labels


def made_by() -> dict:
    """What made a measuring process's figures: the tree's commit (``PREWARM_COMMIT`` where the tree travelled without
    its git dir, else ``git rev-parse``), Python, torch, Triton and the device."""
    import platform

    import torch
    import triton

    commit = os.environ.get("PREWARM_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return {"commit": commit, "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def child_main(fn, args) -> int:
    """Run a child's measurement; always leave a JSON result (with ``error`` on failure; else with
    :func:`made_by`)."""
    try:
        data = fn(args)
        data["made_by"] = made_by()
        code = 0
    except BaseException as e:  # noqa: BLE001 - the parent needs the reason, whatever it is
        traceback.print_exc()
        data = {"error": f"{type(e).__name__}: {e}"}
        code = 1
    write_json(args.result, data)
    return code
