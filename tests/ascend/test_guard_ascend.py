"""prewarm guard on triton 3.2 (triton-ascend): a process under `prewarm guard --mode error` finds the planned
kernel on disk (compiled by an offline build with stand-in CANN) and is refused the unplanned one before compiling,
with the explanation against the plan (tests/test_guard.py has the full story on 3.6)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import standin
from conftest import ARCH, HERE, run_prewarm, write_manifest

from prewarm.node import fingerprint

KERNELS = """
    [[kernels]]
    function = "ascend_toy_kernels:add_kernel"
    args = { x = {tensor = "float32"}, y = {tensor = "float32"}, o = {tensor = "float32"}, T = 100, n = 4096, BS = 64 }
"""
APP = """
import sys, torch
from prewarm.building.backends.npu import activate_offline
import ascend_toy_kernels as k
activate_offline({arch!r})
k.add_kernel.warmup(torch.float32, torch.float32, torch.float32, 7, 4096, BS=64, grid=(1,))
print("planned call: no compile", flush=True)
k.add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 7, 4096, BS=64, grid=(1,))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(manifest, cache, env): a build host with stand-in CANN (toolkit, bishengir-compile), no NPU."""
    tmp = tmp_path_factory.mktemp("guard-ascend")
    bindir = tmp / "cann-bin"
    standin.make_bishengir(bindir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "TRITON_"))
           and k not in fingerprint.ASCEND_CODEGEN_ENV}
    env.update(ASCEND_HOME_PATH=str(standin.make_toolkit(tmp / "ascend-toolkit")),
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp / "home"))
    manifest = write_manifest(tmp / "m.toml", KERNELS)
    p = run_prewarm("build", manifest, "--cache-dir", tmp / "cache", "--mode", "offline", "--workers", "1", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return manifest, tmp / "cache", env


def test_guard_refuses_an_unplanned_compile_on_triton_32(built, tmp_path):
    manifest, cache, env = built
    env = dict(env)
    app = tmp_path / "app.py"
    app.write_text(APP.format(arch=ARCH))
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=str(HERE))
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--mode", "error", "--plan", manifest, "--",
                        sys.executable, str(app)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "planned call: no compile" in p.stdout, p.stderr[-3000:]
    assert ("UncoveredCompile: prewarm guard: ascend_toy_kernels:add_kernel is not in the cache and would compile "
            "here: nearest add_kernel: argument y: planned *fp32, runtime *bf16") in p.stderr, p.stderr[-3000:]
    assert len(list(Path(cache).glob("*/*.npubin"))) == 1  # refused before compiling
    # the cache's key dirs, read back as requests: the one kernel entry is the planned compile
    p = run_prewarm("explain", cache, "--plan", manifest, "--mode", "offline", env=env)
    assert p.returncode == 0 and "1 runtime requests: 1 planned, 0 not planned" in p.stdout, p.stdout + p.stderr


def test_guard_arming_refuses_an_ascend_codegen_env_the_installed_bundle_was_not_built_with(built, tmp_path):
    """TRITON_ALL_BLOCKS_PARALLEL is not in Triton's key: a rank exporting it would reuse the bundle's kernels built
    without it. The guard, arming at `import triton`, checks the serving env against the install receipts
    (npu.check_serving_env): error mode refuses to start, naming the variable; warn mode says it and serves."""
    _, cache, env = built
    assert run_prewarm("pack", cache, "-o", tmp_path / "bundle", env=env).returncode == 0
    node = tmp_path / "node"
    env = {**env, "TRITON_ASCEND_ARCH": ARCH}  # the node states its SoC (no torch_npu here)
    p = run_prewarm("install", tmp_path / "bundle", "--cache-dir", node, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    serve = {**env, "TRITON_CACHE_DIR": str(node), "TRITON_ALL_BLOCKS_PARALLEL": "1"}
    code = "import triton; print('serving')"
    for mode in ("error", "warn"):
        p = subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--mode", mode, "--", sys.executable, "-c",
                            code], env=serve, capture_output=True, text=True, timeout=300)
        assert "ascend.env.TRITON_ALL_BLOCKS_PARALLEL: bundle has 'unset', this node has '1'" in p.stderr, p.stderr
        assert ("serving" in p.stdout) == (mode == "warn") and (p.returncode == 0) == (mode == "warn"), p.stderr
