"""Will-hit: for every planned compile, would this environment's runtime find it? No compile, nothing written;
a deleted, incomplete or un-relocated entry is named; the runtime's own compiles land on the planned keys."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building import tritoncompat  # noqa: E402
from prewarm.building.build import build  # noqa: E402
from prewarm.node.willhit import check  # noqa: E402

TOY = FIXTURES / "toy-cuda.toml"
ENV = {**os.environ, "PYTHONPATH": str(FIXTURES)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    report = build(TOY, path, workers=2, mode="offline")
    assert report.count("compiled") == 11
    return path, {r.label: r.key for r in report.results}


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_built_cache_hits_everything(cache):
    path, keys = cache
    before = files(path)
    report = check(str(TOY), str(path))
    assert report.ok and (report.hits, report.misses) == (11, 0)
    assert {r.label: r.key for r in report.results} == keys
    # the toy's autotuners keep nothing on disk unless TRITON_CACHE_AUTOTUNING=1 (no cache_results): their tuning
    # keys are still planned (a node with the variable reads shipped results), and said not to be read here
    assert [(a.label, a.present, a.reads) for a in report.autotune] == [("prefill scale", False, False),
                                                                         ("prefill relu", False, False)]
    assert all("TRITON_CACHE_AUTOTUNING unset" in a.detail for a in report.autotune)
    assert report.to_json()["ok"] is True and len(report.to_json()["results"]) == 11
    # the C modules the runtime builds at first launch: the offline build made them, under the keys looked up here
    # (3.6: a launcher per kernel signature and cuda_utils; 3.8: cuda_utils, whose launch serves every kernel)
    per_signature = tritoncompat.release().cuda_launchers == "per-signature"
    assert all(m.present for m in report.modules)
    assert sorted(m.name for m in report.modules) == ["__triton_launcher"] * 3 * per_signature + ["cuda_utils"]
    assert sum(m.kernels for m in report.modules) == 11 * per_signature
    assert {m.key for m in report.modules} == {p.parent.name for p in path.rglob("*.so")}
    assert files(path) == before
    assert check(str(TOY), str(path)).to_json() == report.to_json()  # a second check in this process: the same


def test_an_empty_cache_misses_everything_and_stays_empty(tmp_path):
    report = check(str(TOY), str(tmp_path))
    assert (report.hits, report.misses) == (0, 11) and not report.ok
    assert all("not in the cache" in r.detail and r.key for r in report.results)
    assert [(m.name, m.present) for m in report.modules] == [("cuda_utils", False)]  # no kernel, no launcher
    assert files(tmp_path) == []  # the probe compiled and created nothing


def test_the_runtime_compiles_exactly_the_planned_keys(cache, tmp_path):
    """A server's own `kernel[grid](...)` calls (on CPU tensors: they compile, then fail to launch) produce the
    very key dirs the plan predicts: the non-autotuned half of the mix hits, and nothing else was compiled."""
    path, keys = cache
    subprocess.run([sys.executable, "-m", "prewarm_toy.runtime", str(tmp_path)], env=ENV, check=True,
                   capture_output=True)
    report = check(str(TOY), str(tmp_path))
    hits = sorted(r.label for r in report.results if r.hit)
    assert hits == ["decode bs=1", "decode bs=2", "decode bs=4", "prefill add"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keys[label] for label in hits)


def test_a_codegen_env_var_changes_every_key(cache):
    """TRITON_DEFAULT_FP_FUSION is in Triton's key even at its default value: a node that sets it misses."""
    path, _ = cache
    code = f"from prewarm.node.willhit import check; r = check({str(TOY)!r}, {str(path)!r}); print(r.hits, r.misses)"
    out = subprocess.run([sys.executable, "-c", code], env={**ENV, "TRITON_DEFAULT_FP_FUSION": "1"}, check=True,
                         capture_output=True, text=True).stdout
    assert out.split() == ["0", "11"]


@pytest.mark.parametrize("where,hits", [("end", 11), ("top", 0)])
def test_a_node_must_run_the_kernel_source_the_cache_was_built_from_line_for_line(cache, tmp_path, where, hits):
    """Triton's key holds each kernel's source and its first line number: a line added at the end of the kernel
    module changes no key, the same line at its top moves every kernel below it, and every one of them misses (a
    bundle serves exactly the kernel source it was built from, down to a docstring line above a kernel)."""
    path, _ = cache
    pkg = tmp_path / "prewarm_toy"
    shutil.copytree(FIXTURES / "prewarm_toy", pkg)
    src = (pkg / "kernels.py").read_text()
    (pkg / "kernels.py").write_text(src + "# a comment\n" if where == "end" else "# a comment\n" + src)
    code = f"from prewarm.node.willhit import check; r = check({str(TOY)!r}, {str(path)!r}); print(r.hits, r.misses)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True,
                         capture_output=True, text=True).stdout
    assert out.split() == [str(hits), str(11 - hits)]


def test_a_copied_cache_whose_groups_point_back_misses(cache, tmp_path):
    path, _ = cache
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    report = check(str(TOY), str(copy))
    assert report.misses == 11 and all("points outside its entry" in r.detail for r in report.results)


def test_an_incomplete_entry_is_a_miss(cache, tmp_path):
    path, keys = cache
    cubin = path / keys["decode bs=1"] / "decode_kernel.cubin"
    saved = cubin.read_bytes()
    cubin.unlink()
    try:
        (miss,) = [r for r in check(str(TOY), str(path)).results if not r.hit]
        assert miss.label == "decode bs=1" and "missing decode_kernel.cubin" in miss.detail
    finally:
        cubin.write_bytes(saved)


def test_deleting_one_entry_names_exactly_it_and_a_rebuild_restores_it(cache):
    path, keys = cache
    shutil.rmtree(path / keys["prefill scale [BLOCK=64 warps=2 stages=3]"])
    report = check(str(TOY), str(path))
    (miss,) = [r for r in report.results if not r.hit]
    assert (miss.label, miss.kernel, miss.key) == ("prefill scale [BLOCK=64 warps=2 stages=3]",
                                                   "prewarm_toy.kernels:scale_kernel",
                                                   keys["prefill scale [BLOCK=64 warps=2 stages=3]"])
    assert report.hits == 10 and not report.ok
    assert report.to_json()["misses"] == 1 and report.to_json()["ok"] is False
    # what a person runs before serving: the verify command names the miss (brackets and all) and exits 5
    cli = subprocess.run([sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(path), "--plan", str(TOY)],
                         env={**ENV, "COLUMNS": "300"}, capture_output=True, text=True)
    assert cli.returncode == 5, cli.stderr
    (row,) = [line for line in cli.stdout.splitlines() if "MISS" in line]
    assert "prefill scale [BLOCK=64 warps=2 stages=3]" in row and keys["prefill scale [BLOCK=64 warps=2 stages=3]"] in row
    # the full tables on an 80-column terminal: cells fold instead of being cut, the label and the key stay whole
    narrow = subprocess.run([sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(path), "--plan",
                             str(TOY), "--details"], env={**ENV, "COLUMNS": "80"}, capture_output=True, text=True)
    cells = [line.split("│") for line in narrow.stdout.splitlines() if line.startswith("│")]
    label_col, key_col = ("".join(c[i].strip() for c in cells if len(c) == 7) for i in (1, 3))
    assert "…" not in narrow.stdout
    assert "prefillscale[BLOCK=64warps=2stages=3]" in label_col.replace(" ", "")  # wrapping drops the spaces
    assert keys["prefill scale [BLOCK=64 warps=2 stages=3]"] in key_col
    rebuilt = build(TOY, path, workers=1, mode="offline")
    assert (rebuilt.count("compiled"), rebuilt.count("present")) == (1, 10)
    assert check(str(TOY), str(path)).ok


TUNED = FIXTURES / "toy-autotune.toml"


def test_autotune_results_the_runtime_keeps_are_found_and_absent_ones_named(tmp_path):
    """An autotuned call's kept result (``<kernel>.autotune.json``, written by Triton's own Autotuner at runtime)
    is found under the key the plan predicts; an offline build has none, and --require-autotune fails on that."""
    build(TUNED, tmp_path, workers=1, mode="offline")
    before = files(tmp_path)
    report = check(str(TUNED), str(tmp_path))
    assert report.ok and report.hits == 4  # 2 configs x 2 tuning keys (n), all compiled
    assert [(a.label, a.present, a.configs) for a in report.autotune] == [("gain n=1000", False, 2),
                                                                          ("gain n=4096", False, 2)]
    assert all("the node benchmarks 2 configs" in a.detail for a in report.autotune)
    assert files(tmp_path) == before  # probing created nothing

    verify_cli = [sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(tmp_path), "--plan", str(TUNED)]
    assert subprocess.run(verify_cli, env=ENV, capture_output=True).returncode == 0  # informational by default
    strict = subprocess.run(verify_cli + ["--require-autotune"], env={**ENV, "COLUMNS": "300"},
                            capture_output=True, text=True)
    assert strict.returncode == 5 and "0 kept, 2 absent" in strict.stdout

    # a server's call on real tensors (n=1000): Triton's Autotuner writes its result where the probe looks
    subprocess.run([sys.executable, "-m", "prewarm_toy.tune", str(tmp_path), "1000"], env=ENV, check=True,
                   capture_output=True)
    report = check(str(TUNED), str(tmp_path))
    (kept,) = [a for a in report.autotune if a.present]
    assert kept.label == "gain n=1000" and kept.detail == "kept: BLOCK=128 warps=4 stages=3"
    assert (tmp_path / kept.key / "gain_kernel.autotune.json").is_file()

    subprocess.run([sys.executable, "-m", "prewarm_toy.tune", str(tmp_path), "4096"], env=ENV, check=True,
                   capture_output=True)
    assert subprocess.run(verify_cli + ["--require-autotune"], env=ENV, capture_output=True).returncode == 0


def test_require_autotune_needs_a_plan(tmp_path):
    p = subprocess.run([sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(tmp_path),
                        "--require-autotune"], env=ENV, capture_output=True, text=True)
    assert p.returncode == 2 and "--require-autotune needs --plan" in p.stderr


def test_an_absent_launcher_is_named_and_informational(cache, tmp_path):
    """A launcher missing from the cache (a cache built before launchers were prebuilt, or pruned; 3.8: cuda_utils,
    the one every kernel launches through) is named with the number of planned compiles that need it; the kernels
    still hit, so verify stays clean."""
    path, _ = cache
    report = check(str(TOY), str(path))
    name = "__triton_launcher" if tritoncompat.release().cuda_launchers == "per-signature" else "cuda_utils"
    launcher = max((m for m in report.modules if m.name == name), key=lambda m: m.kernels)
    n = len(report.modules)
    shutil.move(path / launcher.key, tmp_path / launcher.key)
    try:
        after = check(str(TOY), str(path))
        assert after.ok and after.hits == 11
        assert [(m.key, m.kernels) for m in after.modules if not m.present] == [(launcher.key, launcher.kernels)]
        cli = subprocess.run([sys.executable, "-m", "prewarm.cli", "verify", "--cache-dir", str(path), "--plan",
                              str(TOY)], env={**ENV, "COLUMNS": "300"}, capture_output=True, text=True)
        assert cli.returncode == 0 and f"{n - 1} of {n} in the cache" in cli.stdout and launcher.key in cli.stdout
    finally:
        shutil.move(tmp_path / launcher.key, path / launcher.key)
