"""`prewarm plan`'s per-component report (prewarm.planning.plan.coverage, the providers' optional ``coverage``
hook): each component's kernels, requests and compiles counted from the plan's own labels, what the model reaches
that it does not plan with why, a hook's claim no launch backs named; an entry without the hook is one component."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building.backends import get_target  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.planning.manifest import load  # noqa: E402
from prewarm.planning.plan import coverage, plan_for  # noqa: E402

TOY = FIXTURES / "toy-cuda.toml"


@pytest.fixture
def manifest(tmp_path):
    """The toy manifest with its provider cut into components (and the function entry kept as it is)."""
    def write(claim: bool = False) -> Path:
        text = TOY.read_text().replace('provider = "prewarm_toy.provider"', 'provider = "prewarm_toy.components"')
        if claim:
            text = text.replace("[spec]  #", "[spec]\nclaim = true  #")
        path = tmp_path / "toy-components.toml"
        path.write_text(text)
        return path

    return write


def test_components_are_counted_from_the_plan_not_from_the_hook(manifest):
    planned = plan_for(load(manifest()), get_target("cuda", "sm_90", "offline"))
    provider, function = coverage(planned)
    assert provider["provider"] == "prewarm_toy.components"
    by_name = {c["component"]: c for c in provider["components"]}
    assert list(by_name) == ["prefill", "decode", "sampler"]
    # the prefill launches' kernels; decode: one request per bucket
    assert by_name["prefill"]["kernels"] == ["prewarm_toy.kernels:add_kernel", "prewarm_toy.kernels:relu_kernel",
                                             "prewarm_toy.kernels:scale_kernel"]
    assert by_name["decode"]["kernels"] == ["prewarm_toy.kernels:decode_kernel"] and by_name["decode"]["requests"] == 3
    mine = {r.ident for r in planned.requests if r.source.endswith("prewarm_toy.components")}
    assert sum(c["compiles"] for c in provider["components"]) == sum(c.request in mine for c in planned.compiles) > 0
    assert by_name["sampler"] == {"component": "sampler", "kernels": [], "requests": 0, "compiles": 0,
                                  "will_fail": [], "unreached": [],
                                  "not_planned": [{"what": "a JIT sampling module", "why": "past Triton, not planned"}]}
    assert not any(c["unreached"] for c in provider["components"])
    # an entry without the hook (the function entry) is one component named after it, all its kernels
    assert [c["component"] for c in function["components"]] == ["prewarm_toy.kernels:add_kernel"]
    assert function["components"][0]["requests"] == 2 and function["components"][0]["not_planned"] == []


def test_a_claim_no_launch_backs_is_named(manifest):
    planned = plan_for(load(manifest(claim=True)), get_target("cuda", "sm_90", "offline"))
    decode = next(c for c in coverage(planned)[0]["components"] if c["component"] == "decode")
    assert decode["unreached"] == ["prewarm_toy.kernels:nope_kernel"]


def test_plan_prints_one_line_per_component_and_json_carries_them(manifest, capsys):
    path = manifest()
    assert main(["plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "component prewarm_toy.components prefill: 3 kernels planned," in text
    assert "component prewarm_toy.components sampler: 0 kernels planned, 0 compiles, 1 not planned" in text
    assert "  not planned a JIT sampling module: past Triton, not planned" in text
    assert main(["plan", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["provider"] for e in doc["coverage"]] == ["prewarm_toy.components", "prewarm_toy.kernels:add_kernel"]
    assert doc["coverage"][0]["components"][1]["component"] == "decode"
