"""explain: for a runtime request the plan lacks, the nearest planned compile and exactly what differs; requests
are Triton's own (its jit_cache_hook's specialization data, key dirs its compiler wrote), never hand-written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

import torch  # noqa: E402

from prewarm.building import tritoncompat  # noqa: E402
from prewarm.node.explain import Difference, explain, explain_key_dir, explain_miss  # noqa: E402
from prewarm.planning.plan import Compile  # noqa: E402
from prewarm.building.backends import CudaOfflineTarget  # noqa: E402
from prewarm.building.probe import planned_keys  # noqa: E402

ADD = "prewarm_toy.kernels:add_kernel"
DECODE = "prewarm_toy.kernels:decode_kernel"


def requests(*calls) -> list[str]:
    """The specialization data Triton's JIT makes for each (kernel, args, kwargs) warmup; nothing compiles."""
    from prewarm_toy import kernels

    CudaOfflineTarget("cuda", "sm_90").activate()
    with tritoncompat.compile_requests(skip=True) as captured:
        for name, args, kwargs in calls:
            kernel = kernels
            for attr in name.split("."):
                kernel = getattr(kernel, attr)
            kernel.warmup(*args, grid=(1,), **kwargs)
    assert len(captured) == len(calls)
    return captured


f32, bf16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def planned() -> list[Compile]:
    data = requests(("add_kernel", (f32, f32, f32, 4096), {"BLOCK": 256}),
                    ("add_kernel", (f32, f32, f32, 4096), {"BLOCK": 64}),
                    ("decode_kernel", (f32, f32, 3), {"HEADS": 2, "T": 8}))
    refs = [ADD, ADD, DECODE]
    return [Compile(f"r{i}", ref, f"planned #{i}", d) for i, (ref, d) in enumerate(zip(refs, data))]


def diffs(e) -> list[tuple[str, str, str, str]]:
    return [(d.kind, d.name, d.planned, d.runtime) for d in e.differences]


def test_a_different_pointer_dtype_names_the_argument_and_both_dtypes(planned):
    (runtime,) = requests(("add_kernel", (f32, bf16, f32, 4096), {"BLOCK": 64}))
    e = explain(runtime, planned)
    assert e.nearest is planned[1] and not e.planned  # BLOCK=64 is the nearer one: one field differs, not two
    assert diffs(e) == [("dtype", "y_ptr", "*fp32", "*bf16")]
    assert str(e).splitlines() == ["nearest: planned #1", "  argument y_ptr: planned *fp32, runtime *bf16"]
    assert e.to_json()["differences"] == [{"kind": "dtype", "name": "y_ptr", "planned": "*fp32", "runtime": "*bf16"}]
    assert e.to_json()["nearest"]["label"] == "planned #1"


@pytest.mark.parametrize("n, runtime_class", [(1, "== 1 (compiled in)"), (1000, "i32 not 1, not divisible by 16")])
def test_an_int_in_another_specialization_class(planned, n, runtime_class):
    (runtime,) = requests(("add_kernel", (f32, f32, f32, n), {"BLOCK": 256}))
    e = explain(runtime, planned)
    assert e.nearest is planned[0]
    assert diffs(e) == [("specialization", "n", "i32 divisible by 16", runtime_class)]


def test_constexpr_values_and_compile_options_are_named(planned):
    (runtime,) = requests(("add_kernel", (f32, f32, f32, 4096), {"BLOCK": 128, "num_warps": 8, "num_stages": 2}))
    e = explain(runtime, planned)
    assert diffs(e) == [("constexpr", "BLOCK", "= 256", "= 128"), ("option", "num_warps", "4", "8"),
                        ("option", "num_stages", "3", "2")]


def test_a_planned_request_is_planned_whatever_the_unspecialized_values(planned):
    # decode_kernel does not specialize n: another value is the very same request
    (runtime,) = requests(("decode_kernel", (f32, f32, 17), {"HEADS": 2, "T": 8}))
    e = explain(runtime, planned)
    assert e.planned and e.nearest is planned[2] and e.differences == ()
    assert str(e) == "planned: planned #2"


def test_a_kernel_the_plan_never_compiles_has_no_nearest(planned):
    (runtime,) = requests(("gain_kernel.fn", (f32, f32, 4096, 2.0), {"BLOCK": 64}))
    e = explain(runtime, planned)
    assert e.nearest is None and not e.planned
    assert str(e) == "no planned compile of prewarm_toy.kernels.gain_kernel"
    assert e.to_json()["nearest"] is None


def test_env_vars_are_compared_when_both_sides_are_known(planned):
    (runtime,) = requests(("add_kernel", (f32, f32, f32, 4096), {"BLOCK": 64}))
    e = explain(runtime, planned, runtime_env={"TRITON_DISABLE_LINE_INFO": "1"}, planned_env={})
    assert diffs(e) == [("env", "TRITON_DISABLE_LINE_INFO", "unset", "1")]


def compile_in_fresh_process(cache_dir: Path, code: str, env: dict | None = None) -> None:
    """Real compiles into ``cache_dir`` by a fresh process (the runtime's JIT, a target-only driver)."""
    script = ("import sys, torch\nfrom prewarm.building.backends import CudaOfflineTarget\n"
              "from prewarm_toy.kernels import add_kernel, decode_kernel\n"
              "CudaOfflineTarget('cuda', 'sm_90').activate()\n" + code)
    env = {**os.environ, **(env or {}), "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(FIXTURES)}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_key_dir_the_runtime_wrote_is_explained_and_says_what_it_cannot_know(planned, tmp_path):
    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 1000, "
                                       "BLOCK=64, grid=(1,))")
    (key_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    e = explain_key_dir(key_dir, planned, planned_keys(planned))
    assert e.nearest is planned[0]  # BLOCK is not recorded in a key dir: the first of the equally near ones
    assert diffs(e) == [("dtype", "y_ptr", "*fp32", "*bf16"),
                        ("specialization", "n", "i32 divisible by 16", "i32 not 1, not divisible by 16")]
    assert "constexpr values" in e.note and "not recorded" in e.note


def test_a_key_dir_is_planned_exactly_when_triton_computes_its_key_for_a_planned_compile(planned, tmp_path):
    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.float32, torch.float32, 4096, "
                                       "BLOCK=64, grid=(1,))\n"
                                       "add_kernel.warmup(torch.float32, torch.float32, torch.float32, 4096, "
                                       "BLOCK=128, grid=(1,))")
    keys = planned_keys(planned)
    found = {d.name: explain_key_dir(d, planned, keys) for d in tmp_path.iterdir() if d.is_dir()}
    (hit,) = [e for e in found.values() if e.planned]
    assert hit.nearest is planned[1]  # BLOCK=64: the key dir's name is the key Triton computes for it here
    (other,) = [e for e in found.values() if not e.planned]  # BLOCK=128: the same in every recorded field
    assert [d.kind for d in other.differences] == ["key"]
    assert other.differences[0].planned == next(k for k, c in keys.items() if c is other.nearest)


def test_a_planned_compile_missing_from_a_cache_is_explained_against_the_cache(planned, tmp_path):
    """verify's MISS rows: the cache's nearest entry of that kernel; here the node sets an env var of Triton's key
    that the build did not, and the fp32 y_ptr variant was never built."""
    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 4096, "
                                       "BLOCK=64, grid=(1,))")
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    try:
        e = explain_miss(planned[1], tmp_path, "KEY")
    finally:
        del os.environ["TRITON_DISABLE_LINE_INFO"]
    assert e.nearest.key == next(d.name for d in tmp_path.iterdir())
    assert diffs(e) == [("dtype", "y_ptr", "*bf16", "*fp32"), ("env", "TRITON_DISABLE_LINE_INFO", "unset", "true")]
    assert str(e).splitlines()[1:] == ["  argument y_ptr: cache *bf16, planned *fp32",
                                       "  env var TRITON_DISABLE_LINE_INFO: cache unset, this process true"]
    assert explain_miss(planned[2], tmp_path, "KEY").nearest is None  # no decode_kernel at all in that cache
    assert "holds no compile of decode_kernel" in explain_miss(planned[2], tmp_path, "KEY").note


def test_difference_is_a_value():
    d = Difference("dtype", "beta", "*fp32", "*bf16")
    assert str(d) == "argument beta: planned *fp32, runtime *bf16"
    assert json.loads(json.dumps(d.to_json())) == {"kind": "dtype", "name": "beta", "planned": "*fp32",
                                                    "runtime": "*bf16"}


TOY = FIXTURES / "toy-cuda.toml"


def cli(*args: str, check: int) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(FIXTURES), "COLUMNS": "200"})
    assert p.returncode == check, f"exit {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def test_explain_cli_on_a_recorded_run(tmp_path):
    """`prewarm record` of a process making one planned and one unplanned call; `prewarm explain` names the
    unplanned one's differing argument and exits 5 (a compile the plan lacks), with the same in --json."""
    code = ("import torch\nfrom prewarm.building.backends import CudaOfflineTarget\n"
            "from prewarm_toy.kernels import add_kernel\nCudaOfflineTarget('cuda', 'sm_90').activate()\n"
            "for y in (torch.float32, torch.bfloat16):\n"
            "    add_kernel.warmup(torch.float32, y, torch.float32, 1000, BLOCK=64, num_warps=4, grid=(1,))\n")
    rec = tmp_path / "calls.jsonl"
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "record", "-o", rec, "--", sys.executable, "-c", code],
                       env={**os.environ, "PYTHONPATH": str(FIXTURES), "TRITON_CACHE_DIR": str(tmp_path / "rt")},
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    human = cli("explain", rec, "--plan", TOY, check=5).stdout
    assert "planned     add_kernel [BLOCK=64 warps=4 stages=3] = third-party add BLOCK=64" in human
    assert "NOT PLANNED add_kernel [BLOCK=64 warps=4 stages=3]" in human
    assert "argument y_ptr: planned *fp32, runtime *bf16" in human
    assert "2 runtime requests: 1 planned, 1 not planned" in human
    doc = json.loads(cli("explain", rec, "--plan", TOY, "--json", check=5).stdout)
    assert (doc["planned"], doc["not_planned"], doc["exit_code"]) == (1, 1, 5)
    assert doc["requests"][1]["differences"] == [{"kind": "dtype", "name": "y_ptr", "planned": "*fp32",
                                                  "runtime": "*bf16"}]
    # the runtime's own cache dir, key dir by key dir: the same verdicts from what Triton stored
    doc = json.loads(cli("explain", tmp_path / "rt", "--plan", TOY, "--json", check=5).stdout)
    assert sorted(r["planned"] for r in doc["requests"]) == [False, True]
    (miss,) = [r for r in doc["requests"] if not r["planned"]]
    assert {"kind": "dtype", "name": "y_ptr", "planned": "*fp32", "runtime": "*bf16"} in miss["differences"]
    # a planned-only record exits 0
    (rec.parent / "ok.jsonl").write_text(rec.read_text().splitlines()[0] + "\n")
    assert "1 runtime requests: 1 planned, 0 not planned" in cli("explain", rec.parent / "ok.jsonl", "--plan", TOY,
                                                                 check=0).stdout


def test_explain_cli_refuses_what_is_not_a_runtime_request(tmp_path):
    (tmp_path / "bad.jsonl").write_text("not json\n")
    p = cli("explain", tmp_path / "bad.jsonl", "--plan", TOY, check=3)
    assert "bad.jsonl:1" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "empty").mkdir()
    p = cli("explain", tmp_path / "empty", "--plan", TOY, check=3)
    assert "no Triton kernel entry" in p.stderr


def test_verify_explains_each_miss_against_the_cache(tmp_path):
    """The cache holds the bf16-y variant of the manifest's third-party add: verify's MISS row for the planned fp32
    one names that entry and the argument (detail and --json); kernels absent from the cache say so."""
    from prewarm.node.willhit import check

    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 1000, "
                                       "BLOCK=64, num_warps=4, grid=(1,))")
    report = check(str(TOY), str(tmp_path))
    (row,) = [r for r in report.results if r.label == "third-party add BLOCK=64"]
    assert not row.hit and "argument y_ptr: cache *bf16, planned *fp32" in row.detail
    doc = next(r for r in report.to_json()["results"] if r["label"] == "third-party add BLOCK=64")
    assert doc["explanation"]["differences"] == [{"kind": "dtype", "name": "y_ptr", "cache": "*bf16",
                                                  "planned": "*fp32"}]
    assert doc["explanation"]["nearest"]["key"] in {d.name for d in tmp_path.iterdir()}
    (decode, *_) = [r for r in report.results if r.kernel.endswith("decode_kernel")]
    assert "no cached compile of prewarm_toy.kernels.decode_kernel" in decode.detail
