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
from traffic.closure import failure_report, planned_compiles, run_traffic, seeds
from conftest import REPO

from prewarm.building.backends import npu
from prewarm.planning.manifest import load

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


def test_a_miss_is_reported_with_the_nearest_planned_request_and_what_differs(manifest, tmp_path):
    """A plan narrower than the traffic (g planned in bf16 only): each fp32-gate request is reported as a miss,
    next to the planned bf16 one, with the one argument that differs."""
    narrow = tmp_path / "narrow.toml"
    narrow.write_text(MANIFEST.read_text().replace('gate = ["bfloat16", "float32"]', 'gate = "bfloat16"', 1))
    m = load(narrow)
    planned = {c.specialization for c in planned_compiles(m)}
    t = run_traffic(manifest, 0, 40)
    missed = [c for data, c in t.compiles.items() if data not in planned]
    assert missed and all("g=fp32" in c.label for c in missed)
    report = failure_report(m, 0, t, missed)
    assert f"{len(missed)} would compile (not planned)" in report and "PREWARM_CLOSURE_SEED=0" in report
    assert "MISS x" in report and "nearest: " in report
    assert "argument g: planned *bf16, runtime *fp32" in report, report
