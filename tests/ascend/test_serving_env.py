"""The serving process's Ascend codegen env, checked by the guard when it arms (PREWARM_GUARD, `prewarm guard`): a
rank whose env differs from the installed bundle's build in a variable the cache key misses is refused (error) or
warned about, the variable named. Real processes, real install; the bundle holds one stand-in entry."""
from __future__ import annotations

import os
import sys

import pytest
from conftest import ARCH, run_prewarm, stand_in_bundle

from prewarm.node import fingerprint

from prewarm.shipping import install

SERVER = "import triton; print('serving')"  # the guard arms when the server imports triton


@pytest.fixture
def node_cache(tmp_path, monkeypatch):
    for name in fingerprint.ASCEND_CODEGEN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_ASCEND_ARCH", ARCH)  # the node states its SoC (no torch_npu here)
    install.install(str(stand_in_bundle(tmp_path)), tmp_path / "node", durable=False)
    return tmp_path / "node"


@pytest.mark.parametrize("mode", ["error", "warn"])
def test_a_rank_with_another_all_blocks_parallel_is_refused_or_warned_by_the_guard(node_cache, tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in fingerprint.ASCEND_CODEGEN_ENV}
    env.update(TRITON_CACHE_DIR=str(node_cache), HOME=str(tmp_path / "home"))
    guarded = ("guard", "--mode", mode, "--", sys.executable, "-c", SERVER)
    clean = run_prewarm(*guarded, env=env)
    assert clean.returncode == 0 and clean.stdout.strip() == "serving" and "ascend.env" not in clean.stderr, clean.stderr
    p = run_prewarm(*guarded, env={**env, "TRITON_ALL_BLOCKS_PARALLEL": "1"})
    assert "ascend.env.TRITON_ALL_BLOCKS_PARALLEL: bundle has 'unset', this node has '1'" in p.stderr, p.stderr
    if mode == "error":
        assert p.returncode != 0 and "FingerprintMismatch" in p.stderr and "serving" not in p.stdout
    else:
        assert p.returncode == 0 and p.stdout.strip() == "serving"
