"""Autotune results as shipped data: a table measured once (prewarm.building.autotune), written by the offline build as
Triton's own result files under the keys Triton computes, read by a fresh process that then benchmarks nothing.

No GPU here: the "device run" that fills the table is Triton's own Autotuner on real CPU tensors through a
target-only driver with only its benchmark stubbed (tests/fixtures/prewarm_toy/tune.py: it computes the tuning key,
writes the result file, compiles); the node is a fresh process whose Autotuner benchmarks are counted through Triton's
benchmarking hook (tests/fixtures/prewarm_toy/tuned_app.py). `prewarm tune` itself needs the device (H200 bench).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building import backends  # noqa: E402
from prewarm.building.autotune import (  # noqa: E402
    Table, TunedRow, apply_table, measured, planned_tunings, read_table, write_table,
)
from prewarm.shipping.install import install  # noqa: E402
from prewarm.planning.manifest import load  # noqa: E402
from prewarm.shipping.pack import pack  # noqa: E402
from prewarm.planning.plan import plan  # noqa: E402
from prewarm_helpers import copy_cache  # noqa: E402

MANIFEST = FIXTURES / "toy-tuned.toml"
H200 = "NVIDIA H200"
BASE = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_"))}
ENV = {**BASE, "PYTHONPATH": str(FIXTURES), "COLUMNS": "300"}
AUTOTUNING = {**ENV, "TRITON_CACHE_AUTOTUNING": "1"}  # what deploy/prelaunch.sh exports for verify and the server


def cli(*args: str, env: dict = AUTOTUNING) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def tunings():
    m, target = backends.select(load(MANIFEST), "offline")
    target.activate()
    return planned_tunings(plan(m).requests)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The table a device run measures for every planned key, and a node's cache: the offline build with it
    (`prewarm build --tuned`), packed and installed at another path."""
    tmp = tmp_path_factory.mktemp("tuned")
    device_run = tmp / "device-run"
    for n, kernel, env in ((1000, "gain_kernel", ENV), (4096, "gain_kernel", ENV), (1000, "scale_kernel", AUTOTUNING)):
        subprocess.run([sys.executable, "-m", "prewarm_toy.tune", str(device_run), str(n), kernel], env=env,
                       check=True, capture_output=True)
    planned = tunings()
    rows, missing = measured(planned, device_run, H200)
    assert not missing and [r.label for r in rows] == ["gain n=1000", "gain n=4096", "scale"]
    table = Table(tmp / "toy-tuned.table.toml", rows, {"device": H200})
    write_table(table)
    p = cli("build", str(MANIFEST), "--tuned", str(table.path), "--cache-dir", str(tmp / "build"), "--mode",
            "offline", "--workers", "1", "--json")
    assert p.returncode == 0, p.stderr
    pack(tmp / "build", tmp / "bundle")
    install(str(tmp / "bundle"), tmp / "node")
    return SimpleNamespace(table=table.path, planned=planned, build=json.loads(p.stdout), node=tmp / "node",
                           built=tmp / "build")


def test_an_offline_build_with_the_table_ships_results_a_fresh_process_reads_without_benchmarking(tuned):
    """Each planned key's result file lands under the key dir Triton computes for it (the probe's), goes through
    pack and install like any entry, verify --require-autotune passes, and a fresh process at another path runs
    both gain calls with the table's fastest config: no benchmark, no compile."""
    report = tuned.build["autotune"]
    assert (report["covered"], report["uncovered"]) == (3, 0)
    assert [r["status"] for r in report["results"]] == ["written"] * 3
    for t in tuned.planned:
        kept = json.loads((tuned.node / t.key / t.filename).read_text())
        assert kept["key"] == list(t.key_value) and len(kept["configs_timings"]) == len(t.configs)
    p = cli("verify", "--cache-dir", str(tuned.node), "--plan", str(MANIFEST), "--require-autotune")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 kept, 0 absent" in p.stdout
    app = subprocess.run([sys.executable, "-m", "prewarm_toy.tuned_app", "1000", "4096"], capture_output=True,
                         text=True, env={**ENV, "TRITON_CACHE_DIR": str(tuned.node)}, timeout=300)
    assert "benchmarks=0 compiles=0" in app.stdout, app.stdout + app.stderr
    fastest = "config BLOCK: 128, num_warps: 4, num_ctas: 1, num_stages: 3"  # the table's, not Triton's first config
    assert app.stdout.count(fastest) == 2, app.stdout
    rebuilt = cli("build", str(MANIFEST), "--tuned", str(tuned.table), "--cache-dir", str(tuned.built), "--mode",
                  "offline", "--json")
    assert [r["status"] for r in json.loads(rebuilt.stdout)["autotune"]["results"]] == ["present"] * 3


def test_verify_fails_when_shipped_results_would_not_be_read(tuned):
    """scale_kernel keeps results only with TRITON_CACHE_AUTOTUNING=1: without it a server benchmarks although
    its result is shipped, and verify (sharing the server's env in the pre-launch job) refuses, naming it."""
    p = cli("verify", "--cache-dir", str(tuned.node), "--plan", str(MANIFEST), env=ENV)
    assert p.returncode == 5, p.stdout + p.stderr
    assert "1 kept but not read in this environment" in p.stdout
    (row,) = [line for line in p.stdout.splitlines() if line.startswith("autotune unread")]
    assert "scale" in row and "TRITON_CACHE_AUTOTUNING" in row


def test_plan_build_and_verify_name_the_keys_a_table_lacks(tuned, tmp_path):
    """A table holding only gain n=1000, named by the manifest (relative to it): plan and build say the other two
    keys are not covered, the build ships one result, verify --require-autotune fails on the two, each named."""
    partial = read_table(tuned.table)
    partial.path, partial.rows = tmp_path / "partial.toml", partial.rows[:1]
    write_table(partial)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST.read_text().replace('device = "H200"', 'device = "H200"\ntuned = "partial.toml"'))
    p = cli("plan", str(manifest))
    assert p.returncode == 0, p.stderr
    assert f"autotune table {partial.path} ({H200}): 1 of 3 planned tuning keys, 1 in table; 2 not covered" in p.stdout
    assert "absent gain n=4096 (gain_kernel) tuning key (4096, 'torch.float32', 'torch.float32')" in p.stdout
    cache = copy_cache(tuned.built, tmp_path / "cache")
    for f in cache.glob("*/*.autotune.json"):
        f.unlink()
    b = cli("build", str(manifest), "--cache-dir", str(cache), "--mode", "offline", "--json")
    assert b.returncode == 0, b.stderr
    assert [r["status"] for r in json.loads(b.stdout)["autotune"]["results"]] == ["written", "absent", "absent"]
    v = cli("verify", "--cache-dir", str(cache), "--plan", str(manifest), "--require-autotune")
    assert v.returncode == 5 and "1 kept, 2 absent" in v.stdout, v.stdout
    absent = [line for line in v.stdout.splitlines() if line.startswith("autotune absent")]
    assert [line.split()[2] for line in absent] == ["gain", "scale"] and "n=4096" in absent[0]


def test_rows_of_another_device_or_of_other_configs_are_not_used(tuned):
    table = read_table(tuned.table)
    planned = tunings()
    other = Table(table.path, [TunedRow("NVIDIA H100 80GB HBM3", r.kernel, r.tuning_key, r.timings)
                               for r in table.rows])
    write_table(other)
    try:
        report = apply_table(other.path, H200, planned, None)
        assert [r.status for r in report.results] == ["absent"] * 3
        assert report.other_devices == {"NVIDIA H100 80GB HBM3": 3}
        assert "rows for other devices not used: NVIDIA H100 80GB HBM3 (3)" in report.summary()
        fewer = dict(list(table.rows[0].timings.items())[:1])  # a config list that is not the kernel's any more
        write_table(Table(table.path, [TunedRow(H200, table.rows[0].kernel, table.rows[0].tuning_key, fewer)]))
        (stale, *_) = apply_table(table.path, H200, planned, None).results
        assert stale.status == "stale" and "re-run prewarm tune" in stale.detail
    finally:
        write_table(table)


def test_a_missing_table_is_reported_and_a_table_needs_a_device(tmp_path):
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST.read_text().replace('device = "H200"', 'device = "H200"\ntuned = "later.toml"'))
    p = cli("plan", str(manifest))
    assert p.returncode == 0 and f"{tmp_path / 'later.toml'}: no such file (make it with `prewarm tune" in p.stdout
    assert "the node benchmarks all 3 planned tuning keys" in p.stdout
    manifest.write_text(manifest.read_text().replace('device = "H200"\n', ""))
    p = cli("plan", str(manifest))
    assert p.returncode == 3 and "target.tuned = 'later.toml': expected target.device too" in p.stderr, p.stderr


def test_a_malformed_table_is_refused_naming_the_row(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tuned]]\ndevice = "NVIDIA H200"\nkernel = "k:f"\ntuning_key = "(1,)"\ntimings = [["c", 1.0]]\n')
    p = cli("plan", str(MANIFEST), "--tuned", str(bad))
    assert p.returncode == 3 and f"{bad}: tuned[0].timings[0] = ['c', 1.0]: expected" in p.stderr, p.stderr


def test_tune_without_the_device_says_so_and_writes_nothing(tmp_path):
    p = cli("tune", str(MANIFEST), "-o", str(tmp_path / "t.toml"))
    assert p.returncode == 11, p.stderr
    assert "3 planned tuning keys need the device to be benchmarked on" in p.stderr
    assert not (tmp_path / "t.toml").exists()


def guarded(cache: Path, mode: str, record: Path, *ns: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--mode", mode, "--record", str(record), "--",
                           sys.executable, "-m", "prewarm_toy.tuned_app", *ns], capture_output=True, text=True,
                          env={**ENV, "TRITON_CACHE_DIR": str(cache)}, timeout=300)


def test_the_guard_treats_an_autotune_benchmark_like_a_compile(tuned, tmp_path):
    """On a cache without the result: error mode refuses the benchmark before the first config runs, naming the
    kernel, the key dir it lacked (the one the plan computes), the tuning key and the config count, and records it;
    warn mode lets it run and logs it. On the node's cache nothing is benchmarked and nothing is said."""
    empty, record = tmp_path / "empty", tmp_path / "guard.jsonl"
    empty.mkdir()
    gain = next(t for t in tuned.planned if t.label == "gain n=1000")
    p = guarded(empty, "error", record, "1000")
    assert p.returncode != 0 and "prewarm.node.guard.UncoveredBenchmark" in p.stderr, p.stderr
    (logged,) = [line for line in p.stderr.splitlines() if line.startswith("prewarm guard:")]
    assert logged == (f"prewarm guard: refusing to benchmark prewarm_toy.kernels:gain_kernel: no gain_kernel.autotune"
                      f".json under {gain.key} in {empty}; tuning key {gain.tuning_key}, 2 configs")
    (line,) = [json.loads(x) for x in record.read_text().splitlines()]
    assert (line["event"], line["kernel"], line["key"], line["configs"]) == ("autotune", gain.kernel, gain.key, 2)
    with_record = tmp_path / "with-record.toml"  # the operator includes the guard's file: it still plans
    with_record.write_text(MANIFEST.read_text() + f'\n[[kernels]]\nrecord = "{record}"\n')
    assert cli("plan", str(with_record)).returncode == 0
    p = guarded(empty, "warn", record, "1000")
    assert p.returncode == 0 and "benchmarks=1" in p.stdout, p.stdout + p.stderr
    assert "prewarm guard: benchmarking prewarm_toy.kernels:gain_kernel" in p.stderr
    node = copy_cache(tuned.node, tmp_path / "node")
    p = guarded(node, "error", record, "1000", "4096")
    assert p.returncode == 0 and "benchmarks=0 compiles=0" in p.stdout, p.stdout + p.stderr
    assert "prewarm guard:" not in p.stderr



def test_a_recordings_tuning_key_is_the_calls_where_its_key_arguments_are_constexprs(tmp_path):
    """A recorded compile is one config of an autotuned call: its constexprs and pointer dtypes are known, its runtime
    ints only by class. heads_kernel's key (HEADS) is a constexpr: the recording gives the very key dir the call
    itself plans (Triton computes both); gain_kernel's (n) is a runtime int: said, never guessed."""
    recorded = {}
    for kernel in ("heads_kernel", "gain_kernel"):
        rec = tmp_path / f"{kernel}.jsonl"
        p = cli("record", "-o", str(rec), "--", sys.executable, "-m", "prewarm_toy.tune", str(tmp_path / "run"),
                "1000", kernel, env=ENV)
        assert p.returncode == 0, p.stderr
        recorded[kernel] = f'[[kernels]]\nrecord = "{rec}"\n'
    call = ('[[kernels]]\nfunction = "prewarm_toy.kernels:heads_kernel"\nargs = { x_ptr = { tensor = "float32" }, '
            'out_ptr = { tensor = "float32" }, n = 1000, HEADS = 2.0 }\n')  # what prewarm_toy.tune passed

    def keys(kernels: str):
        path = tmp_path / "m.toml"
        path.write_text(f'[target]\nbackend = "cuda"\narch = "sm_90"\n{kernels}')
        m, target = backends.select(load(path), "offline")
        target.activate()
        return [(t.key, t.tuning_key, t.problem) for t in planned_tunings(plan(m).requests)]

    (from_record,) = keys(recorded["heads_kernel"])
    assert from_record == keys(call)[0] and from_record[1] == "(2.0, 'torch.float32', 'torch.float32')"
    ((key, _, problem),) = keys(recorded["gain_kernel"])
    assert key == "-" and problem == ("recorded compile: key argument n is a runtime i32: a recording holds its "
                                      "specialization class, not its value")


def test_the_prelaunch_job_starts_the_server_reading_shipped_results_and_refuses_an_env_that_would_not(tuned,
                                                                                                       tmp_path):
    """deploy/prelaunch.sh exports TRITON_CACHE_AUTOTUNING=1 to verify and the server alike: with the tuned bundle
    the server starts (and reads every result); a node that sets it to 0 stays down (exit 5), the unread kernel
    named, because its autotuner would benchmark although the result is shipped."""
    server = ["sh", "-c", 'echo "autotune=$TRITON_CACHE_AUTOTUNING"; echo server-started']
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PREWARM_MANIFEST": str(MANIFEST),
           "PREWARM_SOURCE": str(tuned.node.parent / "bundle"), "PREWARM_REQUIRE_AUTOTUNE": "1"}
    script = [str(Path(__file__).resolve().parents[1] / "deploy" / "prelaunch.sh"), *server]
    p = subprocess.run(["/bin/sh", *script], env={**env, "TRITON_CACHE_DIR": str(tmp_path / "a")},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("autotune=1\nserver-started"), p.stdout + p.stderr
    p = subprocess.run(["/bin/sh", *script], env={**env, "TRITON_CACHE_DIR": str(tmp_path / "b"),
                                                  "TRITON_CACHE_AUTOTUNING": "0"}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 5 and "server-started" not in p.stdout, p.stdout + p.stderr
    assert "autotune unread scale" in p.stdout
