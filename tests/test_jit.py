"""prewarm.jit: sglang's ``load_jit`` modules and FlashInfer's modules built for sm_90a without a GPU through each
library's own build code (nvcc of the toolkit .ci/setup assembles in build/cuda), then looked up by each library's
own lookup. Each module is built once per test module (measured on a 2-core box: sglang's packed decode ~12 s,
FlashInfer's sampling module ~105 s)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from prewarm.errors import BuildError
from prewarm.jit import Lookup, library
from prewarm.providers.flashinfer.jit import FlashInferJit, module_request
from prewarm.providers.sglang.jit import SglangJit, _forget_memos, capture_requests

TOOLKIT = Path(__file__).resolve().parent.parent / "build" / "cuda"
PACKED_DECODE = "sgl_kernel_jit_kda_packed_decode_8_8_true"  # 8 warps, PDL (Hopper)


class Refused(Exception):
    pass


@pytest.fixture(scope="module", autouse=True)
def cuda_home():
    assert (TOOLKIT / "bin" / "nvcc").is_file(), f"{TOOLKIT}: run .ci/setup (it assembles this CUDA toolkit)"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_HOME", str(TOOLKIT))
        mp.delenv("CXX", raising=False)
        yield


def packed_decode_call(batch: int = 8) -> None:
    """sglang's CUDA KDA packed decode as ``fused_recurrent_kda_packed_decode`` calls it for a covered batch."""
    from sglang.kernels.ops.attention import kda_packed_decode as kpd

    hv, k = 2, 128
    kpd.kda_packed_decode(torch.zeros(batch, 3 * hv * k, dtype=torch.bfloat16),
                          torch.zeros(batch, hv * k, dtype=torch.bfloat16), torch.zeros(batch, hv, dtype=torch.bfloat16),
                          torch.zeros(hv), torch.zeros(hv * k), 0.1, torch.zeros(batch, hv, k, k),
                          torch.zeros(batch, 1, hv, k, dtype=torch.bfloat16), torch.arange(batch, dtype=torch.int32), hv)


@pytest.fixture(scope="module")
def sglang_built(tmp_path_factory):
    """(request, root, what watch_builds reported): the packed-decode module captured from the real call and built
    for 9.0a by SglangJit.build, watched by a recorder."""
    from sglang.kernels.jit.utils.compile import ninja

    with capture_requests("9.0a") as requests:
        packed_decode_call()
    assert [r.name for r in requests] == [PACKED_DECODE]
    root = tmp_path_factory.mktemp("sglang-jit")
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ninja, "build", ninja.build)  # restored after
        SglangJit().watch_builds(lambda module, detail: seen.append(module))
        lookups = SglangJit().build(requests, root, "9.0a")
    assert [(x.hit, x.reason) for x in lookups] == [(True, "")]
    return requests[0], root, seen


def test_sglang_build_is_found_by_sglangs_lookup(sglang_built):
    request, root, seen = sglang_built
    assert seen == [PACKED_DECODE]  # the build went through sglang's ninja step, reported before it ran
    [hit] = SglangJit().lookup([request], root, "9.0a")
    leaf = Path(hit.path).parent
    assert hit.hit and hit.path == str(leaf / f"{PACKED_DECODE}.so")
    assert leaf.parent.parent == root / "sm90a" / PACKED_DECODE and (leaf / "sgl_deps.json").is_file()
    [other] = SglangJit().lookup([request], root, "10.0a")
    assert not other.hit and other.reason == f"no build of {PACKED_DECODE} for target sm100a (built for sm90a)"


def test_sglang_changed_header_misses_naming_it(sglang_built, monkeypatch):
    """A node whose copy of a header the module includes differs: sglang's leaf no longer reproduces its name."""
    from sglang.kernels.jit.utils.compile import cache

    request, root, _ = sglang_built
    digest = cache._file_digest
    monkeypatch.setattr(cache, "_file_digest",
                        lambda p: "0" * 64 if str(p).endswith("sgl_kernel/warp.cuh") else digest(p))
    [miss] = SglangJit().lookup([request], root, "9.0a")
    assert not miss.hit and miss.reason.startswith("dependency kernels:include/sgl_kernel/warp.cuh differs")


def test_sglang_other_host_compiler_misses_naming_it(sglang_built, monkeypatch):
    request, root, _ = sglang_built
    monkeypatch.setenv("CXX", "g++")
    [miss] = SglangJit().lookup([request], root, "9.0a")
    assert not miss.hit and miss.reason.startswith("no build for this build key")
    assert "sglang.jit.cxx differs: 'g++ " in miss.reason and "'c++ " in miss.reason
    assert SglangJit().toolchain("9.0a")["sglang.jit.cxx"].startswith("g++ ")


def test_capture_sees_every_call_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """The module getter is memoized by sglang: each capture still sees its load_jit call, and after the block the
    real load_jit runs again (here refusing to compile: nothing is cached)."""
    from sglang.kernels.ops.attention import kda_packed_decode as kpd

    for _ in range(2):
        with capture_requests("9.0a") as requests:
            packed_decode_call(batch=9)
        assert [(r.name, r.origin) for r in requests] == [(PACKED_DECODE, f"{kpd.__name__}._jit_kda_packed_decode_module")]
    monkeypatch.setenv("SGLANG_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_CRASH_ON_JIT_COMPILE", "1")
    try:
        with pytest.raises(RuntimeError, match="SGLANG_CRASH_ON_JIT_COMPILE forbids compiling"):
            kpd._jit_kda_packed_decode_module()
    finally:
        _forget_memos()  # what that call memoized here (this box's arch: none) stays out of later tests


def test_sglang_watch_builds_refuses_a_build(sglang_built, tmp_path, monkeypatch):
    from sglang.kernels.jit.utils.compile import ninja

    request, _, _ = sglang_built
    monkeypatch.setattr(ninja, "build", ninja.build)
    told = []

    def refuse(module, detail):
        told.append((module, detail))
        raise Refused(module)

    SglangJit().watch_builds(refuse)
    with pytest.raises(BuildError, match=PACKED_DECODE):
        SglangJit().build([request], tmp_path, "9.0a")
    assert [m for m, _ in told] == [PACKED_DECODE] and str(tmp_path / "sm90a" / PACKED_DECODE) in told[0][1]
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("deps-*"))


def test_sglang_node_dir():
    lib = library("sglang")
    assert lib.node_dir({"SGLANG_JIT_CACHE_DIR": "/srv/jit"}) == Path("/srv/jit")
    assert lib.node_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/sglang/jit")


@pytest.fixture(scope="module")
def flashinfer_built(tmp_path_factory):
    """FlashInfer's sampling module (sglang's default sampling backend) built for 9.0a into an AOT dir."""
    request = module_request("flashinfer.jit.sampling:gen_sampling_module", origin="sglang's sampler", arch="9.0a")
    assert request.name == "sampling"
    root = tmp_path_factory.mktemp("flashinfer-aot")
    return request, root, FlashInferJit().build([request], root, "9.0a")


def test_flashinfer_module_is_found_as_aot_artifact(flashinfer_built, tmp_path):
    request, root, lookups = flashinfer_built
    assert lookups == [Lookup(request, True, str(root / "sampling" / "sampling.so"))]
    assert sorted(p.name for p in root.rglob("*")) == ["sampling", "sampling.so"]  # nothing else in the AOT dir
    [miss] = FlashInferJit().lookup([request], tmp_path, "9.0a")
    assert not miss.hit and miss.reason.startswith(f"no AOT module {tmp_path}/sampling/sampling.so")
    assert FlashInferJit().toolchain("9.0a") | {"flashinfer.nvcc": ""} == {
        "flashinfer.version": "0.7.2", "flashinfer.apache-tvm-ffi": "0.1.11", "flashinfer.nvcc": "",
        "flashinfer.archs": "9.0a"}


def test_flashinfer_node_dir_is_its_packages_aot_dir():
    package = Path(importlib.util.find_spec("flashinfer").origin).parent
    assert FlashInferJit().node_dir() == package / "data" / "aot"


def test_flashinfer_watch_builds_refuses_a_build(tmp_path, monkeypatch):
    """In a serving process (FlashInfer imported with its environment): no AOT module, so build_and_load builds;
    the watcher is told first and its exception leaves nothing built."""
    import subprocess
    import sys

    script = """
import pytest
from prewarm.jit import library
class Refused(Exception): pass
told = []
def refuse(module, detail):
    told.append(module)
    raise Refused(detail)
library("flashinfer").watch_builds(refuse)
from flashinfer.jit.sampling import gen_sampling_module
with pytest.raises(Refused, match="no AOT module"):
    gen_sampling_module().build_and_load()
assert told == ["sampling"], told
"""
    env = {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.o"))
