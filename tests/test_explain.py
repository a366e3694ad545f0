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

from prewarm import tritoncompat  # noqa: E402
from prewarm.explain import Difference, explain, explain_key_dir, explain_miss  # noqa: E402
from prewarm.plan import Compile  # noqa: E402
from prewarm.targets import CudaOfflineTarget  # noqa: E402

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
    script = ("import sys, torch\nfrom prewarm.targets import CudaOfflineTarget\n"
              "from prewarm_toy.kernels import add_kernel, decode_kernel\n"
              "CudaOfflineTarget('cuda', 'sm_90').activate()\n" + code)
    env = {**os.environ, **(env or {}), "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(FIXTURES)}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_key_dir_the_runtime_wrote_is_explained_and_says_what_it_cannot_know(planned, tmp_path):
    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 1000, "
                                       "BLOCK=64, grid=(1,))")
    (key_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    e = explain_key_dir(key_dir, planned)
    assert e.nearest is planned[0]  # BLOCK is not recorded in a key dir: the first of the equally near ones
    assert diffs(e) == [("dtype", "y_ptr", "*fp32", "*bf16"),
                        ("specialization", "n", "i32 divisible by 16", "i32 not 1, not divisible by 16")]
    assert "constexpr values" in e.note and "not recorded" in e.note


def test_a_planned_compile_missing_from_a_cache_is_explained_against_the_cache(planned, tmp_path):
    """verify's MISS rows: the cache's nearest entry of that kernel; here the node sets an env var of Triton's key
    that the build did not, and the fp32 y_ptr variant was never built."""
    compile_in_fresh_process(tmp_path, "add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 4096, "
                                       "BLOCK=64, grid=(1,))")
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    try:
        e = explain_miss(planned[1], tmp_path)
    finally:
        del os.environ["TRITON_DISABLE_LINE_INFO"]
    assert e.nearest.key == next(d.name for d in tmp_path.iterdir())
    assert diffs(e) == [("dtype", "y_ptr", "*bf16", "*fp32"), ("env", "TRITON_DISABLE_LINE_INFO", "unset", "true")]
    assert str(e).splitlines()[1:] == ["  argument y_ptr: cache *bf16, planned *fp32",
                                       "  env var TRITON_DISABLE_LINE_INFO: cache unset, planned true"]
    assert explain_miss(planned[2], tmp_path).nearest is None  # no decode_kernel at all in that cache
    assert "holds no compile of decode_kernel" in explain_miss(planned[2], tmp_path).note


def test_difference_is_a_value():
    d = Difference("dtype", "beta", "*fp32", "*bf16")
    assert str(d) == "argument beta: planned *fp32, runtime *bf16"
    assert json.loads(json.dumps(d.to_json())) == {"kind": "dtype", "name": "beta", "planned": "*fp32",
                                                    "runtime": "*bf16"}
