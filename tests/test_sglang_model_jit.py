"""The sglang JIT modules Kimi-Linear's step reaches past Triton on CUDA (``prewarm.providers.sglang.model_mlp``,
``model_spec_jit``), as the shipped H200 sglang manifest plans them: each module with the template arguments sglang's
call sites give it for the deployment (the gated SiLU's dtype and PDL, the EAGLE verify's tree module, the sampled
accept's ``vec_size = gcd(4, vocab)`` and ``deterministic``), a module only where the deployment reaches it (the
JIT activation only for widths its vector divides; the speculative modules only with EAGLE), and what is not planned
named in the coverage hook. The expected arguments are written here from sglang's sources (activation.py,
tree.py, sampling.py, eagle_utils.verify), not from the modules under test."""
from __future__ import annotations

import copy
import math

import pytest

from prewarm.building import backends
from prewarm.jit import JitRequest
from prewarm.planning.manifest import load
from prewarm.providers.sglang import cuda, model, model_mlp, model_spec_jit
from prewarm.providers.sglang.common import fake_device, published_parallel, read_spec
from prewarm_kernels.spec import SpecError
from test_sglang import MANIFEST

CPP = {"bfloat16": "bf16_t", "float16": "fp16_t"}  # sglang's CPP_DTYPE_MAP for the model's activation dtypes
PDL = "true"  # is_arch_support_pdl(): sm_90 and above


@pytest.fixture(scope="module", autouse=True)
def h200():
    """Device queries answer as the manifest's H200, as ``prewarm plan`` has them."""
    backends.activate_for_planning(load(MANIFEST))


def _spec(**changes) -> dict:
    """The shipped spec with ``[spec.sglang.model]`` keys changed (None: removed), or ``dtypes`` / ``draft_widths``."""
    spec = copy.deepcopy(load(MANIFEST).spec())
    for key, value in changes.items():
        if key == "dtypes":
            spec["dtypes"]["activation"] = value
        elif key == "draft_widths":
            spec["serving"]["draft_widths"] = value
        elif value is None:
            spec["sglang"]["model"].pop(key, None)
        else:
            spec["sglang"]["model"][key] = value
    return spec


def _modules(spec: dict, *modules) -> dict[str, tuple]:
    """module name -> load_jit's module args, of the sglang JIT modules ``modules``' calls reach."""
    s = read_spec(spec)
    with published_parallel(s), fake_device(s.device) as device:
        for module in modules:
            for _, call in module.calls(spec, s, s.device):
                call()
    return {r.name: tuple(r.call["args"]) for r in device.jit}


def test_the_plan_lists_each_module_the_model_reaches_with_its_template_arguments():
    """The model's launches (what ``prewarm plan`` takes for the provider's model part) carry sglang's own requests:
    the gated SiLU in the checkpoint's bf16 with PDL (dense MLP, shared and routed experts: one module), the EAGLE
    verify's tree module, and the sampled accept at Kimi-Linear's vocab (163840: vec_size 4), deterministic."""
    spec = _spec()
    s = read_spec(spec)
    vocab = spec["sglang"]["model"]["vocab_size"]
    jit = {r.name: r for r in model.launches(spec, s, []) if isinstance(r, JitRequest)}
    expected = {("activation", CPP["bfloat16"], PDL), ("speculative_tree",),
                ("speculative_sampling", str(math.gcd(4, vocab)), "True")}
    reached = {tuple(r.call["args"]) for r in jit.values() if r.library == "sglang"}
    assert expected <= reached, reached
    for args in expected:
        name = "sgl_kernel_jit_" + "_".join(args)  # BuildSpec.module_name: the args joined
        assert jit[name].library == "sglang" and jit[name].origin, jit[name]


def test_each_activation_dtype_is_its_own_module_and_unaligned_widths_take_sgl_kernel():
    """``activation_module(dtype)``: one module per activation dtype; a per-rank width its 16-byte vector does not
    divide (``_jit_act_supported`` on sm_90) runs sgl-kernel's ahead-of-time op, nothing to build."""
    both = _modules(_spec(dtypes=["bfloat16", "float16"]), model_mlp)
    assert set(both.values()) == {("activation", CPP[d], PDL) for d in ("bfloat16", "float16")}
    width = 1364  # 1364 % (16 // 2) == 4: unaligned for a 2-byte dtype
    assert width % (16 // 2)
    assert _modules(_spec(intermediate_size=width, moe_intermediate_size=width), model_mlp) == {}
    # the dense MLP unaligned, the experts aligned: the module is still reached (by the experts)
    assert set(_modules(_spec(intermediate_size=width), model_mlp).values()) == {("activation", "bf16_t", PDL)}


def test_the_sampled_accept_follows_the_vocab_and_needs_it():
    """``vec_size = gcd(4, vocab)``: an odd-by-two vocab builds the 2-wide module; without a vocab only the greedy
    tree module is planned and the coverage hook names the sampled one; without EAGLE neither."""
    assert set(_modules(_spec(vocab_size=163842), model_spec_jit).values()) == {
        ("speculative_tree",), ("speculative_sampling", "2", "True")}
    assert set(_modules(_spec(vocab_size=None), model_spec_jit).values()) == {("speculative_tree",)}
    rows = model_spec_jit.coverage(_spec(vocab_size=None))["not_planned"]
    assert any("speculative_sampling" in r["what"] and "vocab_size" in r["why"] for r in rows), rows
    assert _modules(_spec(draft_widths=[1]), model_spec_jit) == {}


@pytest.mark.parametrize("key,value", [("intermediate_size", 0), ("num_shared_experts", -1),
                                       ("moe_intermediate_size", "1024")])
def test_a_bad_width_is_named(key, value):
    with pytest.raises(SpecError, match=f"sglang.model.{key}"):
        _modules(_spec(**{key: value}), model_mlp)


def test_the_coverage_hook_says_what_the_norms_and_mlps_reach():
    """The dense MLP is a component (its JIT module planned; its GEMMs named as cuBLAS), the EAGLE verify's JIT rows
    no longer stand among what is not planned, and the norms name what they really reach on CUDA: FlashInfer's CuTe
    DSL kernels, not sglang's JIT rmsnorm. Without ``intermediate_size`` the dense MLP says why it is not planned."""
    components = {c["component"]: c for c in cuda.coverage(_spec())}
    assert not components["dense_mlp"]["planned"]
    assert all("silu_and_mul" not in r["what"] for c in components.values() for r in c["not_planned"])
    assert all("tree verify" not in r["what"] for r in components["spec_worker"]["not_planned"])
    assert [c["component"] for c in cuda.coverage(_spec())].count("spec_worker") == 1
    (norm,) = components["norm"]["not_planned"]
    assert "CuTe DSL" in norm["what"] and "cast_x_before_out_mul" in norm["why"]
    missing = model_mlp.coverage(_spec(intermediate_size=None))["not_planned"]
    assert any("intermediate_size" in r["why"] for r in missing), missing


def test_custom_ops_kept_on_the_dispatcher_are_refused_by_name():
    """Where sglang keeps its custom ops on the dispatcher (kernel API logging on), a fake tensor would run their fake
    implementation and the module they load would go unplanned: the planner says so (exit 11) instead."""
    import types

    from prewarm.errors import EnvironmentProblem

    with pytest.raises(EnvironmentProblem, match="SGLANG_KERNEL_API_LOGLEVEL"):
        with model_mlp.eager_custom_ops(types.ModuleType("sglang_ops_without_eager_path")):
            pass
