"""`prewarm build --mode device` on an Ascend node, with triton-ascend's device boundary replaced (no NPU, CANN or
torch_npu here: tests/fixtures/cann/npu_boundary.py). Everything above that boundary is real: the CLI, the build's
spawned workers, triton-ascend's NPUDriver / NPULauncher, every compile stage (npubin via a stand-in
bishengir-compile) and the cache dir."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import standin
from conftest import ARCH, REPO, TOY_COMPILES, TOY_KERNELS, run_prewarm, write_manifest

from prewarm.node import fingerprint
from prewarm.shipping.cachedir import CacheDir
from prewarm.errors import EnvironmentProblem, FingerprintMismatch, WillMissError

BOUNDARY = REPO / "tests" / "fixtures" / "cann"


@pytest.fixture
def node(tmp_path) -> dict:
    """Environment of an Ascend node: stand-in CANN 8.3.RC1 (toolkit, bishengir-compile, bisheng), NPU boundary."""
    bindir = tmp_path / "cann-bin"
    standin.make_bishengir(bindir)
    standin.make_bisheng(bindir)
    env = {k: v for k, v in os.environ.items() if k not in (*fingerprint.ASCEND_CODEGEN_ENV, "TRITON_ASCEND_ARCH",
                                                             "TRITON_NPU_COMPILER_PATH", "TRITON_COMPILE_ONLY")}
    env.update(
        ASCEND_HOME_PATH=str(standin.make_toolkit(tmp_path / "ascend-toolkit")),
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join([str(BOUNDARY / "boundary_site"), str(BOUNDARY)]),
        PREWARM_TEST_NPU_SOC=ARCH,
        HOME=str(tmp_path / "home"),  # the parent's driver start writes npu_utils.so to Triton's default cache
    )
    return env


def build(manifest: Path, cache: Path, env: dict):
    return run_prewarm("build", "--json", manifest, "--cache-dir", cache, "--mode", "device", "--workers", "1", env=env)


def assert_compiled_as_lowered(manifest: Path, cache: Path, soc: str = ARCH) -> dict:
    """Every planned compile was compiled into ``cache``, under the key dir `prewarm lower` predicts for the target,
    its .npubin made by the stand-in bishengir-compile for ``soc``; returns the build info."""
    record = CacheDir(cache).read_build_info()
    assert [r["status"] for r in record["requests"]] == ["compiled"] * TOY_COMPILES
    lowered = json.loads(run_prewarm("lower", "--json", manifest).stdout)
    assert sorted(r["key"] for r in record["requests"]) == sorted(c["cache_key"] for c in lowered["compiles"])
    for r in record["requests"]:
        (npubin,) = (cache / r["key"]).glob("*.npubin")
        assert npubin.read_bytes().startswith(f"NPUBIN 8.3.RC1 --target={soc} ".encode())
    return record


def test_device_build_makes_the_planned_compiles_with_compile_only_launches(toy_manifest, tmp_path, node):
    cache = tmp_path / "cache"
    p = build(toy_manifest, cache, node)
    assert p.returncode == 0, p.stderr[-3000:]
    record = assert_compiled_as_lowered(toy_manifest, cache)
    # every launch was compile-only: the stand-in launcher refuses to run, and triton-ascend says it skipped
    assert p.stdout.count("[INFO]: skip running kernel") == TOY_COMPILES
    # what the first real launch would otherwise build on the node is in the cache dir too
    assert list(cache.glob("*/npu_utils.so")) and list(cache.glob("*/precompiled.h"))
    assert list(cache.glob("*/launcher_cxx11abi*.so"))
    # the toolchain the dir now belongs to, and the one the bundle will carry
    assert CacheDir(cache).read_toolchain()["ascend.cann.version"].startswith("8.3.RC1")
    assert "8.3.RC1" in record["fingerprint"]["ascend.bishengir.version"]
    # the precompiled header's key, as the node computes it, names the dir the build put it in
    assert (cache / record["fingerprint"]["npu.precompiled_header"] / "precompiled.h").is_file()

    again = build(toy_manifest, cache, node)
    assert again.returncode == 0, again.stderr[-3000:]
    record = CacheDir(cache).read_build_info()
    assert [r["status"] for r in record["requests"]] == ["present"] * TOY_COMPILES

    # CANN upgraded on the node: Triton's key would hit every old binary; the build refuses the dir instead
    standin.make_bishengir(Path(node["PATH"].split(os.pathsep)[0]), version="8.5.0")
    upgraded = build(toy_manifest, cache, node)
    assert upgraded.returncode == FingerprintMismatch.exit_code, upgraded.stderr[-3000:]
    assert "ascend.bishengir.version" in upgraded.stderr


@pytest.mark.parametrize("change, message", [
    ({"TRITON_ASCEND_ARCH": "Ascend910B3"}, "the manifest targets Ascend910_9391 but this node's NPU compiles for "
                                            "Ascend910B3"),
    ({"TRITON_STORE_BINARY_ONLY": "1"}, "TRITON_STORE_BINARY_ONLY is set"),
    ({"PATH": "/usr/bin:/bin"}, "bishengir-compile not found"),
])  # fmt: skip
def test_device_build_refuses_a_node_that_cannot_build_it(toy_manifest, tmp_path, node, change, message):
    p = build(toy_manifest, tmp_path / "cache", {**node, **change})
    assert p.returncode == EnvironmentProblem.exit_code, p.stderr[-3000:]
    assert message in " ".join(p.stderr.split())


def verify(manifest: Path, cache: Path, env: dict, *flags: str):
    return run_prewarm("verify", "--json", "--cache-dir", cache, "--plan", manifest, *flags, env=env)


def test_verify_finds_launchers_header_and_npu_utils_under_triton_ascends_own_keys(toy_manifest, tmp_path, node):
    """A node's first launch builds, with g++, what it does not find under the keys triton-ascend computes: verify
    computes them through triton-ascend's own constructors and looks each up in the cache."""
    cache = tmp_path / "cache"
    assert build(toy_manifest, cache, node).returncode == 0
    p = verify(toy_manifest, cache, node, "--require-launchers")
    assert p.returncode == 0, p.stderr[-3000:]
    modules = json.loads(p.stdout)["will_hit"]["modules"]
    by_name = {name: [m for m in modules if m["name"] == name] for name in ("launcher", "precompiled.h", "npu_utils")}
    assert all(m["present"] for m in modules) and len(modules) == sum(map(len, by_name.values()))
    # the keys are the dirs the build's real launches wrote into
    assert {m["key"] for m in by_name["launcher"]} == {d.parent.name for d in cache.glob("*/launcher_cxx11abi*.so")}
    assert sum(m["kernels"] for m in by_name["launcher"]) == TOY_COMPILES
    (header,) = by_name["precompiled.h"]
    assert (cache / header["key"] / "precompiled.h").is_file() and header["kernels"] == TOY_COMPILES
    (utils,) = by_name["npu_utils"]
    import triton.backends.ascend as backend
    from triton.runtime.cache import _base64  # get_cache_manager's key dir

    src = (Path(backend.__file__).parent / "npu_utils.cpp").read_text()
    assert utils["key"] == _base64(hashlib.md5(src.encode()).hexdigest())
    assert (cache / utils["key"] / "npu_utils.so").is_file()

    # a launcher gone, then the node's env differs in a variable only the launcher source embeds (not a toolchain
    # factor: a first-launch g++ build, not wrong code): reported absent, blocking only with --require-launchers
    shutil.rmtree(next(cache.glob("*/launcher_cxx11abi*.so")).parent)
    p = verify(toy_manifest, cache, node)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sum(not m["present"] for m in json.loads(p.stdout)["will_hit"]["modules"]) == 1
    p = verify(toy_manifest, cache, {**node, "TRITON_GRID_WARN_PRINT": "1"}, "--require-launchers")
    assert p.returncode == WillMissError.exit_code, p.stderr[-3000:]
    doc = json.loads(p.stdout)["will_hit"]
    assert doc["hits"] == TOY_COMPILES  # the kernels themselves still hit: the key does not see the variable
    assert {m["name"] for m in doc["modules"] if not m["present"]} == {"launcher"}
    assert not {m["key"] for m in doc["modules"] if m["name"] == "launcher"} & {m["key"] for m in by_name["launcher"]}


def test_offline_build_on_a_cann_host_without_an_npu_gives_bishengir_the_manifests_soc(toy_manifest, tmp_path, node):
    """The container build step: CANN toolkit and bishengir-compile (stand-ins), no NPU, no torch_npu, no device
    boundary: the kernel binaries are compiled for the manifest's SoC under the keys a node looks up."""
    host = {k: v for k, v in node.items() if k not in ("PREWARM_TEST_NPU_SOC", "PYTHONPATH")}
    cache = tmp_path / "cache"
    p = run_prewarm("build", "--json", toy_manifest, "--cache-dir", cache, "--mode", "offline", "--workers", "2",
                    env=host)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_compiled_as_lowered(toy_manifest, cache)
    assert not list(cache.glob("*/launcher_cxx11abi*")) and not list(cache.glob("*/npu_utils.so"))
    assert CacheDir(cache).read_toolchain() is not None
    # a node of that SoC (device boundary only) finds every kernel; its launchers are what it still builds
    p = verify(toy_manifest, cache, node, "--require-launchers")
    doc = json.loads(p.stdout)["will_hit"]
    assert doc["hits"] == TOY_COMPILES and p.returncode == WillMissError.exit_code, p.stderr[-3000:]
    assert {m["name"] for m in doc["modules"] if not m["present"]} == {"launcher", "precompiled.h", "npu_utils"}
    assert sum(m["kernels"] for m in doc["modules"] if m["name"] == "launcher") == TOY_COMPILES


def test_offline_build_needs_the_cann_compiler(toy_manifest, tmp_path, node):
    host = {k: v for k, v in node.items() if k not in ("PREWARM_TEST_NPU_SOC", "PYTHONPATH")}
    p = run_prewarm("build", toy_manifest, "--cache-dir", tmp_path / "c", "--mode", "offline",
                    env={**host, "PATH": "/usr/bin:/bin"})
    assert p.returncode == EnvironmentProblem.exit_code and "an offline NPU build needs the CANN toolkit" in " ".join(
        p.stderr.split())


A3_PAIR = ["Ascend910_9391", "Ascend910_9392"]


def test_a_manifest_listing_two_a3_socs_builds_two_sets_and_each_node_verifies_its_own(tmp_path, node):
    """Every key contains the SoC: an offline build makes one complete cache dir (one bundle) per SoC; a node picks
    the set of its own SoC, and refuses (exit 8) where it cannot tell its SoC or the manifest does not list it."""
    manifest = write_manifest(tmp_path / "fleet.toml", TOY_KERNELS, arch=A3_PAIR)
    host = {k: v for k, v in node.items() if k not in ("PREWARM_TEST_NPU_SOC", "PYTHONPATH")}
    out = tmp_path / "out"
    p = run_prewarm("build", "--json", manifest, "--cache-dir", out, "--mode", "offline", "--workers", "2", env=host)
    assert p.returncode == 0, p.stderr[-3000:]
    keys = {}
    for soc in A3_PAIR:
        record = CacheDir(out / soc).read_build_info()
        assert record["manifest"]["name"] == f"ascend-toy-{soc}" and record["fingerprint"]["target.arch"] == soc
        keys[soc] = {r["key"] for r in record["requests"] if r["status"] == "compiled"}
        assert len(keys[soc]) == TOY_COMPILES
        for key in keys[soc]:
            (npubin,) = (out / soc / key).glob("*.npubin")
            assert npubin.read_bytes().startswith(f"NPUBIN 8.3.RC1 --target={soc} ".encode())
    assert not keys[A3_PAIR[0]] & keys[A3_PAIR[1]]  # two sets that share nothing

    def on(soc: str) -> dict:  # (a home of its own: the stand-in npu_utils.so that answers the SoC is cached there)
        return {**node, "PREWARM_TEST_NPU_SOC": soc, "HOME": str(tmp_path / f"home-{soc}")}

    p = verify(manifest, out / "Ascend910_9392", on("Ascend910_9392"))
    assert p.returncode == 0 and json.loads(p.stdout)["will_hit"]["hits"] == TOY_COMPILES, p.stderr[-3000:]
    p = verify(manifest, out / "Ascend910_9391", on("Ascend910_9392"))  # the other SKU's set: every kernel a miss
    assert p.returncode == WillMissError.exit_code and json.loads(p.stdout)["will_hit"]["hits"] == 0
    for soc, said in (("Ascend910B3", "this node's SoC is Ascend910B3, which"),
                      ("", "this node's Ascend SoC is unknown")):  # no boundary: the driver cannot start
        p = verify(manifest, out / "Ascend910_9392", on(soc))
        assert p.returncode == FingerprintMismatch.exit_code and said in " ".join(p.stderr.split()), p.stderr[-3000:]


def test_verify_on_a_node_without_the_cann_compiler_finds_the_device_build(toy_manifest, tmp_path, node):
    """verify only computes keys and looks them up: under the node's own driver it needs no bishengir-compile (the
    device target's compiler check is the build's alone: Target.prepare_build)."""
    cache = tmp_path / "cache"
    assert build(toy_manifest, cache, node).returncode == 0
    bindir = tmp_path / "no-bishengir"  # the driver's bisheng only (its is_active asks it)
    standin.make_bisheng(bindir)
    p = verify(toy_manifest, cache, {**node, "PATH": f"{bindir}{os.pathsep}/usr/bin:/bin"}, "--require-launchers")
    doc = json.loads(p.stdout)
    assert doc["will_hit"]["hits"] == TOY_COMPILES and all(m["present"] for m in doc["will_hit"]["modules"]), \
        p.stderr[-3000:]


def test_an_offline_build_asks_the_cann_compiler_for_its_identity_once(toy_manifest, tmp_path, node):
    """The toolchain fingerprint (a bishengir-compile run, a hash of its binary) is computed by the build's parent and
    handed to its workers with the target: not once per worker, after the build and for the record again."""
    host = {k: v for k, v in node.items() if k not in ("PREWARM_TEST_NPU_SOC", "PYTHONPATH")}
    real = Path(host["PATH"].split(os.pathsep)[0]) / "bishengir-compile"
    logged = tmp_path / "logged"
    logged.mkdir()
    calls = tmp_path / "calls.log"
    (logged / "bishengir-compile").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    (logged / "bishengir-compile").chmod(0o755)
    p = run_prewarm("build", "--json", toy_manifest, "--cache-dir", tmp_path / "cache", "--mode", "offline",
                    "--workers", "2", env={**host, "PATH": f"{logged}{os.pathsep}{host['PATH']}"})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = calls.read_text().splitlines()
    assert len(lines) > TOY_COMPILES - 1  # every compile ran the compiler through the logging wrapper
    assert [line for line in lines if "--version" in line.split()] == ["--version"]
