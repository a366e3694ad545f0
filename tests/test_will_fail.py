"""Will-fail: a planned kernel this Triton cannot key (its source names what only another Triton has, or a plain
Python function) is named by plan, build and verify --plan through the real CLI (kernel, file:line, reason, what the
node does, the fix, the requests reaching it; exit 12), never dropped, while every other planned kernel is still
built and verified."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FOREIGN = FIXTURES / "prewarm_toy" / "foreign.py"
ENV = {**os.environ, "PYTHONPATH": str(FIXTURES)}
ASCEND = "prewarm_toy.foreign:ascend_relu_kernel"
HOST = "prewarm_toy.foreign:host_call_kernel"

MANIFEST = """
    name = "toy-will-fail"
    [target]
    backend = "cuda"
    arch = "sm_90"

    [[kernels]]
    function = "prewarm_toy.kernels:add_kernel"
    args = { x_ptr = { tensor = "float32" }, y_ptr = { tensor = "float32" }, out_ptr = { tensor = "float32" }, n = 1000, BLOCK = 64 }

    [[kernels]]
    function = "prewarm_toy.foreign:ascend_relu_kernel"
    args = { x_ptr = { tensor = "float32" }, out_ptr = { tensor = "float32" }, n = 1000, BLOCK = 64, ON_ASCEND = [false, true] }

    [[kernels]]
    function = "prewarm_toy.foreign:host_call_kernel"
    args = { x_ptr = { tensor = "float32" }, n = 100, BLOCK = 128, SCALE = false }
"""


def prewarm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *map(str, args)], capture_output=True, text=True,
                          env=ENV)


def def_line(name: str) -> int:
    """The line of ``def name(`` in the fixture, read from its text."""
    return next(i for i, text in enumerate(FOREIGN.read_text().splitlines(), 1) if text.startswith(f"def {name}("))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("will-fail") / "toy.toml"
    path.write_text(textwrap.dedent(MANIFEST))
    return path


def test_plan_names_each_kernel_this_triton_cannot_key(manifest):
    done = prewarm("plan", manifest, "--json")
    assert done.returncode == 12, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    # the keyable kernel is planned and counted; the others are listed, each with every request that reaches it
    assert [r["kernel"] for r in doc["requests"]] == ["prewarm_toy.kernels:add_kernel"]
    assert doc["counts"]["compiles"] == 1
    ascend, host = doc["will_fail"]
    assert (ascend["kernel"], ascend["file"], ascend["line"]) == (ASCEND, str(FOREIGN), def_line("ascend_relu_kernel"))
    assert ascend["triton"] == "triton 3.6.0" and ascend["error"] == "AttributeError"
    assert ascend["reason"] == "module 'triton.language.extra' has no attribute 'ascend'"
    assert ascend["labels"] == ["ascend_relu_kernel ON_ASCEND=False", "ascend_relu_kernel ON_ASCEND=True"]
    assert ascend["node"] == ("the node's first call of this kernel raises AttributeError in the JIT (before any cache "
                              "lookup): the server crashes at its first 'ascend_relu_kernel ON_ASCEND=False'")
    use = def_line("ascend_relu_kernel") + 5  # y = extra.ascend.libdevice.relu(x)
    assert "extra.ascend.libdevice.relu" in FOREIGN.read_text().splitlines()[use - 1]
    assert ascend["fix"] == (f"a triton whose triton.language.extra has ascend (the kernel's source names "
                             f"extra.ascend.libdevice.relu (line {use})), or a kernel source without it")
    # another way to be unkeyable: the reason is Triton's own (no memory address), the fix generic
    assert (host["kernel"], host["line"], host["error"]) == (HOST, def_line("host_call_kernel"), "RuntimeError")
    assert host["reason"] == "Unsupported function referenced: <function host_scale>"
    assert host["fix"].startswith("a triton that can hash this kernel's source")

    done = prewarm("plan", manifest)  # people: each verdict on its lines, and an error line naming every kernel
    assert done.returncode == 12
    assert (f"will-fail {ASCEND} ({FOREIGN}:{def_line('ascend_relu_kernel')}): triton 3.6.0 cannot key it: "
            f"AttributeError: module 'triton.language.extra' has no attribute 'ascend'") in done.stdout
    assert "2 planned requests reach it: ascend_relu_kernel ON_ASCEND=False, ascend_relu_kernel ON_ASCEND=True" \
        in done.stdout
    assert done.stderr.startswith("error: 2 planned kernel(s) cannot be keyed by this Triton")
    assert f"{HOST} ({FOREIGN}:{def_line('host_call_kernel')})" in done.stderr


def test_build_builds_everything_else_and_verify_names_what_will_fail(manifest, tmp_path):
    cache = tmp_path / "cache"
    done = prewarm("build", manifest, "--cache-dir", cache, "--workers", "1", "--json")
    assert done.returncode == 12, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert (doc["compiled"], doc["failed"]) == (1, 0) and doc["results"][0]["kernel"] == "prewarm_toy.kernels:add_kernel"
    assert [w["kernel"] for w in doc["will_fail"]] == [ASCEND, HOST]
    assert (cache / doc["results"][0]["key"]).is_dir()

    done = prewarm("verify", "--cache-dir", cache, "--plan", manifest)
    assert done.returncode == 12, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("will-hit") and "1/1 planned compiles hit" in line for line in lines)
    assert any(line.startswith("will-fail") and "PROBLEM" in line and "2 planned kernels this Triton cannot key (3 "
               "requests): the node crashes at its first call of each" in line for line in lines)
    assert f"will-fail {ASCEND} ({FOREIGN}:{def_line('ascend_relu_kernel')})" in done.stdout
    assert "problems found (exit 12)" in done.stdout

    (cache / doc["results"][0]["key"]).rename(tmp_path / "gone")  # a miss as well: its own code wins, both listed
    done = prewarm("verify", "--cache-dir", cache, "--plan", manifest, "--json")
    assert done.returncode == 5
    report = json.loads(done.stdout)
    assert report["will_hit"]["misses"] == 1 and [w["kernel"] for w in report["will_hit"]["will_fail"]] == [ASCEND, HOST]
