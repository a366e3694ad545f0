"""sglang 0.5.23's serving path around the CUDA KDA layer, planned by ``prewarm.providers.sglang.cuda`` for the
shipped H200 manifest, checked against independent traffic (``tests/traffic/sglang_graph.py``: written from sglang's
CUDA graph runner, model runner, Kimi-Linear's model and the EAGLE worker, not from the provider) run through
sglang's own code on fake tensors: CUDA-graph capture and replay of decode and target verify (chain and tree, every
bucket and every padding of it), the fused projection's views in verify as in extend and decode, the mamba pool's
slot clear / copy, extend positions and the EAGLE verify commit. Every compile request the traffic makes has its
key in the plan (the key Triton computes, the one a node's runtime looks up).
"""
from __future__ import annotations

from collections import Counter

import pytest

from test_sglang import MANIFEST, runtime_compiles
from test_sglang_layer import planned  # noqa: F401  (the module's fixture: the shipped manifest's plan)
from prewarm.building.probe import planned_keys
from traffic import sglang_graph
from traffic.closure import fresh_seed

CALLS_PER_SEED = 400  # four kinds: each graph kind sees its 64 batch sizes (a permutation) in about 256 calls
# the kernels sglang launches around the layer for these batches: the replay metadata, the mamba pool's slot ops,
# extend positions, the EAGLE commit
AROUND_LAYER = {"_fused_replay_state_indices_kernel", "_fused_slot_copy_kernel", "_fused_slot_clear_kernel",
                "compute_position_kernel", "_verify_commit_outputs_kernel"}


def test_the_plan_holds_the_kernels_around_the_layer(planned):  # noqa: F811
    _, p, _ = planned
    assert AROUND_LAYER <= {c.kernel.split(":")[1] for c in p.compiles}


@pytest.mark.parametrize("seed", [5, fresh_seed()], ids=lambda s: f"seed{s}")
def test_graph_traffic_requests_nothing_the_plan_lacks(planned, seed):  # noqa: F811
    m, _, keys = planned
    calls = list(sglang_graph.calls(m.spec(), seed, CALLS_PER_SEED, "cuda"))
    compiles, _ = runtime_compiles(m.spec(), calls)
    drawn = [c.options for c in calls]
    buckets = sglang_graph.capture_buckets(m.spec())
    assert {d["kind"] for d in drawn} == {"extend", "graph_decode", "graph_verify", "target_verify"}
    for kind in ("graph_decode", "graph_verify"):  # every batch size up to the largest bucket, so every padding
        assert {d["batch"] for d in drawn if d["kind"] == kind} == set(range(1, buckets[-1] + 1)), kind
    assert {(d["width"], d["tree"]) for d in drawn if d["kind"] == "graph_verify"} == \
        {(w, t) for w in (2, 3, 4) for t in (False, True)}
    assert AROUND_LAYER <= {c.kernel.split(":")[1] for c in compiles.values()}
    missing = [c for key, c in planned_keys(list(compiles.values())).items() if key not in keys]
    by_kernel = Counter(c.kernel.split(":")[1] for c in missing)
    assert not missing, (f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missing)} of {len(compiles)} "
                         f"compile requests not planned, by kernel: {dict(by_kernel.most_common())}; e.g.\n"
                         + "\n".join(sorted({c.label.split('[')[0] + ' -> ' + c.kernel.split(':')[1]
                                             for c in missing})[:20]))
