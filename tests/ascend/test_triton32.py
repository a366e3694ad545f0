"""prewarm's Triton-version seams (tritoncompat, fingerprint) on triton-ascend 3.2, checked against its own code."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import standin

from prewarm.node import fingerprint

from prewarm.building import tritoncompat
from prewarm.building.backends import npu


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


def test_key_dir_is_triton_ascends_own_encoding():
    from triton.runtime.cache import _base64

    digest = hashlib.sha256(b"kernel").hexdigest()
    assert tritoncompat.ascend_key_dir(digest) == tritoncompat.ascend_key_dir(digest, "3.2") == _base64(digest)


SPEC35 = Path(__file__).parents[1] / "fixtures" / "cann" / "spec35_add_kernel.jsonl"  # see capture_spec35.py


def test_compile_only_launch_arguments_read_the_32_and_35_layouts_alike():
    """The same three calls (n = 4096, 4095, 1) as triton-ascend 3.2 records them and in the 3.5+ layout of its main
    branch: the same minimal launch, and that launch makes exactly the 3.2 request again."""
    import torch

    import ascend_toy_kernels as k
    from conftest import ARCH

    npu.activate_offline(ARCH)
    f32 = torch.float32
    with tritoncompat.compile_requests(skip=True) as spec32:
        for n in (4096, 4095, 1):
            k.add_kernel.warmup(f32, f32, f32, 100, n, BS=64, grid=(1,))
    jit = tritoncompat.jit_function(k.add_kernel)

    def described(launch):
        args, kwargs = launch
        return [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args], kwargs

    launches = [npu.launch_arguments(jit, data, "cpu") for data in spec32]
    assert [described(x) for x in launches] == [
        described(npu.launch_arguments(jit, data, "cpu")) for data in SPEC35.read_text().splitlines()]
    assert [a[4] for a, _ in launches] == [16, 3, 1]  # n: divisible by 16, neither, compiled in as 1
    with tritoncompat.compile_requests(skip=True) as again:
        for args, kwargs in launches:
            k.add_kernel.warmup(*args, grid=(1,), **kwargs)
    fields = lambda data: {f: json.loads(data)[f] for f in npu.KEY_FIELDS}
    assert list(map(fields, again)) == list(map(fields, spec32))
