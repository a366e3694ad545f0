"""prewarm's Triton-version seams (tritoncompat, fingerprint) on triton-ascend 3.2, checked against its own code."""
from __future__ import annotations

import hashlib
import os

import pytest
import standin

from prewarm import fingerprint, tritoncompat


def test_triton_key_is_triton_ascends_own():
    from triton.compiler.compiler import triton_key

    assert tritoncompat.triton_key() == hashlib.sha256(triton_key().encode()).hexdigest()
    assert tritoncompat.triton_distribution() == ("triton-ascend", "3.2.0")


def test_cache_invalidating_env_vars_are_read_as_triton_ascend_reads_them(monkeypatch):
    from triton._C.libtriton import get_cache_invalidating_env_vars

    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "0")
    assert tritoncompat.cache_invalidating_env_vars() == dict(get_cache_invalidating_env_vars())
    assert fingerprint.current("npu", "Ascend910_9391")["env.TRITON_DISABLE_LINE_INFO"] == "false"  # libtriton normalizes it


def test_this_env_fingerprints_as_an_ascend_one():
    fp = fingerprint.current()
    assert fp["target.backend"] == "npu" and fp["triton.distribution"] == "triton-ascend"
    assert fp["python.abi"].startswith("cpython-311")
    assert "ascend.cann.version" in fp


def test_mock_tensor_on_triton_32():
    import torch

    t = tritoncompat.mock_tensor(torch.bfloat16, [4, 8])
    assert t.dtype is torch.bfloat16 and t.data_ptr() % 16 == 0


@pytest.mark.parametrize("on_path, compiler_dir", [(True, False), (True, True), (False, True)])
def test_bishengir_is_resolved_exactly_as_triton_ascend_resolves_it(tmp_path, monkeypatch, on_path, compiler_dir):
    from triton.backends.ascend.utils import _get_npucompiler_path

    path = "/usr/bin:/bin"
    if on_path:
        standin.make_bishengir(tmp_path / "bin")
        path = f"{tmp_path / 'bin'}{os.pathsep}{path}"
    monkeypatch.setenv("PATH", path)
    monkeypatch.delenv("TRITON_NPU_COMPILER_PATH", raising=False)
    if compiler_dir:
        standin.make_bishengir(tmp_path / "npuc-dir", name="npuc", version="8.2.RC1")
        monkeypatch.setenv("TRITON_NPU_COMPILER_PATH", str(tmp_path / "npuc-dir"))
    assert fingerprint.bishengir_path() == _get_npucompiler_path()
