"""Helpers the tests import by name (a module of its own: every test directory has a `conftest`)."""
from __future__ import annotations

import base64
import json
import multiprocessing
import random
import shutil
import subprocess
import sys
from pathlib import Path

from prewarm.shipping.bundle import GROUP_PREFIX, absolute_group, relative_group

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
TOOLKIT = REPO / "build" / "cuda"  # .ci/setup's CUDA toolkit (pip nvcc): CUDA_HOME of the JIT build box and "node"
JIT_MODULE = "sgl_kernel_jit_kda_packed_decode_8_8_true"  # sglang's packed decode: 8 warps, PDL (Hopper)
# sglang's packed decode planned on an H200 (decode batches 1..8): a few Triton compiles, and sglang's JIT module for
# the batch of 8 (bf16, int32 indices, fp32 gate parameters: what it covers)
JIT_MANIFEST = """
name = "jit-pipeline"
[target]
backend = "cuda"
arch = "sm_90"
device = "H200"
[spec.model]
kda_heads = 32
head_k_dim = 128
head_v_dim = 128
layers = 1
[spec.dtypes]
activation = "bfloat16"
gate = "bfloat16"
beta = "bfloat16"
gate_params = "float32"
index = ["int32"]
[spec.serving]
prefill = false
decode_batch_buckets = [1, 8]
max_running_requests = 8
[spec.sglang]
paths = ["packed_decode"]
beta_row_strides = [32]
mamba_pool_slots = 9  # max_running_requests + sglang's padding slot
sampling_backend = "pytorch"
[[kernels]]
provider = "prewarm.providers.sglang.cuda"
"""


def build_toy_cache(cache_dir: Path) -> Path:
    """Compile 5 small kernels (2 functions) into ``cache_dir`` in a fresh process (tests/fixtures/toy_cache.py,
    through prewarm's offline CUDA target); returns it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, str(FIXTURES / "toy_cache.py"), str(cache_dir)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"compiling the toy kernels failed:\n{p.stderr[-3000:]}")
    return cache_dir


def copy_cache(src: Path, dest: Path) -> Path:
    """A copy of a cache as if it had been built at ``dest``: each group file rewritten by bundle.py into its
    relative form, then its installed form at the copy (what pack + install do, without a bundle)."""
    shutil.copytree(src, dest, symlinks=True)
    for grp in dest.glob(f"*/{GROUP_PREFIX}*.json"):
        entry = grp.parent
        rel, _ = relative_group(grp.read_bytes(), entry.name, {f.name for f in entry.iterdir()}, str(grp))
        grp.write_bytes(absolute_group(rel, str(entry)))
    return dest


def synthetic_cache(root: Path, entries: int, seed: int = 0, scale: float = 0.1) -> Path:
    """``entries`` Triton-shaped key dirs under ``root``, for tests that need many entries fast (a real compile takes
    about a second): a cubin of random bytes, a ptx of text, metadata and a group file with absolute child paths,
    ~265 KB x ``scale`` each. Not compiled code: tests of real kernels use the toy cache. (bench/ship.py has its
    own generator, shaped like an H200 cache for measuring throughput; tests never import a bench.)"""
    rng = random.Random(seed)
    for _ in range(entries):
        key = base64.b32encode(rng.randbytes(32)).decode().rstrip("=")
        entry = root / key
        entry.mkdir(parents=True)
        files = {"k.cubin": rng.randbytes(int(160_000 * scale)),
                 "k.ptx": b"".join(b"add.f32 %%r%d;\n" % rng.randrange(1 << 16) for _ in range(int(7_000 * scale))),
                 "k.json": json.dumps({"name": "k", "hash": key}).encode()}
        files[f"{GROUP_PREFIX}k.json"] = json.dumps({"child_paths": {n: str(entry / n) for n in files}}).encode()
        for name, data in files.items():
            (entry / name).write_bytes(data)
    return root


def build_jit_bundles(work: Path, env: dict[str, str]) -> dict[str, Path]:
    """``JIT_MANIFEST`` built without a GPU into ``work/build`` (the Triton cache; sglang's module beside it, built by
    sglang's own load_jit with ``env``'s CUDA_HOME) and each dir packed: {manifest, bundle (Triton), jit (sglang-jit)}."""
    assert (TOOLKIT / "bin" / "nvcc").is_file(), f"{TOOLKIT}: run .ci/setup (it assembles this CUDA toolkit)"
    work.mkdir(parents=True, exist_ok=True)
    manifest = work / "jit.toml"
    manifest.write_text(JIT_MANIFEST)
    p = run_cli("build", manifest, "--cache-dir", work / "build", "--json", env=env)
    report = json.loads(p.stdout)
    assert [(j["library"], j["name"], j["hit"]) for j in report["jit"]] == [("sglang", JIT_MODULE, True)], report["jit"]
    assert report["jit_dirs"] == {"sglang-jit": str(work / "build.sglang-jit")}
    for suffix in ("", ".sglang-jit"):
        run_cli("pack", work / f"build{suffix}", "-o", work / f"bundle{suffix}", env=env)
    return {"manifest": manifest, "bundle": work / "bundle", "jit": work / "bundle.sglang-jit"}


def run_cli(*args: str, env: dict | None = None, check: int | None = 0) -> subprocess.CompletedProcess:
    """Run the real `prewarm` command line in a fresh process."""
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True, env=env)
    if check is not None and p.returncode != check:
        raise AssertionError(f"prewarm {' '.join(map(str, args))} exited {p.returncode}, expected {check}:\n{p.stdout}\n{p.stderr}")
    return p


def _install_in_child(source: str, cache: str, storage_options: dict | None, q) -> None:
    from prewarm.shipping.install import install

    r = install(source, cache, storage_options=storage_options)
    q.put((r.installed, r.noop))


def concurrent_installs(source, cache: Path, n: int = 16, storage_options: dict | None = None) -> list[tuple]:
    """``n`` forked processes install ``source`` into one cache dir at once, as a node's ranks do; each must exit 0.
    Returns (entries installed, no-op) per process."""
    from prewarm.node import fingerprint

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


def shipped_table_statuses(manifest, requests) -> dict[str, list[str]]:
    """Each planned tuning key of ``manifest``'s requests against its shipped autotune table (``[target] tuned``),
    as a build applies it: label lists by status ("in table", "absent", "stale", "unknown")."""
    from prewarm.building import autotune
    from prewarm.planning.plan import manifest_device_name

    report = autotune.apply_table(autotune.table_path(manifest), manifest_device_name(manifest, "tuned"),
                                  autotune.planned_tunings(requests), None)
    out: dict[str, list[str]] = {}
    for r in report.results:
        out.setdefault(r.status, []).append(r.tuning.label)
    return out
