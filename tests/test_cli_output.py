"""Piped into a job's log (an init container's, a CI's), every error and result line stays one line, whatever its
length: operators grep for them. Paths here are over 200 characters, so 80-column wrapping would split each one."""
from __future__ import annotations

import os

import pytest

from prewarm_helpers import REPO, run_cli


@pytest.fixture
def deep(tmp_path):
    d = tmp_path / ("p" * 100) / ("q" * 100)
    d.mkdir(parents=True)
    assert len(str(d)) > 200
    return d


def piped_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return {**env, **extra}


def one_error_line(p, *needles: str) -> str:
    """The run failed with exactly one stderr line, `error: ...`, holding every needle whole."""
    assert p.returncode not in (0, 1), (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_every_verbs_error_is_one_line_in_a_log(deep):
    bad = deep / "bad.toml"
    bad.write_text('name = "x"\n[target]\nbackend = "cuda"\narch = "sm_90"\n')
    missing = deep / "missing"
    env = piped_env()
    cases = [
        (["plan", bad], [str(bad), "kernels is empty"]),
        (["build", bad, "--cache-dir", deep / "c"], [str(bad), "kernels is empty"]),
        (["record", "-o", deep / "r.jsonl", "--", missing], [str(missing), "cannot run"]),
        (["pack", missing, "-o", deep / "b"], [str(missing)]),
        (["push", missing], [str(missing)]),
        (["install", missing, "--cache-dir", deep / "node"], [str(missing)]),
        (["verify", "--cache-dir", missing], [str(missing)]),
    ]
    for args, needles in cases:
        one_error_line(run_cli(*args, env=env, check=None), *needles)


def test_results_and_tables_keep_whole_lines_in_a_log(deep, triton_cache):
    env = piped_env()
    bundle, store, node = deep / "bundle", deep / "store", deep / "node"
    p = run_cli("pack", triton_cache, "-o", bundle, env=env)
    assert any(line.startswith("packed ") and line.endswith(str(bundle)) for line in p.stdout.splitlines()), p.stdout
    p = run_cli("push", bundle, f"file://{store}", env=env)
    assert any(f"file://{store}" in line and " ok " in line for line in p.stdout.splitlines()), p.stdout
    p = run_cli("install", f"file://{store}", "--cache-dir", node, env=env)
    assert [line for line in p.stdout.splitlines() if line.startswith(f"{node}: installed ")], p.stdout
    p = run_cli("verify", "--cache-dir", node, env=env)
    assert p.stdout.splitlines()[0].startswith(f"verify {node} (against receipt "), p.stdout
    p = run_cli("verify", "--cache-dir", node, "--details", env=env)
    assert any(f"integrity of {node} (against" in line for line in p.stdout.splitlines()), p.stdout
    key = deep / "signing"
    p = run_cli("keygen", "-o", key, env=env)
    assert len(p.stdout.strip().splitlines()) == 1 and f"{key}.key" in p.stdout and f"{key}.pub" in p.stdout


def test_columns_still_sets_the_table_width():
    """An operator who sets COLUMNS gets tables at that width (cells fold), as rich does on a terminal."""
    wide = run_cli("fingerprint", env=piped_env())
    assert max(len(line) for line in wide.stdout.splitlines()) > 60, wide.stdout  # the sha256 values alone are 64
    p = run_cli("fingerprint", env=piped_env(COLUMNS="60"))
    assert max(len(line) for line in p.stdout.splitlines()) <= 60, p.stdout


def test_lower_of_a_cuda_manifest_is_one_line(deep):
    m = deep / "kimi-linear-h200.toml"
    m.write_text((REPO / "manifests" / "kimi-linear-h200.toml").read_text())
    one_error_line(run_cli("lower", m, env=piped_env(), check=None), str(m), "lower checks the Ascend (npu) front end only")


def test_help_tells_a_user_what_the_tool_does_and_where_to_start():
    p = run_cli("--help")
    assert "Compile the Triton kernels a server will launch before it starts" in p.stdout
    assert "Start with `prewarm plan MANIFEST`" in p.stdout


def test_verify_of_a_clean_install_fits_one_screen(deep):
    """What an operator reads before serving: one line per check, nothing else when all is well (the rows are
    behind --details). The toy manifest plans 11 compiles; the summary does not grow with the plan."""
    env = piped_env(COLUMNS="80", PYTHONPATH=str(REPO / "tests" / "fixtures"))
    toy = REPO / "tests" / "fixtures" / "toy-cuda.toml"
    run_cli("build", toy, "--cache-dir", deep / "build", "--workers", "1", env=env)
    run_cli("pack", deep / "build", "-o", deep / "bundle", env=env)
    run_cli("install", deep / "bundle", "--cache-dir", deep / "node", env=env)
    lines = run_cli("verify", "--cache-dir", deep / "node", "--plan", toy, env=env).stdout.splitlines()
    # the toy's two autotuned kernels have no result shipped (no autotune table): clean, with that said as info
    assert len(lines) <= 25 and lines[-1] == "clean (2 autotune results absent: those kernels benchmark on first use)"
    checks = {line[:14].strip(): line[14:].split()[0] for line in lines[1:-1]}  # "check name", then its status
    assert checks == {"integrity": "ok", "trust": "info", "compatibility": "ok", "will-hit": "ok", "autotune": "info",
                      "C modules": "ok"}, lines  # trust: info without --trust (nothing proves who wrote the receipts)
    details = run_cli("verify", "--cache-dir", deep / "node", "--plan", toy, "--details", env=env).stdout
    assert details.count(" hit ") >= 11  # every planned compile has its row there
