"""Closure: every compile request that independent, server-like traffic makes is in the cache `prewarm build` made.

For every shipped CUDA manifest, the real `prewarm build --mode offline` fills a cache once per session; then calls
drawn by ``prewarm_kernels.kda.traffic`` (written without the planner's provider) run through the public API on
``meta`` tensors, each launch is expanded into the requests Triton's JIT makes for it, and each request is looked up
in that cache through Triton's own key computation (will-hit's probe): a miss is a compile a serving process would
make. A refused call is a call a server makes that the API rejects. Both fail the test, each miss with the nearest
planned request and what differs. So does an autotuned launch whose tuning key the plan does not make (the node would
benchmark it: no table can cover a key the plan never computed). Seeds: fixed ones plus one never used before
(random, shown in the test id), or ``PREWARM_CLOSURE_SEED=<n>`` to run another.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from traffic.closure import failure_report, run_traffic, seeds

from prewarm.building.autotune import planned_tunings
from prewarm.planning.manifest import load
from prewarm.building.backends import get_target
from prewarm.planning.plan import plan
from prewarm.building.probe import probe_all

REPO = Path(__file__).resolve().parents[1]
# the shipped CUDA manifests that serve this package's KDA kernels (the traffic calls their public API)
CUDA_MANIFESTS = [p for p in sorted((REPO / "manifests").glob("*.toml")) if not p.name.endswith(".tuned.toml")
                  and load(p).backend == "cuda" and any(k.ref == "prewarm_kernels.kda.serving" for k in load(p).kernels)]
CALLS_PER_SEED = 150  # x 4 seeds per manifest: >= 500 calls per CI run


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory):
    """The cache dir `prewarm build <manifest> --mode offline` made, built once per manifest and session."""
    built: dict[Path, Path] = {}

    def get(manifest: Path) -> Path:
        if manifest not in built:
            out = tmp_path_factory.mktemp(f"closure-{manifest.stem}") / "cache"
            p = subprocess.run([sys.executable, "-m", "prewarm.cli", "build", str(manifest), "--mode", "offline",
                                "--cache-dir", str(out)], capture_output=True, text=True, cwd=REPO)
            assert p.returncode == 0, f"prewarm build {manifest.name} failed ({p.returncode}): {p.stderr[-3000:]}"
            built[manifest] = out
        return built[manifest]

    return get


@pytest.mark.parametrize("seed", seeds(), ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("manifest", CUDA_MANIFESTS, ids=lambda p: p.stem)
def test_independent_traffic_compiles_nothing_the_build_did_not(manifest, seed, built_cache):
    cache = built_cache(manifest)
    m = load(manifest)
    get_target(m.backend, m.arch, "offline").activate()
    t = run_traffic(m, seed, CALLS_PER_SEED)
    results = probe_all(list(t.compiles.values()), str(cache))
    missed = [c for c, r in zip(t.compiles.values(), results) if not r.hit]
    if missed or t.refused:
        pytest.fail(failure_report(m, seed, t, missed), pytrace=False)
    assert t.launches > CALLS_PER_SEED  # the traffic reached the kernels
    planned = {p.key for p in planned_tunings(plan(m).requests)}
    untuned = [x for x in t.tunings.values() if x.key not in planned or x.problem]
    assert not untuned, "tuning keys the plan does not make (the node would benchmark them):\n" + "\n".join(
        f"{x.label}: {x.tuning_key or x.problem}" for x in untuned[:12])
    assert t.tunings  # the traffic reached autotuned kernels


def test_traffic_outside_the_plan_is_caught_and_explained(built_cache, tmp_path):
    """The same cache under traffic of a deployment that also runs fp16 activations: the fp16 requests are found
    missing by the cache lookup and reported next to the planned bf16 ones."""
    manifest = REPO / "manifests" / "kimi-linear-h200.toml"
    cache = built_cache(manifest)
    wider = tmp_path / "wider.toml"
    wider.write_text(manifest.read_text().replace('activation = "bfloat16"', 'activation = ["bfloat16", "float16"]', 1))
    m = load(wider)
    get_target(m.backend, m.arch, "offline").activate()
    t = run_traffic(m, 0, 60)
    results = probe_all(list(t.compiles.values()), str(cache))
    missed = [c for c, r in zip(t.compiles.values(), results) if not r.hit]
    assert missed and all("qkv=fp16" in c.label for c in missed)
    assert any(r.hit for r in results)  # the bf16 calls still hit
    report = failure_report(load(manifest), 0, t, missed)
    assert "argument q: planned *bf16, runtime *fp16" in report, report
