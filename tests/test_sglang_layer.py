"""sglang 0.5.23's CUDA KDA layer (``KDAAttnBackend`` with its conv, state tracking, verify commit and the model's
o_norm), planned by ``prewarm.providers.sglang.cuda`` for the shipped H200 manifest, checked against independent
layer-level traffic (``tests/traffic/sglang_layer.py``: written from sglang's backend, metadata builder, pools and
Kimi-Linear's layer, not from the provider) run through sglang's own backend on fake tensors: every compile request
the traffic makes has its key in the plan (the key Triton computes, the one a node's runtime looks up), and every
sglang JIT module it reaches is planned.
"""
from __future__ import annotations

import pytest

from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for
from prewarm.building.probe import planned_keys
from test_sglang import MANIFEST, not_planned, runtime_compiles
from traffic import sglang_layer
from traffic.closure import fresh_seed

CALLS_PER_SEED = 120
# the kernels the layer launches around TritonKDAKernel's: the causal conv (prefill, decode/verify), the radix
# cache's decode tracking, the verify commit's index math and scatters, the o_norm
LAYER_KERNELS = {"_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "track_mamba_state_if_needed_kernel",
                 "_fused_commit_track_indices_kernel", "_fused_mamba_state_scatter_with_mask_kernel",
                 "_fused_conv_window_scatter_multi_kernel", "layer_norm_gated_fwd_kernel"}


@pytest.fixture(scope="module")
def planned():
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def test_the_plan_holds_the_layers_conv_state_and_norm_kernels(planned):
    _, p, _ = planned
    assert LAYER_KERNELS <= {c.kernel.split(":")[1] for c in p.compiles}


@pytest.mark.parametrize("seed", [11, fresh_seed()], ids=lambda s: f"seed{s}")
def test_layer_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, p, _ = planned
    calls = list(sglang_layer.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    compiles, jit = runtime_compiles(m.spec(), calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    assert {c.options["kind"] for c in calls} == {"extend", "decode", "target_verify"}
    assert LAYER_KERNELS <= {c.kernel.split(":")[1] for c in compiles.values()}
    unplanned = sorted({j.name for j in jit} - {j.name for j in p.jit if j.library == "sglang"})
    assert jit and not unplanned, f"seed {seed}: sglang JIT modules reached, not planned: {unplanned}"


def test_the_derived_pool_geometry_is_the_pools_sglang_lays_out(planned):
    """``prewarm plan`` prints the pool geometry the plan derives (slots, strides) with where a live server shows it:
    each value is the one the pools laid out as sglang's MambaPool (the traffic's, written from memory_pool.py) have."""
    import random

    from prewarm.providers.sglang import common as sglang_env
    from prewarm.providers.sglang import cuda as sglang_cuda

    m, _, _ = planned
    s = sglang_env.read_spec(m.spec())
    derived = {key: value for key, value, _ in sglang_cuda.geometry(s)}
    traffic = sglang_layer._Traffic(s, random.Random(0), "cuda")
    with sglang_env.fake_device("cuda"):
        for width in s.draft_widths:
            server = sglang_layer._Server(traffic, {role: names[0] for role, names in s.dtypes.items()} |
                                          {"width": width, "tree": False})
            cache = server.pool.mamba2_layer_cache(s.layers - 1)
            assert derived[f"verify conv window slot stride, draft {width}"] == \
                cache.intermediate_conv_window[0].stride(0)
    assert derived["spec.sglang.mamba_pool_slots"] == cache.conv[0].shape[0]
    assert derived["conv pool slot stride"] == cache.conv[0].stride(0)
    assert derived["state pool slot stride"] == cache.temporal.stride(0)


def test_the_plan_holds_the_servers_kernels_around_the_layer_and_every_graph_replay(planned):
    """What the server launches for the same batches outside the KDA layer's own path is planned: the runner's extend
    positions, the mamba pool's slot clear / copy-on-write, the EAGLE commit (chain at each draft width, with and
    without the radix track interval; tree at each depth), and the CUDA-graph replay's slot-table refresh at every
    --cuda-graph-bs bucket, for each padding class of the requests it serves (valid_bs 1, a multiple of 16, other)."""
    from prewarm.building import tritoncompat
    from prewarm.providers.sglang import common as sglang_env

    m, p, _ = planned
    s = sglang_env.read_spec(m.spec())
    by_kernel: dict[str, list] = {}
    for c in p.compiles:
        by_kernel.setdefault(c.kernel.split(":")[1], []).append(tritoncompat.parse_specialization(c.specialization))
    assert {"compute_position_kernel", "_fused_slot_clear_kernel", "_fused_slot_copy_kernel"} <= set(by_kernel)
    commits = {(a.args["DRAFT_WIDTH"].value, a.args["INDEX_STRIDE_0"].value, a.args["TRACK_INTERVAL"].value)
               for a in by_kernel["_verify_commit_outputs_kernel"]}
    widths = s.draft_widths
    assert {(w, w, t) for w in widths for t in (0, 256)} | {(0, d, 0) for d in range(2, max(widths) + 1)} <= commits
    planned_replays = {(a.args["BS_UPPER"].value, a.int_classes["total_bs"][1], a.int_classes["valid_bs"][1])
                       for a in by_kernel["_fused_replay_state_indices_kernel"]}
    previous = 0
    for bucket in s.graph_buckets:  # a batch of n requests replays the smallest bucket >= n, padded
        for requests in range(previous + 1, bucket + 1):
            want = (1 << (bucket - 1).bit_length(), tritoncompat.int_class(bucket), tritoncompat.int_class(requests))
            assert want in planned_replays, (bucket, requests)
        previous = bucket
