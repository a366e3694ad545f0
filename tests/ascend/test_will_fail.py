"""Will-fail on the deployment's own manifest: the shipped K3 sglang manifest with decode and verify planned (where
its [spec.sglang] paths narrow them away, extended by them) names sglang 0.5.23's recurrent kernel, which this
triton-ascend cannot key, through the real `prewarm plan` and `prewarm lower` (exit 12): kernel, file:line, reason,
what the node does, the fix and every request reaching it; nothing else is set apart, everything else lowers."""
from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run_prewarm

from prewarm import devices

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan, resolve

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml"
RECURRENT = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent:"
             "fused_sigmoid_gating_delta_rule_update_kernel")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """The shipped manifest; where its [spec.sglang] paths narrow the paths planned (all by default), a copy with
    them extended by decode and target_verify (its autotune table still the shipped one)."""
    text = MANIFEST.read_text()
    paths = re.search(r'^paths = \[(.*)\]$', text, re.M)
    if not paths:
        return MANIFEST
    listed = json.loads(f"[{paths.group(1)}]")
    wanted = listed + [p for p in ("decode", "target_verify") if p not in listed]
    text = text.replace(paths.group(0), f"paths = {json.dumps(wanted)}")
    text = re.sub(r'^tuned = "(.*?)"', lambda t: f"tuned = {json.dumps(str(MANIFEST.parent / t.group(1)))}", text,
                  flags=re.M)
    path = tmp_path_factory.mktemp("k3") / "k3.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def provider_requests(manifest, request):
    """What the provider plans (in this process, under the A3 profile): every request, keyable or not (the shipped
    manifest's from conftest's session plan, each will-fail kernel's requests in plan order)."""
    if manifest == MANIFEST:
        _, p = request.getfixturevalue("sglang_k3")
        yield [*p.requests, *(r for w in p.will_fail for r in w.requests)]
        return
    m = load(manifest)
    try:
        get_target("npu", m.arch, "offline", "A3").activate()
        yield plan(m).requests
    finally:
        devices.deactivate()


def unkeyable(kernel: str) -> bool:
    """Does this triton-ascend's own key computation of ``kernel`` raise?"""
    try:
        tritoncompat.jit_function(resolve(kernel)).cache_key  # noqa: B018
    except Exception:  # noqa: BLE001
        return True
    return False


def recurrent_def() -> tuple[str, int]:
    from sglang.kernels.ops.attention.linear import fused_sigmoid_gating_recurrent as module

    lines = open(module.__file__).read().splitlines()
    return module.__file__, next(i for i, t in enumerate(lines, 1)
                                 if t.startswith("def fused_sigmoid_gating_delta_rule_update_kernel("))


def test_plan_names_the_recurrent_kernel_as_will_fail(manifest, provider_requests):
    done = run_prewarm("plan", manifest, "--json")
    assert done.returncode == 12, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    planned_kernels = {r.kernel for r in provider_requests}
    assert RECURRENT in planned_kernels and unkeyable(RECURRENT)
    # exactly the planned kernels this triton-ascend cannot key, each with every request reaching it: none dropped
    assert {w["kernel"] for w in doc["will_fail"]} == {k for k in planned_kernels if unkeyable(k)}
    by_kernel = {w["kernel"]: w for w in doc["will_fail"]}
    listed = [r["label"] for r in doc["requests"]] + [label for w in doc["will_fail"] for label in w["labels"]]
    assert sorted(listed) == sorted(r.label for r in provider_requests)
    w = by_kernel[RECURRENT]
    assert w["labels"] == [r.label for r in provider_requests if r.kernel == RECURRENT] != []
    assert (w["file"], w["line"]) == recurrent_def()
    assert (w["triton"], w["error"]) == ("triton-ascend 3.2.0", "AttributeError")
    assert w["reason"] == "module 'triton.language.extra' has no attribute 'cuda'"
    assert w["node"].endswith(f"the server crashes at its first {w['labels'][0]!r}")
    assert re.fullmatch(r"a triton-ascend whose triton\.language\.extra has cuda \(the kernel's source names "
                        r"tl\.extra\.cuda\.gdc_wait \(line \d+\), tl\.extra\.cuda\.gdc_launch_dependents \(line \d+\)\), "
                        r"or a kernel source without it", w["fix"]), w["fix"]


def test_lower_lowers_everything_else_and_names_the_recurrent_kernel(manifest):
    done = run_prewarm("lower", manifest)
    assert done.returncode == 12, done.stdout[-3000:] + done.stderr[-3000:]
    file, line = recurrent_def()
    assert (f"will-fail {RECURRENT} ({file}:{line}): triton-ascend 3.2.0 cannot key it: AttributeError: module "
            f"'triton.language.extra' has no attribute 'cuda'") in done.stdout
    lowered = re.search(r"^(\d+) of (\d+) compiles \(\d+ requests\) lowered to linalg, \d+ kernels will fail",
                        done.stdout, re.M)
    assert lowered and lowered.group(1) == lowered.group(2) != "0", done.stdout[-2000:]
    assert re.match(r"error: \d+ planned kernel\(s\) cannot be keyed by this Triton", done.stderr.splitlines()[-1])
    assert f"{RECURRENT} ({file}:{line})" in done.stderr
