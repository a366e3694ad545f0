"""The Triton cache dir a server process really reads: sglang's own import (the wheel's ``sglang/__init__.py`` and
``sglang/srt/environ.py``, copied verbatim into build/sglang by tests/fixtures/sglang_standin/assemble.py) sets
TRITON_CACHE_DIR to ~/.cache/sglang/triton where it is unset. A server process started so reads none of the
installed cache: the pre-launch check (`verify --server sglang`) and the guard name the variable to set. Real
processes, a bundle of real compiled kernels."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))  # the toy kernel the manifest plans

from prewarm.shipping.install import install  # noqa: E402
from prewarm.shipping.pack import pack  # noqa: E402

MANIFEST = FIXTURES / "toy-guard.toml"
SERVER = [sys.executable, "-c", "import sglang, triton; print('serving')"]  # the guard arms at `import triton`


@pytest.fixture(scope="module")
def bundle(toy_cache_master, tmp_path_factory) -> Path:
    """A bundle of the session's real toy cache: it holds the manifest's planned call."""
    out = tmp_path_factory.mktemp("server-env") / "bundle"
    pack(toy_cache_master, out)
    return out


def server_env(tmp_path: Path, **values: str) -> dict[str, str]:
    """A server's environment without any Triton / prewarm setting of the test run; HOME (where sglang's defaults
    point) in the test's dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_", "SGLANG_"))}
    return {**env, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(FIXTURES), **values}


def prewarm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_verify_catches_a_sglang_server_started_without_triton_cache_dir(bundle, tmp_path):
    node = tmp_path / "node"
    install(str(bundle), node)
    p = prewarm("verify", "--cache-dir", str(node), "--server", "sglang", env=server_env(tmp_path))
    assert p.returncode == 14, p.stdout + p.stderr
    out = " ".join(p.stdout.split())  # rich folds long lines
    moved = tmp_path / "home" / ".cache" / "sglang" / "triton"  # sglang's own default, not Triton's ~/.triton/cache
    assert f"reads Triton's cache at {moved} (TRITON_CACHE_DIR unset in this environment; `import sglang` sets it)" \
           in out, out
    assert f"set TRITON_CACHE_DIR={node} in the server's environment" in out, out
    p = prewarm("verify", "--cache-dir", str(node), "--server", "sglang",
                env=server_env(tmp_path, TRITON_CACHE_DIR=str(node)))
    assert p.returncode == 0 and p.stdout.rstrip().endswith("clean"), p.stdout + p.stderr


def test_the_prelaunch_job_checks_the_server_it_starts_and_its_guard_refuses_another_dir(bundle, tmp_path):
    node = tmp_path / "node"
    env = server_env(tmp_path, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["/bin/sh", str(REPO / "deploy" / "prelaunch.sh"), *SERVER], capture_output=True, text=True,
                       env={**env, "TRITON_CACHE_DIR": str(node), "PREWARM_SOURCE": str(bundle),
                            "PREWARM_MANIFEST": str(MANIFEST), "PREWARM_SERVER": "sglang", "PREWARM_GUARD": "error"},
                       timeout=300)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("serving"), p.stdout + p.stderr
    assert "server dirs" in p.stdout and f"reads Triton's cache at {node} (TRITON_CACHE_DIR={node}" in \
           " ".join(p.stdout.split()), p.stdout  # verify ran the server's import; the guard let it serve

    # the same server under the guard, without TRITON_CACHE_DIR: refused at arming, the variable named
    guard = ["guard", "--mode", "error", "--plan", str(MANIFEST), "--", *SERVER]
    p = prewarm(*guard, env=env)
    assert p.returncode != 0 and "serving" not in p.stdout, p.stdout + p.stderr
    assert "CacheDirMismatch: this process reads Triton's cache at " \
           f"{tmp_path / 'home' / '.cache' / 'sglang' / 'triton'} (TRITON_CACHE_DIR=" in p.stderr, p.stderr
    assert "set TRITON_CACHE_DIR to the dir the pre-launch job installed into" in p.stderr
