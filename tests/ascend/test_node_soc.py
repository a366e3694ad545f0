"""An Ascend node's SoC is in every cache key, and the node states it as triton-ascend's driver reads it
(TRITON_ASCEND_ARCH, else torch_npu's device). Plain `install` and `verify` (no --plan) fail closed on a node that
cannot tell it (exit 8: the factor and the fix named), pass where it is the bundle's, and refuse another SoC naming
both. Real processes of this env (triton-ascend 3.2.0, no torch_npu: no SoC unless stated)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ARCH, run_prewarm, stand_in_bundle

from prewarm.node import fingerprint
from prewarm.errors import FingerprintMismatch

OTHER = "Ascend910B3"
ENTRY = "eTKeJ1R_GQfUT3rhySIydw3fON5j3RMY1z1xIQKapUk"
UNSTATED = "this node has 'unknown' (this node cannot determine it"


@pytest.fixture
def bundle(tmp_path, monkeypatch) -> Path:
    for name in (*fingerprint.ASCEND_CODEGEN_ENV, "TRITON_ASCEND_ARCH"):
        monkeypatch.delenv(name, raising=False)
    return stand_in_bundle(tmp_path)


def node_env(tmp_path: Path, soc: str | None) -> dict:
    """This process's env as a node's: SoC ``soc`` stated through TRITON_ASCEND_ARCH, or none (no torch_npu here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ASCEND_ARCH"}
    env["HOME"] = str(tmp_path / "home")
    return {**env, "TRITON_ASCEND_ARCH": soc} if soc else env


@pytest.mark.parametrize("soc, code, says", [
    (None, FingerprintMismatch.exit_code,
     [f"target.arch: bundle has '{ARCH}', {UNSTATED}", "set TRITON_ASCEND_ARCH", "--allow-missing-factors overrides"]),
    (ARCH, 0, ["installed 1 entries"]),
    (OTHER, FingerprintMismatch.exit_code,
     [f"target.arch: bundle has '{ARCH}', this node has '{OTHER}'", "--allow-fingerprint-mismatch overrides"]),
])
def test_plain_install_needs_the_node_to_tell_its_soc(bundle, tmp_path, soc, code, says):
    node = tmp_path / "node"
    p = run_prewarm("install", bundle, "--cache-dir", node, env=node_env(tmp_path, soc))
    assert p.returncode == code, p.stdout + p.stderr
    for text in says:
        assert text in p.stdout + p.stderr, p.stdout + p.stderr
    assert (node / ENTRY).is_dir() == (code == 0)  # refused: nothing unpacked


def test_allow_missing_factors_installs_on_a_node_that_cannot_tell_its_soc(bundle, tmp_path):
    """The node's unknown SoC is a missing factor like any other: the documented escape covers it, and says so."""
    p = run_prewarm("install", bundle, "--cache-dir", tmp_path / "node", "--allow-missing-factors",
                    env=node_env(tmp_path, None))
    assert p.returncode == 0, p.stderr
    assert f"overridden: target.arch: bundle has '{ARCH}', {UNSTATED}" in p.stderr, p.stderr
    assert (tmp_path / "node" / ENTRY).is_dir()


@pytest.mark.parametrize("soc, code, says", [
    (None, FingerprintMismatch.exit_code,
     [f"mismatch target.arch: bundle {ARCH}, node unknown: this node cannot determine it", "set TRITON_ASCEND_ARCH"]),
    (ARCH, 0, ["clean"]),
    (OTHER, FingerprintMismatch.exit_code, [f"mismatch target.arch: bundle {ARCH}, node {OTHER}"]),
])
def test_plain_verify_needs_the_node_to_tell_its_soc(bundle, tmp_path, soc, code, says):
    node = tmp_path / "node"
    assert run_prewarm("install", bundle, "--cache-dir", node, env=node_env(tmp_path, ARCH)).returncode == 0
    p = run_prewarm("verify", "--cache-dir", node, env=node_env(tmp_path, soc))
    assert p.returncode == code, p.stdout + p.stderr
    for text in says:
        assert text in p.stdout, p.stdout + p.stderr
