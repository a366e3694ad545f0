"""The EAGLE worker's kernels (``prewarm.providers.sglang.model_spec_worker``) as the shipped H200 sglang manifest plans
them: every kernel the component's coverage entry says it plans is launched, at the deployment's widths (the chain
tree's req_to_token pitch follows the context length and each draft width; the chain draft's argmax writes every
inner step's column), a tree's kernels only where the deployment runs trees, and a missing or bad width is named.
Independent traffic (written from sglang's worker, not from this module) is ``tests/traffic``'s."""
from __future__ import annotations

import copy
from collections import defaultdict

import pytest

from prewarm.building import backends, tritoncompat
from prewarm.planning.manifest import load
from prewarm.providers.capture import launches_of
from prewarm.providers.sglang import model_spec_worker
from prewarm.providers.sglang.common import fake_device, published_parallel, read_spec
from prewarm_kernels.spec import SpecError
from test_sglang import MANIFEST

TREE_ONLY = {"assign_extend_cache_locs", "assign_extend_cache_locs_uniform", "fill_accept_out_cache_loc",
             "_draft_extend_inputs_kernel"}


@pytest.fixture(scope="module", autouse=True)
def h200():
    """Device queries answer as the manifest's H200 (sglang's kernel modules read the platform at import: on a
    machine with no GPU they would take their CPU / NPU paths), as ``prewarm plan`` has them."""
    backends.activate_for_planning(load(MANIFEST))


def _spec(**changes) -> dict:
    spec = copy.deepcopy(load(MANIFEST).spec())
    for key, value in changes.items():  # "eagle_tree" ([spec.sglang]) or "model.<key>" ([spec.sglang.model])
        *model, name = key.split(".")
        target = spec["sglang"]["model"] if model else spec["sglang"]
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value
    return spec


def _launches(spec: dict) -> dict[str, list]:
    s = read_spec(spec)
    out = defaultdict(list)
    with published_parallel(s), fake_device(s.device):
        for label, call in model_spec_worker.calls(spec, s, s.device):
            for launch in launches_of(call):
                launch.label = label
                out[tritoncompat.jit_function(launch.kernel).fn.__name__].append(launch)
    return out


@pytest.fixture(scope="module")
def shipped(h200):
    spec = _spec()
    return spec, _launches(spec)


def test_every_kernel_the_component_says_it_plans_is_launched(shipped):
    spec, launches = shipped
    entry = model_spec_worker.coverage(spec)
    planned = {k.split(":")[1] for k in entry["planned"]} - {"_verify_commit_outputs_kernel"}  # the KDA provider's
    assert planned == set(launches), (planned ^ set(launches))
    assert all(item["why"] for item in entry["not_planned"])


def test_the_cache_location_kernels_take_req_to_tokens_pitch_per_draft_width(shipped):
    """``req_to_token``'s row pitch is a constexpr of the chain tree and of the draft / tree-verify cache locations:
    context length + 4 + the draft width, one variant per launch line's width (2, 3, 4 in the shipped manifest); the
    chain tree with int32 and int64 bonus tokens."""
    spec, launches = shipped
    widths = {spec["sglang"]["model"]["context_length"] + 4 + w for w in spec["serving"]["draft_widths"]}
    assert {launch.kwargs["TABLE_ROW"] for launch in launches["_build_chain_tree_kernel"]} == widths
    for kernel in ("assign_draft_cache_locs_contiguous", "assign_extend_cache_locs_uniform"):
        assert {launch.args[4] for launch in launches[kernel]} == widths, kernel
    assert {str(launch.args[0].dtype) for launch in launches["_build_chain_tree_kernel"]} == {"torch.int32",
                                                                                              "torch.int64"}


def test_the_chain_draft_writes_every_inner_steps_column(shipped):
    """``draft_forward`` writes column i + 1 of the draft tokens at inner step i: 1 .. width - 2 per chain."""
    spec, launches = shipped
    columns = {launch.args[7] for launch in launches["_draft_topk1_finalize_kernel"]}
    assert columns == set(range(1, max(spec["serving"]["draft_widths"]) - 1))


def test_every_batch_size_class_and_graph_bucket_is_drawn(shipped):
    spec, launches = shipped
    sizes = {int(launch.label.rsplit("B=", 1)[1].rstrip("]")) for launch in launches["_build_chain_tree_kernel"]}
    assert set(spec["serving"]["decode_batch_buckets"]) <= sizes
    assert {1, 2, 3, spec["serving"]["max_running_requests"]} <= sizes


def test_a_chain_only_deployment_plans_no_tree_kernels():
    spec = _spec(eagle_tree=False)
    launches = _launches(spec)
    assert not TREE_ONLY & set(launches)
    assert not TREE_ONLY & {k.split(":")[1] for k in model_spec_worker.coverage(spec)["planned"]}


def test_a_missing_width_is_named_in_coverage_and_its_kernels_not_launched():
    spec = _spec(**{"model.context_length": None})
    pitched = {"_build_chain_tree_kernel", "assign_draft_cache_locs_contiguous", "assign_extend_cache_locs_uniform"}
    assert not pitched & set(_launches(spec))
    named = {i["what"].split(":")[1] for i in model_spec_worker.coverage(spec)["not_planned"]
             if "context_length" in i["why"]}
    assert named == pitched


def test_a_bad_width_is_a_spec_error_naming_the_key():
    spec = _spec(**{"model.context_length": "1M"})
    s = read_spec(spec)
    with pytest.raises(SpecError, match="sglang.model.context_length"):
        list(model_spec_worker.calls(spec, s, s.device))
