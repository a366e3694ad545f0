"""Tests that run in the Ascend env (.ci/ascend-env: Python 3.11, triton-ascend 3.2.0, CPU torch, no torch_npu):
`.venv-ascend/bin/python -m pytest tests/ascend`. Kernels under test live in ascend_toy_kernels (imported by
name, as a manifest refers to it); the CANN stand-ins in tests/fixtures/cann."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "tests" / "fixtures" / "cann")]

ARCH = "Ascend910_9391"


def write_manifest(path: Path, kernels: str, arch: str | list[str] = ARCH) -> Path:
    """An npu manifest whose [[kernels]] are ``kernels`` (TOML text), for ``arch`` (one SoC or a list)."""
    path.write_text(textwrap.dedent(f"""
        name = "ascend-toy"
        [target]
        backend = "npu"
        arch = {json.dumps(arch)}
    """) + textwrap.dedent(kernels))
    return path


TOY_KERNELS = """
    [[kernels]]
    function = "ascend_toy_kernels:add_kernel"
    args = { x = {tensor = "float32"}, y = {tensor = "float32"}, o = {tensor = "float32"}, T = 100, n = [4096, 4095, 1], BS = 64 }
    options = { num_warps = 4, num_stages = 3 }

    [[kernels]]
    function = "ascend_toy_kernels:cumsum_kernel"
    args = { g = {tensor = "bfloat16"}, G = {tensor = "float32"}, T = 100, H = 6, K = 128, BT = 64 }
"""
TOY_COMPILES = 4  # add_kernel x 3 values of n (divisible by 16, neither, == 1) + cumsum


@pytest.fixture
def toy_manifest(tmp_path) -> Path:
    return write_manifest(tmp_path / "toy.toml", TOY_KERNELS)


def stand_in_bundle(tmp_path: Path) -> Path:
    """A bundle of one stand-in Ascend entry, built for ARCH under this process's toolchain (its fingerprint as
    `prewarm build` records it): for what install and the guard check against a node, not for its kernels."""
    from prewarm.node import fingerprint
    from prewarm.shipping.cachedir import CacheDir
    from prewarm.shipping.pack import pack

    build = tmp_path / "build"
    entry = build / "eTKeJ1R_GQfUT3rhySIydw3fON5j3RMY1z1xIQKapUk"
    entry.mkdir(parents=True)
    (entry / "add_kernel.npubin").write_bytes(b"NPUBIN stand-in")
    CacheDir(build).write_build_info({"fingerprint": fingerprint.current("npu", ARCH)})
    pack(build, tmp_path / "bundle")
    return tmp_path / "bundle"


def run_prewarm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real `prewarm` command line in a fresh process of this env (toy kernels importable)."""
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO)
