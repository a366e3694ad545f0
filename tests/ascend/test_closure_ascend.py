"""Closure on Ascend: every compile request independent, server-like traffic makes is one the plan makes.

No NPU and no CANN here, so no cache to look in: the comparison is request by request, between what triton-ascend's
JIT (bound for the manifest's arch by the target-only driver) asks to compile for traffic drawn by
``prewarm_kernels.kda.traffic`` (never the planner's provider) and for the manifest's plan. A request is Triton's
specialization data (signature, constexprs, pointer divisibility, options); the cache key `prewarm lower` computes
is a function of it. A refused call (a call a server makes that the API rejects) fails too. Seeds as in
tests/test_closure.py: fixed ones plus a fresh one, or PREWARM_CLOSURE_SEED.
"""
from __future__ import annotations

import pytest
from closure_traffic import failure_report, planned_compiles, run_traffic, seeds
from conftest import REPO

from prewarm import npu
from prewarm.manifest import load

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3.toml"
CALLS_PER_SEED = 125  # x 4 seeds: 500 calls


@pytest.fixture(scope="module")
def manifest():
    m = load(MANIFEST)
    npu.activate_offline(m.arch)  # before the kernels are imported: triton 3.2 binds @autotune to the driver
    return m


@pytest.fixture(scope="module")
def planned(manifest) -> set[str]:
    return {c.specialization for c in planned_compiles(manifest)}


@pytest.mark.parametrize("seed", seeds(), ids=lambda s: f"seed{s}")
def test_independent_traffic_makes_only_planned_requests(manifest, planned, seed):
    npu.activate_offline(manifest.arch)
    t = run_traffic(manifest, seed, CALLS_PER_SEED)
    missed = [c for data, c in t.compiles.items() if data not in planned]
    if missed or t.refused:
        pytest.fail(failure_report(manifest, seed, t, missed), pytrace=False)
    assert t.launches > CALLS_PER_SEED  # the traffic reached the kernels
