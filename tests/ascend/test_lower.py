"""`prewarm lower`: every planned compile through triton-ascend's real front end (ast -> ttir -> ttadapter)."""
from __future__ import annotations

import json

import pytest
from conftest import ARCH, REPO, TOY_COMPILES, run_prewarm, write_manifest

from prewarm.node import fingerprint

from prewarm.building import lower, tritoncompat

from prewarm.planning import manifest, plan
from prewarm.errors import BuildError, EnvironmentProblem


def test_every_compile_of_the_toy_manifest_is_lowered_with_stage_timings(toy_manifest):
    r = lower.lower(manifest.load(toy_manifest))
    assert r.requests == TOY_COMPILES and len(r.compiles) == TOY_COMPILES
    assert r.lowered == TOY_COMPILES and not r.failed
    assert r.triton == "triton-ascend 3.2.0" and r.arch == ARCH
    for c in r.compiles:
        assert list(c.stage_ms) == list(lower.STAGES) and all(ms > 0 for ms in c.stage_ms.values())
        assert len(c.cache_key) == 43  # triton 3.2's key dir: urlsafe base64 of a sha256
    assert len({c.cache_key for c in r.compiles}) == TOY_COMPILES  # n = 4096 / 4095 / 1 specialize apart


def test_lowering_is_what_compile_would_key_and_stage(toy_manifest, tmp_path, monkeypatch):
    """The real triton.compiler.compile on the same request: it writes the same key dir, with the ttir and
    ttadapter stages done, and stops at the first stage that needs CANN."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.errors import MLIRCompilationError

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    m = manifest.load(toy_manifest)
    r = lower.lower(m)
    req = plan.plan(m).requests[0]
    (compile_,) = plan.expand(req)
    fn = tritoncompat.jit_function(plan.resolve(req.kernel))
    data = json.loads(compile_.specialization)
    from triton.backends.ascend.compiler import AscendAttrsDescriptor
    from triton.compiler.compiler import ASTSource, compile

    src = ASTSource(fn, data["signature"], data["constants"], AscendAttrsDescriptor.from_dict(data["attrs"]))
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    with pytest.raises(MLIRCompilationError, match="ConvertLinalgRToBinary"):
        compile(src, target=GPUTarget("npu", ARCH, 0), options=options)
    entry = tmp_path / "cache" / r.compiles[0].cache_key
    assert sorted(p.suffix for p in entry.iterdir()) == [".ttadapter", ".ttir"]


def test_a_front_end_failure_names_kernel_variant_stage_and_message(tmp_path):
    m = write_manifest(tmp_path / "bad.toml", """
        [[kernels]]
        function = "ascend_toy_kernels:undefined_name_kernel"
        label = "broken"
        args = { x = {tensor = "float32"}, BS = [64, 128] }

        [[kernels]]
        function = "ascend_toy_kernels:add_kernel"
        args = { x = {tensor = "float32"}, y = {tensor = "float32"}, o = {tensor = "float32"}, T = 1, n = 16, BS = 64 }
    """)
    r = lower.lower(manifest.load(m))
    assert r.lowered == 1 and len(r.failed) == 2  # one failure does not stop the others
    for f, bs in zip(r.failed, (64, 128)):
        assert (f.kernel, f.label, f.failed_stage) == ("ascend_toy_kernels:undefined_name_kernel", f"broken BS={bs}",
                                                        "ast")
        assert "not_defined_anywhere" in f.error
    p = run_prewarm("lower", m)
    assert p.returncode == BuildError.exit_code, p.stderr
    said = " ".join(p.stderr.split())  # rich wraps long lines
    assert "ascend_toy_kernels:undefined_name_kernel variant 'broken BS=64': stage ast failed" in said
    assert "ascend_toy_kernels:undefined_name_kernel variant 'broken BS=128': stage ast failed" in said
    assert "not_defined_anywhere" in said


def test_cli_reports_counts_and_timings(toy_manifest):
    p = run_prewarm("lower", "--json", toy_manifest)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc["requests"], doc["lowered"], doc["failed"]) == (TOY_COMPILES, TOY_COMPILES, 0)
    assert all(set(c["stage_ms"]) == {"ast", "ttir", "ttadapter"} for c in doc["compiles"])
    p = run_prewarm("lower", toy_manifest)
    assert p.returncode == 0, p.stderr
    assert f"{TOY_COMPILES} of {TOY_COMPILES} compiles ({TOY_COMPILES} requests) lowered to linalg" in p.stdout


def test_lower_refuses_a_cuda_manifest():
    p = run_prewarm("lower", REPO / "manifests" / "kimi-linear-h200.toml")
    assert p.returncode == EnvironmentProblem.exit_code and "lower checks the Ascend (npu) front end only" in p.stderr


def test_kimi_k3_ascend_manifest_lowers_every_request():
    """The CI check: every compile the Ascend manifest plans (pinned configs, every variant) reaches linalg."""
    m = REPO / "manifests" / "kimi-k3-ascend-a3.toml"
    p = run_prewarm("lower", "--json", m)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["failed"] == 0 and doc["lowered"] == len(doc["compiles"]) >= doc["requests"] > 0
    p = run_prewarm("plan", "--json", m)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(json.loads(p.stdout)["requests"]) == doc["requests"]


DOT_KERNEL = """
    [[kernels]]
    function = "ascend_toy_kernels:dot_kernel"
    args = { a = {tensor = "float32"}, b = {tensor = "float32"}, c = {tensor = "float32"}, M = 32, N = 64, K = 128 }
"""


def test_f32_default_changes_the_code_but_not_the_key_so_it_is_a_factor(tmp_path, monkeypatch):
    """TRITON_F32_DEFAULT=hf32 turns an fp32 tl.dot from ieee into hf32; triton-ascend 3.2.0's key stays the same,
    so a bundle built without it would be reused silently: the fingerprint carries it (install and the serving
    check compare it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, compile
    from triton.compiler.errors import MLIRCompilationError
    from triton.backends.ascend.compiler import AscendAttrsDescriptor

    m = manifest.load(write_manifest(tmp_path / "dot.toml", DOT_KERNEL))
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)

    def front_end(cache: str) -> tuple[str, str, dict]:
        """(key, the linalg compile() wrote before the CANN stage, the Ascend factors)"""
        (c,) = lower.lower(m).compiles
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / cache))
        (planned,) = plan.expand(plan.plan(m).requests[0])
        data = json.loads(planned.specialization)
        src = ASTSource(tritoncompat.jit_function(plan.resolve(planned.kernel)), data["signature"], data["constants"],
                        AscendAttrsDescriptor.from_dict(data["attrs"]))
        with pytest.raises(MLIRCompilationError):
            compile(src, target=GPUTarget("npu", ARCH, 0), options={k: tuple(v) if isinstance(v, list) else v
                                                                    for k, v in data["options"].items()})
        (linalg,) = (tmp_path / cache / c.cache_key).glob("*.ttadapter")
        return c.cache_key, linalg.read_text(), fingerprint.ascend_factors()

    key, ieee, before = front_end("ieee")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "hf32")
    hf32_key, hf32, after = front_end("hf32")
    assert hf32_key == key  # Triton's key does not see it ...
    assert 'input_precison = "ieee"' in ieee and 'input_precison = "hf32"' in hf32  # ... the code does
    assert {k for k in before if before[k] != after[k]} == {"ascend.env.TRITON_F32_DEFAULT"}


def test_ub_estimate_counts_every_local_buffer_with_loads_double_buffered(tmp_path):
    (c,) = lower.lower(manifest.load(write_manifest(tmp_path / "dot.toml", DOT_KERNEL))).compiles
    # loads a (32x128) and b (128x64) fp32, double-buffered (NPUOptions.multibuffer), + the 32x64 fp32 result
    assert c.ok and c.ub_bytes == 2 * (32 * 128 + 128 * 64) * 4 + 32 * 64 * 4


WIDE_DOT = DOT_KERNEL.replace("M = 32, N = 64, K = 128", "M = 64, N = 128, K = 128")  # 2 x (32 + 64) + 32 = 224 KB
TUNED_DOT = """
    [[kernels]]
    function = "ascend_toy_tuned:dot_tuned_kernel"
    args = { a = {tensor = "float32"}, b = {tensor = "float32"}, c = {tensor = "float32"}, K = 128 }
"""  # autotuned: M = 32, N = 64 (104 KB) and M = 64, N = 128 (224 KB)


@pytest.mark.parametrize("arch, fits", [("Ascend910_9391", False), ("Ascend910B3", False), ("Ascend910_9589", True)])
def test_an_autotuned_config_that_cannot_fit_the_socs_ub_fails_before_a_node_tries_it(tmp_path, arch, fits):
    """192 KB of UB on 910B / A3, 256 KB on 910_95 (triton-ascend's own tile generator): an autotuned kernel's config
    over it fails (exit 4), a smaller one can be pinned; the config that fits lowers."""
    m = write_manifest(tmp_path / "tuned.toml", TUNED_DOT, arch=arch)
    r = lower.lower(manifest.load(m))
    assert sorted(c.ub_bytes for c in r.compiles) == [104 * 1024, 224 * 1024] and not r.warnings
    if fits:
        assert not r.failed
        return
    (failed,) = r.failed
    assert failed.failed_stage == "ub" and failed.failure() == (
        f"ascend_toy_tuned:dot_tuned_kernel variant {failed.label!r}: stage ub failed: estimated on-chip buffer "
        f"footprint 224 KB exceeds {arch}'s 192 KB unified buffer: this config cannot fit; pin smaller blocks")


@pytest.mark.parametrize("arch, fits", [("Ascend910_9391", False), ("Ascend910_9589", True)])
def test_a_fixed_config_over_the_ub_estimate_is_a_warning_naming_kernel_estimate_and_budget(tmp_path, arch, fits):
    """A kernel that is not autotuned runs its library's one config (nothing to pin) and the estimate is an upper
    bound: over the budget it lowers with a warning (exit 0), which only a node's bishengir-compile can confirm."""
    m = write_manifest(tmp_path / "wide.toml", WIDE_DOT, arch=arch)
    p = run_prewarm("lower", m)
    said = " ".join(p.stdout.split() + p.stderr.split())
    assert p.returncode == 0 and "1 of 1 compiles (1 requests) lowered to linalg; largest UB estimate 224 KB" in said, \
        said
    warning = (f"warning: ascend_toy_kernels:dot_kernel: estimated on-chip buffer footprint 224 KB exceeds {arch}'s "
               f"192 KB unified buffer in the one config its library chose (not autotuned: nothing to pin); the "
               f"estimate is an upper bound (no buffer reuse), unconfirmed: only a node's bishengir-compile can tell")
    assert (warning in said) != fits, said
    assert "256 KB" in said if fits else "of 192 KB" in said


def test_a_stage_tool_killed_by_a_signal_is_retried_once_and_reported():
    """triton-ascend 3.2.0's triton-adapter-opt sometimes aborts (malloc(): corrupted top size) on an input it lowers
    on the next try: one retry, the crash kept in the report; a second crash, or a tool that exits with an error,
    fails the stage."""
    import subprocess

    def flaky(fails: int, code: int):
        calls = []

        def step(module):
            calls.append(module)
            if len(calls) <= fails:
                raise subprocess.CalledProcessError(code, ["triton-adapter-opt"], stderr=b"malloc(): corrupted top size")
            return "linalg"

        return step, calls

    out = lower.LoweredCompile("k", "label", "id")
    step, calls = flaky(1, -6)
    assert lower._run_stage(step, "ttir", out) == "linalg" and calls == ["ttir", "ttir"]
    assert out.crashed == "malloc(): corrupted top size" and out.ok
    for fails, code in ((2, -6), (1, 1)):
        step, calls = flaky(fails, code)
        with pytest.raises(subprocess.CalledProcessError):
            lower._run_stage(step, "ttir", lower.LoweredCompile("k", "label", "id"))
        assert len(calls) == (2 if code < 0 else 1)
