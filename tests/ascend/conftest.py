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


@pytest.fixture(scope="session")
def _sglang_k3_plan():
    """The shipped sglang K3 manifest (manifests/kimi-k3-ascend-a3-sglang.toml) planned and expanded once per session
    under its A3 target (the whole model step: tens of seconds); the A3 profile taken away again after planning, so
    modules that do not ask for it see no torch.npu."""
    from prewarm import devices
    from prewarm.building.backends import get_target
    from prewarm.planning.manifest import load
    from prewarm.planning.plan import plan_for

    m = load(REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml")
    try:
        return m, plan_for(m, get_target("npu", m.arch, "offline", "A3"))
    finally:
        devices.deactivate()


@pytest.fixture(scope="module")
def sglang_k3(_sglang_k3_plan):
    """(manifest, Planned) of the sglang K3 manifest, with its A3 target active for the module (torch.npu answers as
    the A3, as when it was planned) and taken away after it."""
    from prewarm import devices

    m, p = _sglang_k3_plan
    p.target.activate()
    try:
        yield m, p
    finally:
        devices.deactivate()


@pytest.fixture(scope="module")
def sglang_k3_verdict(sglang_k3) -> dict[str, dict[str, str]]:
    """kernel -> the specializations of the sglang K3 plan's will-fail requests (on-disk form) -> label, expanded as
    Triton's JIT binds them (binding needs no key)."""
    from sglang_closure import by_kernel

    from prewarm.planning.plan import expand_all

    _, p = sglang_k3
    return by_kernel(expand_all([r for w in p.will_fail for r in w.requests]))
