"""The Ascend toolchain fingerprint, with a stand-in CANN toolkit and bishengir-compile (CANN cannot be installed
here). Triton's own key ignores the CANN / bishengir-compile version: these factors are what stops a cache from
another toolchain from being reused silently."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from prewarm.node import fingerprint

from prewarm.shipping import install

from prewarm.planning import manifest

from prewarm.building import tritoncompat
from prewarm.building.backends import npu
from prewarm.shipping.cachedir import CacheDir
from prewarm.errors import FingerprintMismatch, IntegrityError, ManifestError
from prewarm.shipping.pack import pack

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "cann"))
import standin  # noqa: E402

ARCH = "Ascend910_9391"


@pytest.fixture
def toolchain(tmp_path, monkeypatch):
    """A node with a stand-in CANN 8.3.RC1 toolkit and bishengir-compile on PATH, no Ascend codegen env vars set,
    its SoC ARCH stated as a node without torch_npu states it (TRITON_ASCEND_ARCH)."""
    for name in (*fingerprint.ASCEND_CODEGEN_ENV, "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME",
                 "TRITON_NPU_COMPILER_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_ASCEND_ARCH", ARCH)
    home = standin.make_toolkit(tmp_path / "Ascend" / "ascend-toolkit" / "8.3.RC1")
    bindir = tmp_path / "bin"
    standin.make_bishengir(bindir)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    # an Ascend node: install and verify take the backend from the node, never from the bundle (this env's
    # upstream Triton would say cuda)
    monkeypatch.setattr(fingerprint, "detect_backend", lambda: "npu")
    return tmp_path


def npu_fp() -> dict[str, str]:
    return fingerprint.current("npu", ARCH)


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_factors_read_the_toolkit_and_the_compiler(toolchain):
    fp = npu_fp()
    assert fp["ascend.cann.version"] == "8.3.RC1 (V100R001C23SPC001B230)"
    assert fp["ascend.bishengir.name"] == "bishengir-compile"
    assert "bishengir-compile version 8.3.RC1" in fp["ascend.bishengir.version"]
    assert len(fp["ascend.bishengir.sha256"]) == 64
    assert fp["ascend.torch_npu.version"] == "absent"  # never installed outside Ascend nodes
    assert all(fp[f"ascend.env.{n}"] == "unset" for n in fingerprint.ASCEND_CODEGEN_ENV)
    assert all(fingerprint.is_blocking(k) for k in fp if k.startswith("ascend."))


def test_cuda_fingerprint_has_no_ascend_factors(toolchain):
    assert not [k for k in fingerprint.current("cuda", "sm_90") if k.startswith("ascend.")]


def test_compiler_version_change_changes_the_fingerprint(toolchain):
    before = npu_fp()
    standin.make_bishengir(toolchain / "bin", version="8.5.0")
    assert changed(before, npu_fp()) == {"ascend.bishengir.version", "ascend.bishengir.sha256"}


def test_compiler_binary_change_with_the_same_version_changes_the_fingerprint(toolchain):
    before = npu_fp()
    standin.make_bishengir(toolchain / "bin", note="hotfix build")
    after = npu_fp()
    assert after["ascend.bishengir.version"] == before["ascend.bishengir.version"]
    assert changed(before, after) == {"ascend.bishengir.sha256"}


def test_toolkit_version_change_changes_the_fingerprint(toolchain):
    before = npu_fp()
    standin.make_toolkit(Path(os.environ["ASCEND_HOME_PATH"]), version="8.5.0", inner="V100R001C25B100")
    assert changed(before, npu_fp()) == {"ascend.cann.version"}


@pytest.mark.parametrize("name", fingerprint.ASCEND_CODEGEN_ENV)
def test_each_ascend_codegen_env_var_changes_the_fingerprint(toolchain, monkeypatch, name):
    before = npu_fp()
    monkeypatch.setenv(name, "1")
    in_key = name in tritoncompat.cache_invalidating_env_vars()  # TRITON_F32_DEFAULT on upstream 3.6, not 3.2.0
    assert changed(before, npu_fp()) == {f"ascend.env.{name}"} | ({f"env.{name}"} if in_key else set())


def test_compiler_is_resolved_as_triton_ascend_does(toolchain, monkeypatch, tmp_path):
    """PATH first; else $TRITON_NPU_COMPILER_PATH/npuc; the path itself is not a factor, the compiler is."""
    other = tmp_path / "opt" / "compiler"
    standin.make_bishengir(other, version="8.2.RC1", name="npuc")
    monkeypatch.setenv("TRITON_NPU_COMPILER_PATH", str(other))
    on_path = npu_fp()
    assert on_path["ascend.bishengir.name"] == "bishengir-compile"  # PATH wins
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if p != str(toolchain / "bin")))
    fp = npu_fp()
    assert fp["ascend.bishengir.name"] == "npuc"
    assert "8.2.RC1" in fp["ascend.bishengir.version"]
    monkeypatch.delenv("TRITON_NPU_COMPILER_PATH")
    assert npu_fp()["ascend.bishengir.version"] == "absent"


def test_absent_toolchain_differs_from_a_present_one(toolchain, monkeypatch):
    present = npu_fp()
    monkeypatch.setenv("ASCEND_HOME_PATH", str(toolchain / "nowhere"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    absent = npu_fp()
    assert absent["ascend.cann.version"] == absent["ascend.bishengir.sha256"] == "absent"
    factors = {m.factor for m in fingerprint.compare(present, absent) if m.blocking}
    assert {"ascend.cann.version", "ascend.bishengir.version", "ascend.bishengir.sha256"} <= factors


def test_compare_explains_each_ascend_factor(toolchain, monkeypatch):
    built = npu_fp()
    standin.make_bishengir(toolchain / "bin", version="8.5.0")
    monkeypatch.setenv("TRITON_DISABLE_FFTS", "1")
    mismatches = {m.factor: m for m in fingerprint.compare(built, npu_fp())}
    assert set(mismatches) == {"ascend.bishengir.version", "ascend.bishengir.sha256", "ascend.env.TRITON_DISABLE_FFTS"}
    assert all(m.blocking for m in mismatches.values())
    assert "Triton's key ignores it" in mismatches["ascend.bishengir.version"].why
    assert "Triton's key misses" in mismatches["ascend.env.TRITON_DISABLE_FFTS"].why


def test_an_ascend_node_that_cannot_tell_its_soc_is_a_blocking_gap_naming_the_fix(toolchain, monkeypatch):
    built = npu_fp()
    monkeypatch.delenv("TRITON_ASCEND_ARCH")  # and no torch_npu: the node cannot tell its SoC
    node = fingerprint.current()
    [m] = fingerprint.compare(built, node)
    assert (m.factor, m.built, m.node, m.blocking, m.gap) == ("target.arch", ARCH, fingerprint.UNKNOWN, True, True)
    assert "set TRITON_ASCEND_ARCH to this node's SoC" in m.why
    # a bundle that does not say its SoC either does not make the two agree
    assert [m.factor for m in fingerprint.compare({**built, "target.arch": fingerprint.UNKNOWN}, node)] == [
        "target.arch"]


def test_a_cuda_node_without_a_visible_gpu_leaves_its_arch_unchecked():
    """A CUDA node states its arch only through a visible GPU (a build box, CI): not knowable there, not compared."""
    built = {"target.backend": "cuda", "target.arch": "sm_90"}
    assert fingerprint.compare(built, {**built, "target.arch": fingerprint.UNKNOWN}) == []


# --- install refuses a bundle from another toolchain --------------------------------------------------------------


# a key dir of the Triton this fingerprint names (this env's upstream one: base32; triton-ascend 3.2 writes base64)
BUNDLED_KEY = "7EGGYS7CN6QQ3ZLIY2WLJMO5KAMZTYRHZNG3OU3A6LKZJUQELTGQ"


def make_bundle(tmp_path: Path, fp: dict[str, str]) -> Path:
    """A bundle of one (fake-content) cache entry, built under fingerprint ``fp`` (as `prewarm build` records it)."""
    cache = tmp_path / "build-cache"
    entry = cache / BUNDLED_KEY
    entry.mkdir(parents=True)
    (entry / "add_kernel.npubin").write_bytes(b"NPUBIN stand-in")
    (entry / "add_kernel.json").write_text("{}")
    CacheDir(cache).write_build_info({"fingerprint": fp})
    out = tmp_path / "bundle"
    pack(cache, out)
    return out


def test_install_refuses_a_bundle_built_under_another_toolchain_naming_each_factor(toolchain, monkeypatch):
    b = make_bundle(toolchain, npu_fp())
    standin.make_toolkit(Path(os.environ["ASCEND_HOME_PATH"]), version="8.5.0", inner="V100R001C25B100")
    standin.make_bishengir(toolchain / "bin", version="8.5.0")
    monkeypatch.setenv("TRITON_ENABLE_SANITIZER", "true")
    with pytest.raises(FingerprintMismatch) as e:
        install.install(str(b), toolchain / "node-cache", durable=False)
    for factor in ("ascend.cann.version", "ascend.bishengir.version", "ascend.bishengir.sha256",
                   "ascend.env.TRITON_ENABLE_SANITIZER"):
        assert factor in str(e.value)
    assert not (toolchain / "node-cache").exists() or not any(
        p.name != ".prewarm" for p in (toolchain / "node-cache").iterdir())


def test_install_accepts_a_bundle_from_the_same_toolchain(toolchain):
    b = make_bundle(toolchain, npu_fp())
    res = install.install(str(b), toolchain / "node-cache", durable=False)
    assert res.installed == 1
    assert (toolchain / "node-cache" / BUNDLED_KEY / "add_kernel.npubin").exists()


# --- one cache dir, one toolchain ---------------------------------------------------------------------------------


def test_claim_records_the_toolchain_and_accepts_it_again(toolchain):
    cache = toolchain / "cache"
    CacheDir(cache).claim_toolchain(npu_fp())
    record = json.loads(CacheDir(cache).toolchain.read_text())["factors"]
    assert record == fingerprint.toolchain_factors(npu_fp())
    (cache / "somekey").mkdir()
    (cache / "somekey" / "k.npubin").write_bytes(b"x")
    CacheDir(cache).claim_toolchain(npu_fp())  # same toolchain: fine


def test_claim_refuses_a_dir_filled_under_another_toolchain(toolchain):
    cache = toolchain / "cache"
    CacheDir(cache).claim_toolchain(npu_fp())
    standin.make_bishengir(toolchain / "bin", version="8.5.0")
    conflicts = CacheDir(cache).toolchain_conflicts(npu_fp())
    assert {m.factor for m in conflicts} == {"ascend.bishengir.version", "ascend.bishengir.sha256"}
    with pytest.raises(FingerprintMismatch, match="ascend.bishengir.version: the cache dir has"):
        CacheDir(cache).claim_toolchain(npu_fp())


def test_claim_refuses_kernels_of_unknown_toolchain(toolchain):
    cache = toolchain / "cache"
    entry = cache / "eTKeJ1R_GQfUT3rhySIydw3fON5j3RMY1z1xIQKapUk"
    entry.mkdir(parents=True)
    (entry / "k.npubin").write_bytes(b"x")
    (entry / "__grp__k.json").write_text("{}")
    with pytest.raises(FingerprintMismatch, match="1 kernels, toolchain not recorded"):
        CacheDir(cache).claim_toolchain(npu_fp())
    assert not CacheDir(cache).toolchain.exists()


def test_claim_accepts_a_dir_holding_only_the_drivers_npu_utils(toolchain):
    """The NPU driver writes npu_utils.so into the cache dir when a process starts it, before any compile."""
    (toolchain / "cache" / "fMYIAddf6WjySrKWEsFWzg").mkdir(parents=True)
    (toolchain / "cache" / "fMYIAddf6WjySrKWEsFWzg" / "npu_utils.so").write_bytes(b"\x7fELF")
    CacheDir(toolchain / "cache").claim_toolchain(npu_fp())
    assert CacheDir(toolchain / "cache").toolchain.exists()


def test_claim_is_a_no_op_for_cuda(tmp_path):
    cache = tmp_path / "cache"
    (cache / "somekey").mkdir(parents=True)
    (cache / "somekey" / "k.cubin").write_bytes(b"x")
    CacheDir(cache).claim_toolchain({"target.backend": "cuda", "cuda.ptxas": "12.8"})
    assert not CacheDir(cache).toolchain.exists()


def test_a_corrupt_toolchain_record_is_an_integrity_error(toolchain):
    record = CacheDir(toolchain / "cache").toolchain
    record.parent.mkdir(parents=True)
    record.write_text("{not json")
    with pytest.raises(IntegrityError, match="toolchain.json"):
        CacheDir(toolchain / "cache").toolchain_conflicts(npu_fp())


def test_install_refuses_to_mix_toolchains_in_one_cache_dir(toolchain):
    """Node on CANN 8.3 installs a bundle; CANN is upgraded; a bundle built under the new toolchain (it matches the
    node) must not land in the dir that holds the old toolchain's kernels: Triton would keep hitting those."""
    node_cache = toolchain / "node-cache"
    install.install(str(make_bundle(toolchain / "a", npu_fp())), node_cache, durable=False)
    assert CacheDir(node_cache).toolchain.exists()
    standin.make_bishengir(toolchain / "bin", version="8.5.0")
    with pytest.raises(FingerprintMismatch, match="ascend.bishengir.version: the cache dir has"):
        install.install(str(make_bundle(toolchain / "b", npu_fp())), node_cache, durable=False)


# --- the serving process's codegen env ----------------------------------------------------------------------------


def test_serving_check_covers_f32_default_and_reads_every_installed_bundle(toolchain, monkeypatch):
    node_cache = toolchain / "node-cache"
    install.install(str(make_bundle(toolchain / "a", npu_fp())), node_cache, durable=False)
    assert npu.serving_env_mismatches(node_cache, {}) == []
    found = npu.serving_env_mismatches(node_cache, {"TRITON_F32_DEFAULT": "hf32", "TRITON_DISABLE_FFTS": "1"})
    assert {m.factor for m in found} == {"ascend.env.TRITON_F32_DEFAULT", "ascend.env.TRITON_DISABLE_FFTS"}
    old = {k: v for k, v in npu_fp().items() if k != "ascend.env.TRITON_F32_DEFAULT"}  # built before it was a factor
    install.install(str(make_bundle(toolchain / "b", old)), node_cache, durable=False, allow_missing_factors=True)
    assert npu.serving_env_mismatches(node_cache, {}) == []
    assert [m.built for m in npu.serving_env_mismatches(node_cache, {"TRITON_F32_DEFAULT": "hf32"})] == [
        "unset", "(not recorded)"]


# --- what only some triton-ascend releases read -------------------------------------------------------------------


def test_release_factors_read_na_where_the_installed_triton_does_not_have_them(toolchain, monkeypatch):
    na = f"n/a ({tritoncompat.triton_distribution()[1]})"  # this env: upstream triton, no Ascend backend at all
    fp = npu_fp()
    assert [fp[f] for f in ("ascend.env.TRITON_ENABLE_UBTUNER", "ascend.compile_on_910_95", "ascend.install_path")] == [
        na] * 3
    monkeypatch.setenv("TRITON_ENABLE_UBTUNER", "compile")
    assert npu_fp()["ascend.env.TRITON_ENABLE_UBTUNER"] == na  # not read here: no difference to refuse on


def fake_backend(root: Path) -> Path:
    """triton/backends/ascend of a triton-ascend 3.5+ wheel, as far as the seams read it (main branch layout)."""
    backend = root / "triton" / "backends" / "ascend"
    (backend / "runtime").mkdir(parents=True)
    (backend / "runtime" / "autotuner.py").write_text(  # main: runtime/autotuner.py reads it in Autotuner.__init__
        'self.enable_ubtuner = os.getenv("TRITON_ENABLE_UBTUNER", "").lower() in ("compile", "run")\n')
    return backend


def test_triton_ascend_35_reads_ubtuner_and_keys_on_its_install_path(tmp_path):
    backend = fake_backend(tmp_path)
    assert tritoncompat.ascend_reads_env("TRITON_ENABLE_UBTUNER", backend)
    assert not tritoncompat.ascend_reads_env("TRITON_ALL_BLOCKS_PARALLEL", backend)
    # main's NPUOptions: bisheng_options = "-cce-link-aicore-ll-module " + get_libdevice() (an absolute path)
    libdevice = f"{backend}/lib/libdevice.10.bc"
    assert tritoncompat.ascend_install_path_in_key({"bisheng_options": f"-cce-link-aicore-ll-module {libdevice}",
                                                    "num_warps": 32}) == libdevice
    assert tritoncompat.ascend_install_path_in_key({"num_warps": 4, "multibuffer": True}) is None  # 3.2.0's options
    assert [tritoncompat.ascend_layout(v) for v in ("3.2.0", "3.2.2", "3.5.0", "3.6.0rc1")] == ["3.2", "3.2", "3.5",
                                                                                                "3.5"]


def test_triton_ascend_35_runs_the_bishengir_bundled_in_the_wheel_first(toolchain, tmp_path):
    backend = fake_backend(tmp_path / "site")
    on_path = str(toolchain / "bin" / "bishengir-compile")
    assert tritoncompat.ascend_compiler_path("3.5", backend) == on_path  # nothing bundled: PATH, as 3.2
    bundled = standin.make_bishengir(backend.joinpath(*tritoncompat.ASCEND_BUNDLED_COMPILER[:-1]), version="8.5.0")
    assert tritoncompat.ascend_compiler_path("3.5", backend) == str(bundled)
    assert tritoncompat.ascend_compiler_path("3.2", backend) == on_path  # 3.2.0 never looks there


def test_triton_ascend_35_key_dirs_are_base32_as_upstreams():
    from triton.runtime.cache import _base32  # upstream 3.6's, the same function as triton-ascend main's cache.py

    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    assert tritoncompat.ascend_key_dir(digest, "3.5") == _base32(digest)
    assert len(tritoncompat.ascend_key_dir(digest, "3.2")) == 43  # urlsafe base64: triton-ascend 3.2's key dirs


@pytest.mark.parametrize("arch", ['[]', '["Ascend910_9391", "Ascend910_9391"]', '["Ascend910_9391", 7]', '[" "]'])
def test_a_bad_soc_list_is_refused_naming_the_key(tmp_path, arch):
    path = tmp_path / "fleet.toml"
    path.write_text(f'[target]\nbackend = "npu"\narch = {arch}\n\n[[kernels]]\nfunction = "m:k"\n')
    with pytest.raises(ManifestError, match=r"target\.arch = .*a non-empty list of distinct ones"):
        manifest.load(path)


def test_a_soc_list_keeps_every_soc_and_the_first_as_arch(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text('[target]\nbackend = "npu"\narch = ["Ascend910_9392", "Ascend910_9381"]\n\n[[kernels]]\n'
                    'function = "m:k"\n')
    m = manifest.load(path)
    assert (m.arch, npu.socs(m)) == ("Ascend910_9392", ("Ascend910_9392", "Ascend910_9381"))
    narrowed = npu.for_soc(m, "Ascend910_9381")
    assert (narrowed.arch, narrowed.archs, narrowed.name) == ("Ascend910_9381", ("Ascend910_9381",), "fleet-Ascend910_9381")
