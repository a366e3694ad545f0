"""Recordings that check themselves: each line of `prewarm record` carries the on-disk key its process's Triton
computed, what the key is made of, and the device; a record-only manifest plans as that device; a build that would
not reproduce a recorded key refuses, naming the part that differs (an env var, the ptxas, a global the kernel
reads, the kernel's line); will-hit names it in its MISS rows. Real recording processes, real offline builds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm.building import backends, tritoncompat

from prewarm.planning import plan
from prewarm.building.build import build
from prewarm.errors import FingerprintMismatch, ManifestError
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for
from prewarm.node.willhit import check

# A library as fla and sglang are: it asks the device at import (a global the kernels read), and a global set from
# the environment; two kernels, one with an int that moves with the traffic (n) and one that does not (stride).
KERNELS = '''
import os

import torch
import triton
import triton.language as tl

SMS = tl.constexpr(torch.cuda.get_device_properties(0).multi_processor_count)
SCALE = tl.constexpr(int(os.environ.get("KEYED_TOY_SCALE", "2")))


@triton.jit
def scaled_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE + SMS, mask=mask)


@triton.jit
def strided_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=mask), mask=mask)
'''

# The recorded server: this box has no GPU, so torch.cuda answers as an H200 (the profile) in its process.
APP = '''
import torch

from prewarm.building.backends import CudaOfflineTarget

CudaOfflineTarget("cuda", "sm_90", "H200").activate()
from keyed_toy.kernels import scaled_kernel, strided_kernel  # noqa: E402

scaled_kernel.warmup(torch.float32, torch.float32, 4096, BLOCK=256, grid=(1,))
for n in (4096, 4095):  # two classes of n (a multiple of 16, neither); the stride stays one
    strided_kernel.warmup(torch.float32, torch.float32, n, 64, BLOCK=256, grid=(1,))
'''

TARGET = '[target]\nbackend = "cuda"\narch = "sm_90"\n'


def write_library(root: Path, kernels: str = KERNELS) -> Path:
    (root / "keyed_toy").mkdir(parents=True)
    (root / "keyed_toy" / "__init__.py").write_text("")
    (root / "keyed_toy" / "kernels.py").write_text(kernels)
    return root


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """``app.jsonl``: a real `prewarm record` of APP; ``app-cache``: where its process compiled; ``lib``: the
    library."""
    tmp = tmp_path_factory.mktemp("keys")
    write_library(tmp / "lib")
    (tmp / "app.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": str(tmp / "lib"), "TRITON_CACHE_DIR": str(tmp / "app-cache")}
    for name in ("KEYED_TOY_SCALE", "TRITON_DEFAULT_FP_FUSION", "TRITON_PTXAS_PATH"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "record", "-o", str(tmp / "app.jsonl"), "--",
                           sys.executable, str(tmp / "app.py")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(tmp / "lib"))  # this process plans and builds with the same library
    return tmp


def manifest(tmp: Path, name: str, record: str = "app.jsonl", extra: str = "") -> Path:
    path = tmp / name
    path.write_text(f'{TARGET}\n[[kernels]]\nrecord = "{record}"\n{extra}')
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def rewrite(src: Path, dst: Path, change) -> Path:
    """``src`` with ``change(line number, entry)`` applied to each line, as another machine's recorder wrote it."""
    out = []
    for n, entry in enumerate(lines(src), 1):
        change(n, entry)
        out.append(json.dumps(entry))
    dst.write_text("\n".join(out) + "\n")
    return dst


@pytest.fixture(autouse=True)
def no_drift_env(monkeypatch):
    for name in ("KEYED_TOY_SCALE", "TRITON_DEFAULT_FP_FUSION"):
        monkeypatch.delenv(name, raising=False)


# --- what a line records -----------------------------------------------------------------------------------------


def test_each_line_carries_the_key_its_process_used_and_the_device(recorded):
    entries = lines(recorded / "app.jsonl")
    assert [e["kernel"].split(":")[1] for e in entries] == ["scaled_kernel", "strided_kernel", "strided_kernel"]
    # the keys Triton itself compiled into in the recorded process
    assert sorted(e["key"] for e in entries) == sorted(p.name for p in (recorded / "app-cache").iterdir())
    parts = entries[0]["key_parts"]
    assert parts["kernel"]["globals"] == {"SCALE": "2", "SMS": "132"}  # what the kernel reads, as it read it
    assert parts["kernel"]["line"] == 12 and parts["env"] == {}
    assert "Cuda compilation tools" in parts["backend"] and parts["backend"].endswith("-90")  # ptxas + arch
    assert parts["options"]["values"]["num_warps"] == 4
    assert dict(parts["options"]["values"]["extern_libs"])["libdevice"] != ""  # by content, not path
    device = entries[0]["device"]
    assert (device["name"], device["capability"], device["multi_processor_count"]) == ("NVIDIA H200", [9, 0], 132)
    assert device["triton"]["max_shared_mem"] == 232448


# --- the device of a record-only manifest ---------------------------------------------------------------------------


def test_a_record_only_manifest_builds_as_the_recorded_device_and_reproduces_every_key(recorded):
    path = manifest(recorded, "plain.toml")
    assert plan.manifest_device(load(path)) == "H200"
    report = build(path, recorded / "built", workers=1, mode="offline")
    assert report.ok and report.count("compiled") == 3 and report.key_drift == []
    assert sorted(r.key for r in report.results) == sorted(p.name for p in (recorded / "app-cache").iterdir())


def test_without_a_device_the_failure_says_what_to_name(recorded):
    """An older recording (no device) of a library that asks the device at import: each compile fails, and says
    how to give the build a device (the issue's 85 of 85 "Found no NVIDIA driver", with no hint)."""
    rewrite(recorded / "app.jsonl", recorded / "old.jsonl", lambda n, e: e.pop("device"))
    env = {**os.environ, "PYTHONPATH": str(recorded / "lib")}
    old = manifest(recorded, "old.toml", "old.jsonl")
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "build", str(old), "--cache-dir",
                           str(recorded / "old-cache"), "--mode", "offline", "--workers", "1", "--json"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 4, done.stdout + done.stderr
    failed = json.loads(done.stdout)["results"]
    assert len(failed) == 3 and all(r["status"] == "failed" for r in failed)
    assert all("Found no NVIDIA driver" in r["message"] and "name the node's with [target] device" in r["message"]
               for r in failed)


@pytest.mark.parametrize("change, message", [
    (lambda n, e: n == 3 and e["device"].update(name="NVIDIA H100 80GB HBM3"),
     r"old\.jsonl:3: recorded on 'NVIDIA H100 80GB HBM3', but .*old\.jsonl:1 on 'NVIDIA H200': a build plans for one "
     r"device"),
    (lambda n, e: e["device"].update(name="NVIDIA GH200 480GB"),
     r"old\.jsonl:1: recorded on device 'NVIDIA GH200 480GB' \(capability \[9, 0\], multi_processor_count 132.*\), "
     r"which no prewarm.devices profile describes .*add a DeviceProfile for it"),
    (lambda n, e: e["device"].update(multi_processor_count=114),
     r"old\.jsonl:1: recorded on 'NVIDIA H200' with multi_processor_count = 114, but profile H200 says 132"),
])
def test_a_recording_of_conflicting_or_unknown_devices_is_named(recorded, change, message):
    rewrite(recorded / "app.jsonl", recorded / "old.jsonl", change)
    with pytest.raises(ManifestError, match=message):
        plan.manifest_device(load(manifest(recorded, "old.toml", "old.jsonl")))


# --- keys this host does not reproduce ------------------------------------------------------------------------------


def test_a_build_that_would_not_reproduce_the_recorded_keys_refuses_naming_each_part(recorded, tmp_path):
    """A fresh `prewarm build` process whose environment differs from the recorded one in four parts of the key:
    the global the kernel reads, an env var of the key, ptxas, and the kernel's line (its file edited)."""
    moved = KERNELS.replace("@triton.jit\ndef strided_kernel", "\n@triton.jit\ndef strided_kernel")
    write_library(tmp_path / "lib", moved)
    real = tritoncompat.ptxas_path()
    fake = tmp_path / "ptxas"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then "{real}" --version | sed "s/release .*/release 99.1, '
                    f'V99.1.1/"; else exec "{real}" "$@"; fi\n')  # another CUDA release's ptxas
    fake.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "KEYED_TOY_SCALE": "3", "TRITON_DEFAULT_FP_FUSION": "0",
           "TRITON_PTXAS_PATH": str(fake)}
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "build", str(manifest(recorded, "plain.toml")),
                           "--cache-dir", str(cache), "--mode", "offline", "--workers", "1"],
                          env=env, capture_output=True, text=True)
    text = " ".join(done.stderr.split())
    assert done.returncode == FingerprintMismatch.exit_code == 8, done.stderr
    assert "3 of 3 recorded requests would not be found by the recording's node" in text
    assert "env var TRITON_DEFAULT_FP_FUSION: recorded unset, here false" in text  # as Triton's key reads it
    assert "here Cuda compilation tools, release 99.1, V99.1.1" in text
    assert "global SCALE: recorded 2, here 3" in text  # scaled_kernel reads it
    assert "kernel line strided_kernel: recorded 19, here 20" in text
    assert f"app.jsonl:2): recorded {lines(recorded / 'app.jsonl')[1]['key']}" in text
    assert "--allow-key-drift" in text and "Traceback" not in done.stderr
    assert not [p for p in cache.iterdir() if p.name != ".prewarm"]  # nothing compiled


def test_allow_key_drift_builds_and_reports_it(recorded, monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    path = manifest(recorded, "plain.toml")
    with pytest.raises(FingerprintMismatch, match="3 of 3 recorded requests"):
        build(path, recorded / "drift-refused", workers=1, mode="offline")
    report = build(path, recorded / "drift-allowed", workers=1, mode="offline", allow_key_drift=True)
    assert report.ok and report.count("compiled") == 3
    assert [[d.to_json(("recorded", "here")) for d in x.differences] for x in report.key_drift] == [
        [{"kind": "env", "name": "TRITON_DEFAULT_FP_FUSION", "recorded": "unset", "here": "false"}]] * 3
    assert report.to_json()["key_drift"][0]["where"].endswith("app.jsonl:1")


def test_will_hit_names_the_differing_part_in_each_miss_row(recorded, monkeypatch):
    path = manifest(recorded, "plain.toml")
    cache = recorded / "verified"
    assert build(path, cache, workers=1, mode="offline").ok
    clean = check(str(path), str(cache))
    assert clean.ok and clean.key_drift == []
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # verify run under an env var the server does not set
    report = check(str(path), str(cache))
    assert report.misses == 3 and len(report.key_drift) == 3
    for row, entry in zip(report.results, lines(recorded / "app.jsonl")):
        assert f"the recording's process ({recorded / 'app.jsonl'}:" in row.detail
        assert f"looked it up under {entry['key']}, here {row.key}: env var TRITON_DEFAULT_FP_FUSION: recorded " \
               f"unset, here false" in row.detail


# --- bounded closing ------------------------------------------------------------------------------------------------


def planned(path: Path):
    return plan_for(*backends.select(load(path), "offline"))


def test_close_true_closes_only_the_ints_that_took_several_classes(recorded):
    """n took two classes in the recording (4096, 4095) and is closed; the stride (64) stayed in its class and is
    not; scaled_kernel's n took one class: nothing added."""
    p = planned(manifest(recorded, "close.toml", extra="close = true\n"))
    assert [(c.kernel.split(":")[1], c.closing) for c in p.compiles] == [
        ("scaled_kernel", ""), ("strided_kernel", ""), ("strided_kernel", "n=1"), ("strided_kernel", "")]
    assert {tritoncompat.parse_specialization(c.specialization).int_classes["stride"] for c in p.compiles[1:]} == \
        {("i32", "%16=0")}
    # the recorded requests themselves are planned as recorded
    recorded_data = {tritoncompat.on_disk(e["specialization_data"]) for e in lines(recorded / "app.jsonl")}
    assert recorded_data == {tritoncompat.on_disk(c.specialization) for c in p.compiles if not c.closing}


def test_close_names_parameters_to_close_besides_those_that_varied(recorded):
    p = planned(manifest(recorded, "named.toml", extra='close = ["stride"]\n'))
    counts = {c.kernel.split(":")[1]: (c.requests, c.compiles, c.closing) for c in p.counts()}
    assert counts == {"strided_kernel": (2, 9, 7), "scaled_kernel": (1, 1, 0)}  # n x stride: 3 x 3 classes


@pytest.mark.parametrize("close, message", [
    ('["strid"]', r"kernels\[0\]\.close = \['strid'\]: no recorded kernel has a specialized int parameter 'strid'.*"
                  r"expected one of n, stride"),
    ('["BLOCK"]', r"no recorded kernel has a specialized int parameter 'BLOCK' \(a constexpr"),
    ('["n", "n"]', r"kernels\[0\]\.close = \['n', 'n'\]: expected true, false, or a list of int parameter names"),
    ("[]", r"kernels\[0\]\.close = \[\]: expected true, false, or a list"),
    ("[1]", r"kernels\[0\]\.close = \[1\]: expected true, false, or a list"),
])
def test_a_close_list_naming_no_specialized_int_is_an_error(recorded, capsys, close, message):
    import re

    from prewarm.cli import main

    assert main(["plan", str(manifest(recorded, "bad.toml", extra=f"close = {close}\n"))]) == ManifestError.exit_code
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(message, err), err


def test_plan_prints_the_compile_count_and_what_closing_added(recorded, capsys):
    from prewarm.cli import main

    path = manifest(recorded, "close.toml", extra="close = true\n")
    assert main(["plan", str(path), "--mode", "offline"]) == 0  # (this process answers as an H200 by now)
    text = " ".join(capsys.readouterr().out.split())
    assert "3 requests -> 4 compiles for cuda sm_90 (offline) (1 added by closing)" in text
    assert f"closing: kernels[0] {recorded / 'app.jsonl'}: strided_kernel 2 requests -> 3 compiles (+1)" in text
    assert main(["plan", str(path), "--json", "--mode", "offline"]) == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert (counts["requests"], counts["compiles"], counts["closing"]) == (3, 4, 1)


def test_build_refuses_a_plan_above_max_compiles_before_compiling(recorded, capsys):
    from prewarm.cli import main

    path = manifest(recorded, "named.toml", extra='close = ["stride"]\n')
    cache = recorded / "too-many"
    assert main(["build", str(path), "--cache-dir", str(cache), "--max-compiles", "5", "--mode", "offline"]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert (f"the plan has 10 compiles from 3 requests, more than --max-compiles 5; most from kernels[0] "
            f"{recorded / 'app.jsonl'}: strided_kernel 9 compiles from 2 requests (7 added by closing)") in err
    assert not [p for p in cache.iterdir() if p.name != ".prewarm"]
