"""Closing recorded traffic over dtypes: a record entry's ``[kernels.close_dtypes]`` also compiles each recorded
request with the named pointer parameters in every listed dtype, so a recording made with fp32 covers the bf16 call
of the next process. Real recordings (``prewarm record``), real offline builds, Triton's own lookup (will-hit)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building import backends, tritoncompat  # noqa: E402
from prewarm.building.build import build  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import ManifestError  # noqa: E402
from prewarm.planning.manifest import load  # noqa: E402
from prewarm.planning.plan import Planned, plan, plan_for  # noqa: E402
from prewarm.node.willhit import check  # noqa: E402

# The recorded "server": the toy add kernel with every tensor in fp32, and a kernel without a y_ptr parameter.
APP = """
import torch
from prewarm.building.backends import CudaOfflineTarget
from prewarm_toy.kernels import add_kernel, decode_kernel

CudaOfflineTarget("cuda", "sm_90").activate()
add_kernel.warmup(torch.float32, torch.float32, torch.float32, 4096, BLOCK=256, grid=(1,))
decode_kernel.warmup(torch.float32, torch.float32, 8, HEADS=2, T=8, grid=(1,))
"""

TARGET = '[target]\nbackend = "cuda"\narch = "sm_90"\n'


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("close-dtypes")
    (tmp / "app.py").write_text(APP)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(FIXTURES))  # the recorded command imports the toy kernels
        env.setenv("TRITON_CACHE_DIR", str(tmp / "app-cache"))
        assert main(["record", "-o", str(tmp / "calls.jsonl"), "--", sys.executable, str(tmp / "app.py")]) == 0
    return tmp


def manifest(tmp: Path, entry: str, name: str) -> Path:
    path = tmp / name
    path.write_text(f'{TARGET}\n[[kernels]]\nrecord = "calls.jsonl"\n{entry}')
    return path


def planned(path: Path) -> Planned:
    """The manifest planned and expanded under the offline CUDA target (activated in this process)."""
    return plan_for(*backends.select(load(path), "offline"))


def compiles(path: Path) -> dict[str, list[str]]:
    """kernel name -> the labels of its planned compiles (a closed one: only its ``[closed: ...]`` part)."""
    out: dict[str, list[str]] = {}
    for c in planned(path).compiles:
        out.setdefault(c.kernel.split(":")[1], []).append(c.label.split("] ", 1)[-1])
    return out


def test_a_closed_request_is_what_triton_makes_for_the_other_dtype(recorded):
    """The added compile's specialization data is exactly Triton's own for a call with y in bf16."""
    import torch

    from prewarm_toy.kernels import add_kernel

    path = manifest(recorded, '[kernels.close_dtypes]\ny_ptr = ["bfloat16", "float32"]\n', "bf16.toml")
    closed = [c for c in planned(path).compiles if c.kernel.endswith("add_kernel")]
    assert [c.label.rsplit("[", 1)[-1] for c in closed] == ["BLOCK=256 warps=4 stages=3]", "closed: y_ptr=*bf16]"]
    with tritoncompat.compile_requests(skip=True) as captured:
        add_kernel.warmup(torch.float32, torch.bfloat16, torch.float32, 4096, BLOCK=256, grid=(1,))

    def without_key(data: str) -> dict:  # the in-memory key is not part of Triton's on-disk key
        return {k: v for k, v in json.loads(data).items() if k != "key"}

    assert without_key(closed[1].specialization) == without_key(captured[0])


def test_the_cross_product_over_named_params_only_and_with_int_classes(recorded):
    two = manifest(recorded, '[kernels.close_dtypes]\nx_ptr = "bfloat16"\ny_ptr = ["bfloat16", "float16"]\n', "2.toml")
    got = compiles(two)
    # add_kernel: x in {fp32, bf16} x y in {fp32, bf16, fp16} = 6; decode_kernel has x_ptr: fp32 and bf16
    assert len(got["add_kernel"]) == 6 and len(set(got["add_kernel"])) == 6
    assert got["decode_kernel"] == ["decode_kernel [HEADS=2 T=8 warps=4 stages=3]", "[closed: x_ptr=*bf16]"]
    # y_ptr alone: decode_kernel has no y_ptr and is left as recorded
    assert len(compiles(manifest(recorded, '[kernels.close_dtypes]\ny_ptr = "bfloat16"\n', "y.toml"))["decode_kernel"]) == 1
    # with close = ["n"]: each dtype variant in each class of n (recorded: a multiple of 16; =1; other)
    both = manifest(recorded, 'close = ["n"]\n[kernels.close_dtypes]\ny_ptr = "bfloat16"\n', "both.toml")
    assert compiles(both)["add_kernel"] == [
        "add_kernel [BLOCK=256 warps=4 stages=3]", "[closed: y_ptr=*bf16]", "[closed: n=1]", "[closed: n other]",
        "[closed: y_ptr=*bf16 n=1]", "[closed: y_ptr=*bf16 n other]"]


def test_a_bf16_call_hits_only_when_closed(recorded):
    """Recorded in fp32; the next process calls with y in bf16 (a function entry: Triton specializes a real bf16
    argument, not the closing code's rewrite). Without close_dtypes that call would compile; with it, it hits."""
    call = recorded / "bf16-call.toml"
    call.write_text(TARGET + '\n[[kernels]]\nfunction = "prewarm_toy.kernels:add_kernel"\n'
                    'args = { x_ptr = { tensor = "float32" }, y_ptr = { tensor = "bfloat16" }, '
                    'out_ptr = { tensor = "float32" }, n = 4096, BLOCK = 256 }\n')
    cache = recorded / "cache"
    plain = build(manifest(recorded, "", "plain.toml"), cache, workers=1, mode="offline")
    assert plain.ok and plain.count("compiled") == 2
    before = check(str(call), str(cache))
    assert not before.ok and [r.hit for r in before.results] == [False]
    closed = build(manifest(recorded, '[kernels.close_dtypes]\ny_ptr = ["bfloat16"]\n', "closed.toml"), cache,
                   workers=1, mode="offline")
    assert closed.ok and (closed.count("present"), closed.count("compiled")) == (2, 1)
    after = check(str(call), str(cache))
    assert after.ok and [r.hit for r in after.results] == [True]


@pytest.mark.parametrize("table, message", [
    ('y_pr = ["bfloat16"]', r"kernels\[0\]\.close_dtypes\.y_pr = \['bfloat16'\]: no recorded kernel has a pointer "
                            r"parameter 'y_pr': expected one of out_ptr, x_ptr, y_ptr"),
    ('n = ["bfloat16"]', r"kernels\[0\]\.close_dtypes\.n = .*no recorded kernel has a pointer parameter 'n'"),
])
def test_a_name_no_recorded_kernel_has_is_an_error(recorded, table, message):
    path = manifest(recorded, f"[kernels.close_dtypes]\n{table}\n", "typo.toml")
    with pytest.raises(ManifestError, match=str(path).replace(".", r"\.") + ": " + message):
        plan(load(path))


def test_a_bad_dtype_is_named_by_the_manifest_and_exits_3(recorded, capsys):
    path = manifest(recorded, '[kernels.close_dtypes]\ny_ptr = ["bf16"]\n', "bad.toml")
    assert main(["plan", str(path)]) == ManifestError.exit_code == 3
    err = capsys.readouterr().err.replace("\n", "")
    assert "kernels[0].close_dtypes.y_ptr = ['bf16']: expected one of bfloat16" in err and "Traceback" not in err
