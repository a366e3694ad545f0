"""The MoE router's route in the sglang CUDA plan (``prewarm.providers.sglang.model_moe``: :func:`router_route` and the
router calls) against sglang's own dispatch, where sglang itself is installed (``.venv-sglang``).

sglang's ``biased_grouped_topk_gpu`` (``srt/layers/moe/topk.py``, where Kimi-Linear's grouped ``TopK`` with a
correction bias lands on CUDA) cannot be imported beside the build/sglang stand-in (it imports the serving stack), so
the provider states its CUDA conditions in :func:`router_route`. Here sglang's own function runs on fake tensors under
the H200's device profile for Kimi-Linear's router and the other routes around it (FlashInfer's
``fused_topk_deepseek``, the grouped Triton router, the Kimi K2/K3 branch, ``biased_grouped_topk_impl``): each
non-Triton route is recorded where sglang enters it (not run), and every Triton launch of the Triton routes must have a
key the provider's router calls for the same widths produce.
"""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from prewarm.building.backends import get_target
from prewarm.building.probe import planned_keys
from prewarm.planning.manifest import load
from prewarm.providers.sglang import model_moe
from prewarm.providers.sglang.common import published_parallel, read_spec
from prewarm_kernels.spec import SpecError
from test_sglang import MANIFEST, runtime_compiles
from traffic import Call

TOKENS = (1, 2, 16, 17, 48, 300)  # each int class of the router's M (1, a multiple of 16, other), small and large
# (experts, top-k, groups, groups kept, renormalize) -> the route sglang takes (None: its Triton moe_fused_gate)
ROUTES = {
    (256, 8, 1, 1, True): None,  # Kimi-Linear: groups x kept < top-k rules FlashInfer out
    (128, 8, 1, 1, False): None,  # ungrouped, no renormalization (a constexpr)
    (256, 8, 8, 4, False): None,  # DeepSeek-V3's groups without renormalization: the grouped Triton router
    (256, 8, 8, 4, True): "flashinfer",  # DeepSeek-V3
    (256, 1, 1, 1, True): "flashinfer",  # top-1 of one group
    (384, 8, 1, 1, True): "handoff",  # Kimi K2: route_quant_handoff, then the Triton router on bf16 logits
    (1536, 8, 1, 1, True): "impl",  # past every fused router
}
# the word each route's reason names (router_route's "why")
REASON = {"flashinfer": "fused_topk_deepseek", "handoff": "route_quant_handoff", "impl": "biased_grouped_topk_impl"}


class _Entered(Exception):
    """Raised where sglang's dispatch enters a route not driven here."""


def _sglang_installed() -> bool:
    """Whether sglang's own top-k module is here (not only the build/sglang stand-in), asked without importing any of
    sglang's packages (their imports read the device, which must be the H200's profile first)."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and any((Path(d) / "srt" / "layers" / "moe" / "topk.py").is_file()
                                    for d in spec.submodule_search_locations or ())


def _spec(base: dict, experts: int, top_k: int, groups: int, kept: int, renormalize: bool) -> dict:
    spec = copy.deepcopy(base)
    spec["sglang"]["model"].update(num_experts=experts, experts_per_token=top_k, num_expert_group=groups,
                                   topk_group=kept, moe_renormalize=renormalize)
    return spec


def _planned_router_keys(spec: dict) -> set:
    """The keys of the provider's router calls for ``spec`` (its ``moe/router`` labels, nothing else run)."""
    s = read_spec(spec)
    with published_parallel(s):
        calls = [Call(label, run) for label, run in model_moe.calls(spec, s, "cuda") if "/router[" in label]
        compiles, _ = runtime_compiles(spec, calls)
    return set(planned_keys(list(compiles.values())))


@pytest.mark.skipif(not _sglang_installed(), reason="sglang's own topk module needs sglang's serving stack (not the "
                    "build/sglang stand-in): run in .venv-sglang")
def test_sglangs_own_dispatch_takes_the_route_the_provider_plans(monkeypatch):
    get_target("cuda", "sm_90", "offline", "H200").activate()  # before sglang reads the device (_is_cuda, PDL)
    import torch

    from sglang.srt.layers.moe import route_quant_handoff
    from sglang.srt.layers.moe import topk

    entered: list[str] = []

    def enter(route):
        def record(*args, **kwargs):
            entered.append(route)
            raise _Entered(route)
        return record

    monkeypatch.setattr(topk, "fused_topk_deepseek", enter("flashinfer"))
    monkeypatch.setattr(topk, "biased_grouped_topk_impl", enter("impl"))
    monkeypatch.setattr(route_quant_handoff, "try_route_quant_fused", enter("handoff"))
    base = load(MANIFEST).spec()
    for (experts, top_k, groups, kept, renormalize), route in ROUTES.items():
        spec = _spec(base, experts, top_k, groups, kept, renormalize)
        r = model_moe.read_router(spec)
        why = model_moe.router_route(r)
        entered.clear()

        def sglang_router(tokens):
            # KimiMoE: the gate's bf16 logits, the bf16 e_score_correction_bias, apply_routed_scaling_factor off
            logits = torch.empty(tokens, experts, dtype=torch.bfloat16, device="cuda")
            bias = torch.empty(experts, dtype=torch.bfloat16, device="cuda")
            try:
                topk.biased_grouped_topk_gpu(logits, logits, bias, top_k, renormalize, groups, kept, 0,
                                             r.routed_scaling_factor, False)
            except _Entered:
                pass

        calls = [Call(f"sglang[T={t}]", lambda t=t: sglang_router(t)) for t in TOKENS]
        compiles, _ = runtime_compiles(spec, calls)
        shape = (experts, top_k, groups, kept, renormalize)
        if route is None:
            assert why is None and not entered, (shape, why, entered)
            kernels = {c.kernel.split(":")[1] for c in compiles.values()}
            assert kernels == {"_router_triton_kernel"}, (shape, kernels)
            missing = set(planned_keys(list(compiles.values()))) - _planned_router_keys(spec)
            assert not missing, (shape, f"{len(missing)} of {len(compiles)} router launches not planned")
        else:
            assert set(entered) == {route} and REASON[route] in (why or ""), (shape, why, entered)
            assert not any(c.kernel.endswith(":_router_triton_kernel") for c in compiles.values()), shape


def test_without_the_routers_keys_the_router_is_not_planned_and_coverage_says_why():
    get_target("cuda", "sm_90", "offline", "H200").activate()  # the MoE's config lookup reads the device's name
    spec = load(MANIFEST).spec()
    assert model_moe.read_router(spec) is not None
    assert model_moe.ROUTER_KERNEL in model_moe.coverage(spec)["planned"]
    for key in model_moe.ROUTER_KEYS:
        del spec["sglang"]["model"][key]
    s = read_spec(spec)
    labels = [label for label, _ in model_moe.calls(spec, s, "cuda")]
    assert labels and not any("/router[" in label for label in labels)
    entry = model_moe.coverage(spec)
    assert model_moe.ROUTER_KERNEL not in entry["planned"]
    assert "num_expert_group" in entry["not_planned"][0]["why"]


@pytest.mark.parametrize("key, value", [("num_expert_group", 0), ("num_expert_group", 3), ("topk_group", 2),
                                        ("topk_group", None), ("moe_renormalize", "yes")])
def test_a_bad_router_key_names_it(key, value):
    spec = load(MANIFEST).spec()
    if value is None:
        del spec["sglang"]["model"][key]
    else:
        spec["sglang"]["model"][key] = value
    with pytest.raises(SpecError, match=f"sglang.model.{key}"):
        list(model_moe.calls(spec, read_spec(spec), "cuda"))
