"""vLLM 0.34.0's Kimi-Linear KDA layer planned whole: the shipped manifest's plan (``prewarm.providers.vllm_kda``,
driving ``KimiGatedDeltaNetAttention.forward`` through ``prewarm.providers.vllm_layer``) against independent
layer-level traffic (``tests/traffic/vllm_layer.py``: written from vLLM's builder and model runner, not from the
provider), by the key Triton computes for each compile request on fake tensors. Every kernel the layer launches is
in the plan: the KDA core, the causal conv (prefill and update), the gathered and scattered states, the gated
RMSNorm (``o_norm``), the spec-verify recurrent kernel."""
from __future__ import annotations

from pathlib import Path

import pytest

from closure_traffic import fresh_seed
from prewarm.backends import get_target
from prewarm.manifest import load
from prewarm.plan import plan_for
from prewarm.probe import planned_keys
from test_vllm import not_planned, runtime_compiles
from traffic import vllm_layer as traffic

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
STEPS_PER_SEED = 60
LAYER_KERNELS = {"_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "_gather_initial_states_kernel",
                 "_scatter_states_kernel", "layer_norm_gated_fwd_kernel", "fused_recurrent_kda_fwd_kernel",
                 "fused_recurrent_kda_packed_decode_kernel", "chunk_gla_fwd_kernel_o"}


@pytest.fixture(scope="module")
def planned():
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def test_the_plan_holds_every_kernel_the_layer_launches(planned):
    _, p, _ = planned
    assert LAYER_KERNELS <= {c.kernel.split(":")[1] for c in p.compiles}


@pytest.mark.parametrize("seed", [7, fresh_seed()], ids=lambda s: f"seed{s}")
def test_layer_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(traffic.calls(m.spec(), seed, STEPS_PER_SEED, "cuda"))
    compiles = runtime_compiles(calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    kernels = {c.kernel.split(":")[1] for c in compiles.values()}
    assert LAYER_KERNELS - {"chunk_gla_fwd_kernel_o"} <= kernels, LAYER_KERNELS - kernels
