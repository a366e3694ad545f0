"""Helpers the tests import by name (a module of its own: every test directory has a `conftest`)."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Compiles through Triton's real JIT path with a target-only driver (no GPU): real key dirs, real group files.
_BUILD_TOY_CACHE = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget

    class TargetOnlyDriver:
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0

    triton.runtime.driver.set_active(TargetOnlyDriver())

    @triton.jit
    def add(x, y, o, n, BS: tl.constexpr):
        i = tl.program_id(0) * BS + tl.arange(0, BS)
        m = i < n
        tl.store(o + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

    @triton.jit
    def scale(x, o, n, s, BS: tl.constexpr):
        i = tl.program_id(0) * BS + tl.arange(0, BS)
        tl.store(o + i, tl.load(x + i, mask=i < n) * s, mask=i < n)

    for bs in (64, 128, 256):
        add.warmup(torch.float32, torch.float32, torch.float32, 1000, BS=bs, grid=(1,))
    for n in (1000, 1024):
        scale.warmup(torch.float16, torch.float16, n, 2.0, BS=128, grid=(1,))
    """
)


def build_toy_cache(cache_dir: Path) -> Path:
    """Compile 5 small kernels (2 functions) into ``cache_dir`` in a fresh process; returns it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    script = cache_dir.parent / f"toy_kernels_{uuid.uuid4().hex[:8]}.py"  # @triton.jit needs a source file
    script.write_text(_BUILD_TOY_CACHE)
    p = subprocess.run([sys.executable, str(script), str(cache_dir)], capture_output=True, text=True)
    script.unlink()
    if p.returncode:
        raise RuntimeError(f"compiling the toy kernels failed:\n{p.stderr[-3000:]}")
    return cache_dir


def copy_cache(src: Path, dest: Path) -> Path:
    """A copy of a cache as if it had been built at ``dest``: group files point into the copy."""
    shutil.copytree(src, dest, symlinks=True)
    for grp in dest.glob("*/__grp__*.json"):
        doc = json.loads(grp.read_text())
        doc["child_paths"] = {c: str(grp.parent / Path(p).name) for c, p in doc["child_paths"].items()}
        grp.write_text(json.dumps(doc))
    return dest


def _load_bench_ship():
    spec = importlib.util.spec_from_file_location("prewarm_bench_ship", REPO / "bench" / "ship.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic_cache(root: Path, entries: int, seed: int = 0, scale: float = 0.1) -> Path:
    """A Triton-like cache of ``entries`` key dirs (bench/ship.py's generator; ``scale`` 1 = ~260 KB/entry)."""
    _load_bench_ship().make_cache(root, entries, seed=seed, scale=scale)
    return root


def run_cli(*args: str, env: dict | None = None, check: int | None = 0) -> subprocess.CompletedProcess:
    """Run the real `prewarm` command line in a fresh process."""
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True, env=env)
    if check is not None and p.returncode != check:
        raise AssertionError(f"prewarm {' '.join(map(str, args))} exited {p.returncode}, expected {check}:\n{p.stdout}\n{p.stderr}")
    return p


def _install_in_child(source: str, cache: str, storage_options: dict | None, q) -> None:
    from prewarm.install import install

    r = install(source, cache, storage_options=storage_options)
    q.put((r.installed, r.noop))


def concurrent_installs(source, cache: Path, n: int = 16, storage_options: dict | None = None) -> list[tuple]:
    """``n`` forked processes install ``source`` into one cache dir at once, as a node's ranks do; each must exit 0.
    Returns (entries installed, no-op) per process."""
    from prewarm import fingerprint

    fingerprint.current()  # paid once in the parent; forked ranks inherit it
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_install_in_child, args=(str(source), str(cache), storage_options, q))
             for _ in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * n
    return results
