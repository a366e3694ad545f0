"""guard: a "server" (tests/fixtures/prewarm_toy/guarded_app.py, real ``kernel[grid](...)`` launches on CPU tensors
through a target-only driver) runs in fresh processes under `prewarm guard`. A planned, built call compiles
nothing and logs nothing; an uncovered one is refused before compiling (error) or logged and recorded (warn, child
processes too); a rebuild with the record file included covers it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building.build import build  # noqa: E402
from prewarm.shipping.pack import pack  # noqa: E402
from prewarm.shipping.install import install  # noqa: E402
from prewarm_helpers import copy_cache  # noqa: E402

MANIFEST = FIXTURES / "toy-guard.toml"
PLANNED = "float32,float32,1000,64"  # the app's own launch, written apart from the manifest: the same request
BF16_Y = "float32,bfloat16,1000,64"  # y in bf16: another pointer dtype
BLOCK_128 = "float32,float32,4096,128"  # another constexpr and another class of n


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """The manifest, and a node's cache: built, packed and installed at another path, as a node gets it."""
    tmp = tmp_path_factory.mktemp("guard")
    report = build(MANIFEST, tmp / "build", workers=1, mode="offline")
    assert report.ok and report.count("compiled") == 1
    pack(tmp / "build", tmp / "bundle")
    install(str(tmp / "bundle"), tmp / "cache")
    return MANIFEST, tmp / "cache"


def entries(cache: Path) -> set[str]:
    return {p.parent.name for p in cache.glob("*/__grp__add_kernel.json")}


def serve(cache: Path, *calls: str, env: dict | None = None, guard_args: tuple = ()) -> subprocess.CompletedProcess:
    """The app under `prewarm guard` in a fresh process (the guard's settings come from ``env``, as a pre-launch
    job exports them, or from ``guard_args``)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    full = {**base, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(FIXTURES), **(env or {})}
    return subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", *guard_args, "--", sys.executable, "-m",
                           "prewarm_toy.guarded_app", *calls], env=full, capture_output=True, text=True, timeout=300)


def guard_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("prewarm guard:")]


def test_a_planned_built_call_compiles_nothing_and_logs_nothing(built, tmp_path):
    manifest, cache = built
    record = tmp_path / "guard.jsonl"
    p = serve(cache, PLANNED, env={"PREWARM_GUARD": "error", "PREWARM_GUARD_RECORD": str(record),
                                   "PREWARM_GUARD_PLAN": str(manifest)})
    assert p.returncode == 0, p.stderr
    assert "compiles=0" in p.stdout and guard_lines(p) == []
    assert not record.exists()


def test_error_mode_refuses_an_uncovered_call_before_compiling_and_names_the_argument(built):
    manifest, cache = built
    before = entries(cache)
    p = serve(cache, PLANNED, BF16_Y, env={"PREWARM_GUARD": "error", "PREWARM_GUARD_PLAN": str(manifest)})
    assert p.returncode != 0
    assert "prewarm.node.guard.UncoveredCompile: prewarm guard: prewarm_toy.kernels:add_kernel is not in the cache" in p.stderr
    assert "nearest planned add: argument y_ptr: planned *fp32, runtime *bf16" in p.stderr
    assert "compiles=" not in p.stdout
    assert entries(cache) == before  # refused before the compiler ran: nothing new in the cache


def test_a_planned_call_missing_for_an_env_var_of_tritons_key_is_explained_against_the_cache(built):
    """The node sets TRITON_DISABLE_LINE_INFO (in Triton's key): the planned call misses; the guard says it is
    planned, and that the cache's entry was compiled without that variable."""
    manifest, cache = built
    p = serve(cache, PLANNED, env={"PREWARM_GUARD": "error", "PREWARM_GUARD_PLAN": str(manifest),
                                   "TRITON_DISABLE_LINE_INFO": "1"})
    assert p.returncode != 0
    (logged,) = guard_lines(p)
    assert "planned as 'planned add' but not in the cache: nearest add_kernel in " in logged
    assert logged.endswith("env var TRITON_DISABLE_LINE_INFO: cache unset, this process true"), logged


def test_warn_mode_records_uncovered_calls_of_every_process_and_a_rebuild_covers_them(built, tmp_path):
    manifest, cache = built
    cache = copy_cache(cache, tmp_path / "cache")  # warn mode compiles into it
    record = tmp_path / "guard.jsonl"
    env = {"PREWARM_GUARD_RECORD": str(record), "PREWARM_GUARD_PLAN": str(manifest)}  # mode from the flag
    calls = (PLANNED, BF16_Y, f"child:{BLOCK_128}")
    p = serve(cache, *calls, env=env, guard_args=("--mode", "warn"))
    assert p.returncode == 0, p.stderr
    logged = guard_lines(p)
    assert len(logged) == 2, p.stderr
    assert logged[0].startswith("prewarm guard: compiling prewarm_toy.kernels:add_kernel: no add_kernel.json under ")
    assert logged[0].endswith("nearest planned add: argument y_ptr: planned *fp32, runtime *bf16")
    assert "constexpr BLOCK: planned = 64, runtime = 128" in logged[1]  # from the child process
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [e["kernel"] for e in lines] == ["prewarm_toy.kernels:add_kernel"] * 2
    assert len({e["pid"] for e in lines}) == 2  # the child process was guarded too
    assert "y_ptr" in lines[0]["guard"]

    # the record file joins the manifest; a build from it (another dir) covers both: the same run, refused on any
    # compile now, compiles nothing and logs nothing in either process
    (tmp_path / "m.toml").write_text(manifest.read_text() + f'\n[[kernels]]\nrecord = "{record}"\n')
    rebuilt = tmp_path / "rebuilt"
    assert build(tmp_path / "m.toml", rebuilt, workers=1, mode="offline").count("compiled") == 3
    p = serve(rebuilt, *calls, env={**env, "PREWARM_GUARD": "error"})
    assert p.returncode == 0, p.stderr
    assert guard_lines(p) == [] and p.stdout.count("compiles=0") == 2
    assert len(record.read_text().splitlines()) == 2


def test_manual_arming_ignores_the_servers_own_warmup(built, tmp_path):
    cache = copy_cache(built[1], tmp_path / "cache")  # warn mode compiles into it
    record = tmp_path / "guard.jsonl"
    p = serve(cache, BF16_Y, "arm", BLOCK_128, env={"PREWARM_GUARD": "warn", "PREWARM_GUARD_ARM": "manual",
                                                    "PREWARM_GUARD_RECORD": str(record)})
    assert p.returncode == 0, p.stderr
    assert "armed=True" in p.stdout
    (logged,) = guard_lines(p)  # only the call after arm(); no plan given: nothing to explain it against
    assert logged.endswith("not planned (no PREWARM_GUARD_PLAN to explain it against)")
    (line,) = record.read_text().splitlines()
    assert json.loads(json.loads(line)["specialization_data"])["constant_vals"][-1] == 128


def test_a_bad_setting_is_said_and_the_guard_stays_off(built, tmp_path):
    cache = copy_cache(built[1], tmp_path / "cache")
    p = serve(cache, BF16_Y, env={"PREWARM_GUARD": "loud"})
    assert p.returncode == 0
    assert "prewarm guard: PREWARM_GUARD='loud' is not one of warn, error: the guard is off" in p.stderr
    assert "compiles=1" in p.stdout


def test_guard_without_a_command_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "guard"], capture_output=True, text=True)
    assert p.returncode == 3 and "no command given" in p.stderr and "Traceback" not in p.stderr


WAIT_FOR_KEY = """
import sys, time
import triton
from triton.runtime import autotuner, cache
start = time.time()
while cache.triton_key.cache_info().currsize == 0 and time.time() - start < float(sys.argv[1]):
    time.sleep(0.02)
raw = getattr(cache.triton_key, "__wrapped__", cache.triton_key)
raw = getattr(raw, "__wrapped__", raw)  # below lru_cache: the key computed afresh
print(cache.triton_key.cache_info().currsize, cache.triton_key is autotuner.triton_key, cache.triton_key() == raw())
"""


def test_a_guarded_process_has_tritons_own_key_before_its_first_launch(tmp_path):
    """Triton hashes its sources and libtriton at a process's first launch (0.4 s on the H200: a first request's
    time); under the guard it is computed in a thread from the import on, no launch needed, and Triton's modules
    still share one key function whose value is Triton's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")} | {"TRITON_CACHE_DIR": str(tmp_path)}
    guarded = subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--", sys.executable, "-c", WAIT_FOR_KEY,
                              "120"], env=env, capture_output=True, text=True, timeout=300)
    assert guarded.returncode == 0, guarded.stderr
    assert guarded.stdout.split() == ["1", "True", "True"]
    plain = subprocess.run([sys.executable, "-c", WAIT_FOR_KEY, "3"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split()[0] == "0"  # without the guard nothing computes it before a launch
