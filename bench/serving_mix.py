"""Run a manifest's serving mix on real tensors against a Triton cache dir and count the compiles (H200).

Scenarios (JSON to --out, a short summary on stdout):
  run          one run of every provider's ``run(spec, device)`` in a fresh process, compiles counted by Triton's
               compilation listener (cache_hit=False), disk hits counted too, new files in the cache dir listed
               (launchers, autotune results). ``--expect-zero`` exits 1 if anything compiled.
  record-loop  record -> build -> rerun: (1) ``prewarm record`` a cold run of this script (fresh process, empty
               cache), (2) ``prewarm build`` a manifest made of that record into a second empty cache, (3) rerun
               the mix on it in a fresh process: expected 0 compiles. (Library calls, not the CLI.)

Examples:
  python bench/serving_mix.py --cache-dir /tmp/cold --out bench/results/serving_mix_cold.json
  python bench/serving_mix.py --cache-dir /tmp/prewarmed --expect-zero --out bench/results/serving_mix_warm.json
  python bench/serving_mix.py --copy-from .carry/kl-cache --cache-dir /tmp/kl-warm --expect-zero
  python bench/serving_mix.py --scenario record-loop --work-dir /tmp/loop --out bench/results/record_loop.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_WORK, REPO, child_env  # noqa: E402  (kernels shim: the GPU box has no pip install)


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} if path.exists() else set()


def relocate(cache: Path) -> int:
    """Point every group file's children at this cache dir (what `prewarm install` does); returns files fixed."""
    fixed = 0
    for grp in cache.glob("*/__grp__*.json"):
        doc = json.loads(grp.read_text())
        children = {name: str(grp.parent / name) for name in doc.get("child_paths", {})}
        if children != doc.get("child_paths"):
            grp.write_text(json.dumps({"child_paths": children}))
            fixed += 1
    return fixed


def run_fresh(args, out: Path) -> dict:
    """The run scenario in a fresh process (imports nothing of the mix here), with the kernels shim on its path."""
    cache = Path(args.cache_dir).resolve()
    relocated = 0
    if args.copy_from:
        if cache.exists() and any(cache.iterdir()):
            raise SystemExit(f"serving_mix: --cache-dir {cache} is not empty; --copy-from needs a fresh dir")
        shutil.copytree(Path(args.copy_from).resolve(), cache, dirs_exist_ok=True)
        relocated = relocate(cache)
    cache.mkdir(parents=True, exist_ok=True)
    # Both must be set before triton and the kernels are imported (the Autotuner reads the knob at import).
    env = child_env(DEFAULT_WORK, TRITON_CACHE_DIR=str(cache), TRITON_CACHE_AUTOTUNING="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--manifest", args.manifest,
           "--device", args.device, "--cache-dir", str(cache), "--out", str(out)]
    out.unlink(missing_ok=True)
    done = subprocess.run(cmd, env=env, cwd=REPO, timeout=args.timeout)
    if not out.exists():
        raise SystemExit(f"serving_mix: the measuring process exited {done.returncode} without a result")
    doc = json.loads(out.read_text())
    doc["relocated_group_files"] = relocated
    return doc


def run_mix(args) -> dict:
    """In the fresh child: run every provider's mix once, counting compiles with Triton's listener."""
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = files_under(cache)
    print(f"[serving_mix] cache {cache}: {len(before)} files before", flush=True)

    import importlib

    import torch
    import triton
    from triton import knobs

    from prewarm.manifest import load

    compiles, hits = [], 0

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        nonlocal hits
        if cache_hit:
            hits += 1
        else:
            compiles.append(metadata.get("name", "?"))

    knobs.compilation.listener = listener
    manifest = load(args.manifest)
    spec = manifest.spec()
    providers = [k.ref for k in manifest.kernels if k.kind == "provider"]
    if not torch.cuda.is_available():
        raise SystemExit("serving_mix: no CUDA device visible")
    per_provider, error = {}, None
    start = time.perf_counter()
    try:
        for name in providers:
            t0 = time.perf_counter()
            print(f"[serving_mix] {name}.run(spec, {args.device!r}) ...", flush=True)
            importlib.import_module(name).run(spec, args.device)
            torch.cuda.synchronize()
            per_provider[name] = round(time.perf_counter() - t0, 3)
    except Exception:  # keep what was counted so far: the JSON says what failed
        import traceback

        error = traceback.format_exc()[-4000:]
        print(error, flush=True)
    seconds = time.perf_counter() - start
    new = sorted(files_under(cache) - before)
    return {
        "scenario": "run",
        "error": error,
        "manifest": manifest.name,
        "cache_dir": str(cache),
        "cache_files_before": len(before),
        "compiles": len(compiles),
        "compiled_kernels": sorted(set(compiles)),
        "disk_hits": hits,
        "seconds": round(seconds, 3),
        "per_provider_seconds": per_provider,
        "new_cache_files": len(new),
        "new_launchers_or_utils": sorted(f for f in new if f.endswith(".so")),
        "new_autotune_results": sorted(f for f in new if f.endswith(".autotune.json")),
        "device": torch.cuda.get_device_name(0),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def read_step(path: Path, step: str) -> dict:
    if not path.exists():
        raise SystemExit(f"serving_mix: step {step} left no result ({path}); its output is above")
    return json.loads(path.read_text())


def record_loop(args) -> dict:
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rec, cold, built = work / "record.jsonl", work / "cold-cache", work / "built-cache"
    for d in (cold, built):
        if d.exists() and any(d.iterdir()):
            raise SystemExit(f"serving_mix: {d} is not empty; use a fresh --work-dir")
    me = [sys.executable, str(Path(__file__).resolve()), "--manifest", args.manifest, "--device", args.device]
    # The library, not the CLI: the GPU box may lack the CLI's rich; these need only triton, torch, filelock.
    record_cmd = [sys.executable, "-c", "import sys; from prewarm.record import record; "
                  "sys.exit(record(sys.argv[1], sys.argv[2:]).returncode)"]
    build_cmd = [sys.executable, "-c", "import json, sys; from prewarm.build import build; "
                 "r = build(sys.argv[1], sys.argv[2], mode=sys.argv[3]); print(json.dumps(r.to_json())); "
                 "sys.exit(0 if r.ok else 4)"]
    env = child_env(DEFAULT_WORK)

    def step(name, cmd):
        print(f"[serving_mix] {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", flush=True)
        return done, round(time.perf_counter() - t0, 3)

    _, t_rec = step("1 record a cold run", record_cmd + [str(rec), *me, "--cache-dir", str(cold),
                                                         "--out", str(work / "cold.json")])
    cold_doc = read_step(work / "cold.json", "1 record a cold run")
    from prewarm.manifest import load

    m = load(args.manifest)
    manifest = work / "recorded.toml"
    manifest.write_text(
        f'name = "{m.name}-recorded"\n[target]\nbackend = "{m.backend}"\narch = "{m.arch}"\n'
        f"[model]\nkda_heads = {m.heads}\nhead_k_dim = {m.head_k_dim}\nhead_v_dim = {m.head_v_dim}\n"
        f'[[kernels]]\nrecord = "{rec}"\n'
    )
    b, t_build = step("2 build the record", build_cmd + [str(manifest), str(built), args.build_mode])
    build_doc = json.loads(b.stdout.strip().splitlines()[-1]) if b.stdout.strip() else {"error": b.stderr[-2000:]}
    _, t_rerun = step("3 rerun on the built cache", me + ["--cache-dir", str(built), "--out", str(work / "rerun.json")])
    rerun_doc = read_step(work / "rerun.json", "3 rerun on the built cache")
    return {
        "scenario": "record-loop",
        "recorded_lines": sum(1 for _ in rec.open()),
        "cold": {k: cold_doc[k] for k in ("compiles", "disk_hits", "seconds", "new_cache_files")} | {"wall": t_rec},
        "build": {k: build_doc.get(k) for k in ("requests", "compiles", "compiled", "present", "failed", "seconds")}
        | {"wall": t_build, "mode": args.build_mode},
        "rerun": {k: rerun_doc[k] for k in ("compiles", "disk_hits", "seconds", "new_cache_files",
                                            "compiled_kernels")} | {"wall": t_rerun},
        "zero_compiles_on_rerun": rerun_doc["compiles"] == 0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=("run", "record-loop"), default="run")
    p.add_argument("--manifest", default=str(REPO / "manifests/kimi-linear-h200.toml"))
    p.add_argument("--cache-dir", help="run: the Triton cache dir to use (created if missing)")
    p.add_argument("--work-dir", help="record-loop: where the record, caches and step reports go")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--copy-from", metavar="DIR",
                   help="run: copy a cache built elsewhere into the (fresh) --cache-dir and rewrite its group files "
                        "for the new location first (what `prewarm install` does, without a bundle)")
    p.add_argument("--timeout", type=float, default=420, help="seconds allowed per child process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build-mode", default="offline", choices=("offline", "device", "auto"),
                   help="record-loop: prewarm build mode for step 2")
    p.add_argument("--expect-zero", action="store_true", help="exit 1 if anything compiled")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.scenario == "run" and not args.cache_dir:
        p.error("--cache-dir is required for --scenario run")
    if args.scenario == "record-loop" and not args.work_dir:
        p.error("--work-dir is required for --scenario record-loop")
    out = Path(args.out or REPO / f"bench/results/serving_mix_{args.scenario}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.child:
        out.write_text(json.dumps(run_mix(args), indent=2) + "\n")
        return 0
    doc = run_fresh(args, out) if args.scenario == "run" else record_loop(args)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    if doc["scenario"] == "run":
        print(f"[serving_mix] {doc['manifest']}: {doc['compiles']} compiles, {doc['disk_hits']} disk hits, "
              f"{doc['seconds']} s, {doc['new_cache_files']} new cache files -> {out}")
        return 1 if doc.get("error") or (args.expect_zero and doc["compiles"]) else 0
    print(f"[serving_mix] record-loop: cold {doc['cold']['compiles']} compiles in {doc['cold']['seconds']} s; "
          f"build {doc['build']}; rerun {doc['rerun']['compiles']} compiles in {doc['rerun']['seconds']} s -> {out}")
    return 0 if doc["zero_compiles_on_rerun"] else 1


if __name__ == "__main__":
    sys.exit(main())
