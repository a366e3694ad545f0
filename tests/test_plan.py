"""Plan: deterministic, deduplicated requests from providers, third-party functions and record files; expansion
into Triton's own compile requests (one per autotune config) through the real JIT path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.cli import main  # noqa: E402
from prewarm.errors import ManifestError  # noqa: E402
from prewarm.planning.manifest import load  # noqa: E402
from prewarm.planning.plan import describe_specialization, expand, plan  # noqa: E402
from prewarm.building.tritoncompat import parse_specialization  # noqa: E402
from prewarm.building.backends import get_target  # noqa: E402

TOY = FIXTURES / "toy-cuda.toml"


@pytest.fixture(scope="module")
def toy_plan():
    get_target("cuda", "sm_90", "offline").activate()
    return plan(load(TOY))


def test_requests_follow_the_serving_mix(toy_plan):
    labels = [r.label for r in toy_plan.requests]
    assert labels == ["prefill add", "prefill scale", "prefill relu", "decode bs=1", "decode bs=2", "decode bs=4",
                      "third-party add BLOCK=64", "third-party add BLOCK=256"]
    decode = toy_plan.requests[3]
    # heads per rank (8 / TP 2) reach the provider; tensors keep dtype and shape only
    assert decode.kernel == "prewarm_toy.kernels:decode_kernel"
    assert decode.args[0] == {"tensor": "float32", "shape": [4]} and decode.kwargs == {"HEADS": 4, "T": 1}
    third = toy_plan.requests[6]
    assert third.kwargs["x_ptr"] == {"tensor": "float32", "shape": [1]} and third.kwargs["num_warps"] == 4


def test_plan_is_deterministic_across_processes(toy_plan):
    code = "import json,sys; from prewarm.planning.manifest import load; from prewarm.planning.plan import plan; " \
           f"print(json.dumps(plan(load({str(TOY)!r})).to_json(), sort_keys=True))"
    env_path = f"{FIXTURES}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": env_path}).stdout
    assert json.loads(out) == json.loads(json.dumps(toy_plan.to_json(), sort_keys=True))


def test_duplicates_are_dropped(tmp_path):
    text = TOY.read_text() + '\n[[kernels]]\nprovider = "prewarm_toy.provider"\nlabel = "again"\n'
    path = tmp_path / "dup.toml"
    path.write_text(text)
    assert [r.ident for r in plan(load(path)).requests] == [r.ident for r in plan(load(TOY)).requests]


def test_expand_autotune_and_heuristics_into_every_config(toy_plan):
    by_label = {r.label: r for r in toy_plan.requests}
    scale = expand(by_label["prefill scale"])
    assert [c.label for c in scale] == [
        "prefill scale [BLOCK=32 warps=1 stages=3]",
        "prefill scale [BLOCK=64 warps=2 stages=3]",
        "prefill scale [BLOCK=128 warps=4 stages=3]",
    ]
    relu = expand(by_label["prefill relu"])  # heuristics over autotune: EVEN computed, both configs compiled
    assert [c.label for c in relu] == ["prefill relu [EVEN=True BLOCK=64 warps=2 stages=3]",
                                       "prefill relu [EVEN=True BLOCK=64 warps=4 stages=3]"]
    (decode,) = expand(by_label["decode bs=4"])
    data = json.loads(decode.specialization)
    assert data["name"] == "prewarm_toy.kernels.decode_kernel" and decode.label == "decode bs=4"
    assert describe_specialization(parse_specialization(decode.specialization)) == "HEADS=4 T=4 warps=4 stages=3"


def test_plan_cli_json_and_table(capsys):
    assert main(["plan", str(TOY), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["manifest"]["name"] == "toy-cuda" and len(doc["requests"]) == 8
    assert doc["spec"]["heads"] == 4
    assert main(["plan", str(TOY)]) == 0
    assert "decode bs=4" in capsys.readouterr().out
    assert main(["plan", str(TOY), "--compiles", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["compiles"]) == 11 and doc["target_mode"] == "offline"
    assert [c["label"] for c in doc["compiles"]][1] == "prefill scale [BLOCK=32 warps=1 stages=3]"


def test_provider_that_cannot_be_imported(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TOY.read_text().replace("prewarm_toy.provider", "prewarm_toy.nope"))
    with pytest.raises(ManifestError, match=r"kernels\[0\]\.provider = 'prewarm_toy.nope': cannot import it"):
        plan(load(path))


def test_function_with_unknown_parameter(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TOY.read_text().replace("n = 1000", "nn = 1000"))
    with pytest.raises(ManifestError, match=r"kernels\[1\]\.args\.nn: the kernel has no such parameter"):
        plan(load(path))


def test_record_lines_from_main_or_garbage_are_errors(tmp_path):
    rec = tmp_path / "r.jsonl"
    rec.write_text("not json\n")
    path = tmp_path / "m.toml"
    path.write_text(TOY.read_text() + '\n[[kernels]]\nrecord = "r.jsonl"\n')
    with pytest.raises(ManifestError, match=r"r.jsonl:1: .*expected a JSON object"):
        plan(load(path))
    rec.write_text(json.dumps({"kernel": "__main__:k", "specialization_data": json.dumps({"name": "k"})}) + "\n")
    with pytest.raises(ManifestError, match=r"r.jsonl:1: kernel __main__:k .* importable module"):
        plan(load(path))


def test_labels_read_both_specialization_formats():
    """triton 3.2 (triton-ascend) keys constants by name; 3.4+ by argument path."""
    v32 = {"name": "k", "signature": {"x": "*fp32", "T": "constexpr"}, "constants": {"T": 16},
           "options": {"num_warps": 4, "num_stages": 2}}
    v36 = {"name": "m.k", "signature": {"x": "*fp32", "T": "constexpr"}, "constant_keys": [[1]],
           "constant_vals": [16], "options": {"num_warps": 4, "num_stages": 2}}
    assert describe_specialization(parse_specialization(json.dumps(v32))) == \
        describe_specialization(parse_specialization(json.dumps(v36))) == \
        "T=16 warps=4 stages=2"


def test_plan_table_shows_the_kda_labels_verbatim():
    """Labels like `decode[act=bfloat16,gate=float32]/recurrent` look like rich markup: the table must print them,
    not eat them."""
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "kimi-linear-h200.toml"
    out = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", str(manifest)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "300"}, check=True).stdout
    assert "decode[act=bfloat16,gate=float32]/recurrent" in out
    assert "verify[draft=4,act=bfloat16,gate=float32]/recurrent" in out


def test_kimi_linear_h200_plan_size_follows_from_what_the_manifest_declares():
    """Requests and compiles of the shipped H200 manifest, derived rather than copied from a run. With A activation
    dtypes, G gate dtypes and D verify draft widths, the serving mix plans per activation dtype the 6 prefill
    kernels that read q/k/v (l2norm, intra_token, inter_solve, recompute, state, output), per gate dtype cumsum (it
    reads g and fp32 only), and the recurrent kernel per (activation, gate) pair for decode
    and each draft width, once per beta dtype it reads as given (B: the activation dtype and fp32). Batch sizes,
    lengths and every other argument make no variant (the wrappers' canonical form), so decode buckets do not count.
    Prefill is planned at each of the NB token buckets (no max_prefill_tokens: all of them), whose only effect is
    the prefill kernels' tuning key: the requests differ, the compiles do not. Each autotuned request compiles once
    per config."""
    from prewarm.planning.plan import expand_all
    from prewarm_kernels.backend import select
    from prewarm_kernels.kda.common import TOKEN_BUCKETS

    from prewarm_kernels.spec import read_kda

    m = load(Path(__file__).resolve().parents[1] / "manifests" / "kimi-linear-h200.toml")
    spec = read_kda(m.spec())
    A, G = len(spec["dtypes"]["activation"]), len(spec["dtypes"]["gate"])
    D = len([d for d in spec["draft_widths"] if d > 1])
    B = 2  # beta in bf16 (the activation dtype) or fp32
    assert (A, G, D) == (1, 2, 2)
    get_target(m.backend, m.arch, "offline").activate()
    planned = plan(m)
    NB = len(TOKEN_BUCKETS)
    assert len(planned.requests) == (6 * A + G) * NB + (1 + D) * A * G * B == 52
    configs = {name: len(select(name, m.backend).configs) for name in
               ("l2norm", "cumsum", "intra_token", "inter_solve", "recompute", "state", "output", "recurrent")}
    per_activation = sum(configs[n] for n in ("l2norm", "intra_token", "inter_solve", "recompute", "state", "output"))
    expected = per_activation * A + configs["cumsum"] * G + configs["recurrent"] * (1 + D) * A * G * B
    assert len(expand_all(planned.requests)) == expected == 37 + 36 + 12


def test_the_shipped_h200_table_covers_every_planned_tuning_key():
    """An offline bundle's autotune results come from the shipped table: a kernel change that moves a tuning key (a
    new argument, another config list) leaves rows unused and every node benchmarks again at its first prefill.
    When this fails, re-run `prewarm tune manifests/kimi-linear-h200.toml -o manifests/kimi-linear-h200.tuned.toml`
    on an H200."""
    from prewarm_helpers import shipped_table_statuses

    m = load(Path(__file__).resolve().parents[1] / "manifests" / "kimi-linear-h200.toml")
    get_target(m.backend, m.arch, "offline").activate()
    statuses = shipped_table_statuses(m, plan(m).requests)
    assert set(statuses) == {"in table"} and len(statuses["in table"]) == 40, statuses


def test_plan_compare_finds_any_request_compile_or_jit_difference():
    """tests/plan_compare.py (CI's check of a real install's plan against the scaffold's) says equal only when the
    plans are: a request's constexpr, a missing request, the compile count or a JIT module each make it differ."""
    from plan_compare import plan_differences

    request = {"id": "a1", "kernel": "m:k", "args": [{"tensor": "bfloat16", "shape": [4]}], "kwargs": {"BT": 64},
               "label": "extend/k"}
    base = {"requests": [request], "counts": {"compiles": 3}, "jit": [{"name": "mod"}]}
    assert plan_differences(base, json.loads(json.dumps(base))) == []
    changed = json.loads(json.dumps(base))
    changed["requests"][0]["kwargs"]["BT"] = 32
    assert plan_differences(changed, base) == ["request a1: kwargs {'BT': 32} (real) != {'BT': 64} (scaffold)"]
    assert plan_differences({**base, "requests": []}, base) == ["only in the scaffold's plan: request a1 m:k (extend/k)"]
    assert plan_differences({**base, "counts": {"compiles": 4}, "jit": []}, base) == [
        "compiles: 4 (real) != 3 (scaffold)", "JIT modules: [] (real) != ['mod'] (scaffold)"]
