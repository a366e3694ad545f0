"""Install seconds per bundle layout (triton, sglang-jit, flashinfer-aot) against a plain copy of the same files, in
one run. A one-module JIT bundle took 7-10.5 s to install on the H200 host while 460 Triton entries took 1.3-1.5 s:
the node's toolchain factors of its library (importing it, running its compilers) were computed at every install.

    python bench/install_layouts.py [--build DIR] [--repeat 3] [--out bench/results/install_layouts.json]

The bundles: bench/jit-h200.toml built without a GPU (`prewarm build`: its Triton cache and, beside it, sglang's
packed decode module and FlashInfer's sampling module, each built by its library's own code; minutes: ``--build``
reuses a build dir), each dir packed. Each install runs as the pre-launch job runs it, a fresh `prewarm install`
process into a new dir, timed around the command (interpreter start and imports included; ``own_s`` is the
install's own time as it reports it):
- ``first``: into an empty dir: the node's factors computed (the library imported, its compilers run), remembered;
- ``again``: into another empty dir holding the node's record the first left (a node that installed there before:
  a pod start on a kept dir, a new bundle version): the factors reused;
- ``noop``: the same bundle again where it is installed (nothing to do).
Beside each, ``copy``: a plain copy of the same files (`cp -a` of the installed entries into a new dir, also a fresh
process). Every figure is the fastest of ``--repeat`` runs, installs and copies interleaved, so that load from other
users of the box hits both alike; ``ratio`` = install / copy.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench._common import child_env  # noqa: E402
from prewarm.shipping import nodestamp  # noqa: E402
from prewarm.shipping.cachedir import CacheDir  # noqa: E402
from prewarm.shipping.install import read_bundle  # noqa: E402

MANIFEST = REPO / "bench" / "jit-h200.toml"


def prewarm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, check=True)


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, p.stdout


def install(bundle: Path, dest: Path, env: dict) -> tuple[float, float]:
    wall, out = timed([sys.executable, "-m", "prewarm.cli", "install", str(bundle), "--cache-dir", str(dest), "--json"],
                      env)
    return wall, json.loads(out)["seconds"]


def copy(installed: Path, dest: Path, env: dict) -> float:
    """`cp -a` of every entry of ``installed`` (not prewarm's own dir) into ``dest``, as one process."""
    dest.mkdir()
    entries = [str(p) for p in installed.iterdir() if p.name != CacheDir(installed).meta.name]
    return timed(["cp", "-a", *entries, str(dest)], env)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="a build dir of bench/jit-h200.toml to reuse (default: built here)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prewarm-install-layouts-") as tmp:
        tmp = Path(tmp)
        env = child_env(tmp)
        env.setdefault("CUDA_HOME", str(REPO / "build" / "cuda"))  # .ci/setup's toolkit (pip nvcc): the node's
        build = args.build or tmp / "build"
        if args.build is None:
            prewarm("build", MANIFEST, "--cache-dir", build, env=env)
        dirs = [build, *sorted(p for p in build.parent.glob(f"{build.name}.*") if p.is_dir())]  # the Triton cache, then each JIT dir beside it
        results = {}
        for d in dirs:
            bundle = tmp / f"bundle-{d.name}"
            prewarm("pack", d, "-o", bundle, env=env)
            layout = read_bundle(str(bundle)).layout
            runs: dict[str, list[float]] = {k: [] for k in ("first", "first_own", "again", "again_own", "noop",
                                                            "noop_own", "copy")}
            for i in range(args.repeat):
                first, again, plain = tmp / f"{layout.name}-first-{i}", tmp / f"{layout.name}-again-{i}", \
                    tmp / f"{layout.name}-copy-{i}"
                wall, own = install(bundle, first, env)
                runs["first"].append(wall), runs["first_own"].append(own)
                record = nodestamp.record_name(layout.name)
                CacheDir(again).meta.mkdir(parents=True)
                shutil.copy2(CacheDir(first).meta / record, CacheDir(again).meta / record)
                runs["copy"].append(copy(first, plain, env))
                wall, own = install(bundle, again, env)
                runs["again"].append(wall), runs["again_own"].append(own)
                wall, own = install(bundle, first, env)
                runs["noop"].append(wall), runs["noop_own"].append(own)
            index = read_bundle(str(bundle)).index
            best = {k: round(min(v), 3) for k, v in runs.items()}
            results[layout.name] = {
                "entries": len(index.entries), "files": sum(len(e.files) for e in index.entries),
                "mb": round(sum(f.size for e in index.entries for f in e.files) / 1e6, 2),
                **{f"{k}_s": v for k, v in best.items()},
                "ratio_first": round(best["first"] / best["copy"], 1),
                "ratio_again": round(best["again"] / best["copy"], 1),
            }
    doc = {"bench": "install_layouts", "manifest": str(MANIFEST.relative_to(REPO)), "build_reused": bool(args.build),
           "repeat": args.repeat,
           "host": platform.node(), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
           "layouts": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
