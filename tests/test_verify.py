"""verify: a cache dir against its receipts or a bundle; modified / missing / unexpected / groups outside."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from prewarm.shipping.pack import pack
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import FingerprintMismatch, IntegrityError
from prewarm.shipping.install import install
from prewarm.node.verify import verify

from prewarm_helpers import run_cli, synthetic_cache


@pytest.fixture
def node(triton_cache, tmp_path):
    pack(triton_cache, tmp_path / "bundle")
    install(str(tmp_path / "bundle"), tmp_path / "node")
    return tmp_path / "node"


def _entry_files(node, suffix):
    return sorted(p for p in node.glob(f"*/*{suffix}"))


def test_clean_after_install_and_cli_table_and_json(node):
    r = verify(node)
    assert r.ok and r.exit_code == 0 and r.entries == r.entries_ok == 5 and r.files == 40
    assert {f.factor for f in r.factors} >= {"triton.key", "python.abi", "cuda.ptxas", "torch.version"}
    assert {f.status for f in r.factors} <= {"ok", "unchecked"} and r.compatible  # no device here: arch unknown
    env = dict(os.environ, COLUMNS="200")
    table = run_cli("verify", "--cache-dir", node, "--details", env=env).stdout
    assert "entries ok" in table and "5/5" in table and "clean" in table and "triton.key" in table
    summary = run_cli("verify", "--cache-dir", node, env=env).stdout.splitlines()
    assert summary[1].split()[:3] == ["integrity", "ok", "5/5"] and summary[-1] == "clean"
    doc = json.loads(run_cli("verify", "--cache-dir", node, "--json").stdout)
    assert doc["ok"] and doc["exit_code"] == 0 and doc["modified"] == []


def test_modified_missing_unexpected_are_named_with_exit_code(node):
    cubin = _entry_files(node, ".cubin")[0]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    ptx = _entry_files(node, ".ptx")[1]
    ptx.unlink()
    (node / cubin.parent.name / "evil.so").write_bytes(b"\x7fELF")
    r = verify(node)
    rel = lambda p: p.relative_to(node).as_posix()  # noqa: E731
    assert r.modified == [rel(cubin)] and r.missing == [rel(ptx)]
    assert r.unexpected == [f"{cubin.parent.name}/evil.so"]
    assert r.entries_ok == 3 and not r.ok and r.exit_code == IntegrityError.exit_code
    p = run_cli("verify", "--cache-dir", node, "--json", check=IntegrityError.exit_code)
    assert json.loads(p.stdout)["modified"] == [rel(cubin)]


def test_foreign_entries_are_counted_not_failed(node):
    synthetic_cache(node, 2, seed=11)
    r = verify(node)
    assert r.ok and r.other_entries == 2


def test_group_pointing_outside_the_dir_is_reported(node, tmp_path):
    grp = sorted(node.glob("*/__grp__*.json"))[0]
    doc = json.loads(grp.read_text())
    child = sorted(doc["child_paths"])[0]
    doc["child_paths"][child] = str(tmp_path / "old-build-box" / grp.parent.name / "elsewhere.cubin")
    grp.write_text(json.dumps(doc))
    # a foreign entry whose group still points at the dir it was copied from
    foreign = synthetic_cache(tmp_path / "elsewhere", 1, seed=4)
    key = next(iter(os.listdir(foreign)))
    os.rename(foreign / key, node / key)
    fgrp = next((node / key).glob("__grp__*.json"))
    fdoc = json.loads(fgrp.read_text())
    fdoc["child_paths"] = {c: f"/nonexistent/{c}" for c in fdoc["child_paths"]}
    fgrp.write_text(json.dumps(fdoc))
    r = verify(node)
    assert any(g.startswith(f"{grp.parent.name}/{grp.name} -> ") and "old-build-box" in g for g in r.groups_outside)
    assert any(g.startswith(f"{key}/{fgrp.name} -> /nonexistent/") for g in r.groups_outside)
    assert r.exit_code == IntegrityError.exit_code


def test_copied_cache_whose_groups_still_read_the_old_dir_is_reported(node, tmp_path):
    shutil.copytree(node, tmp_path / "copy")  # node still exists: Triton would silently read node's files
    r = verify(tmp_path / "copy")
    assert not r.ok and r.exit_code == IntegrityError.exit_code and not r.modified
    children = sum(len(json.loads(g.read_text())["child_paths"]) for g in node.glob("*/__grp__*.json"))
    assert len(r.groups_outside) == children and all(f"-> {node}/" in g for g in r.groups_outside)


def test_fingerprint_mismatch_rows_explain_each_factor(triton_cache, tmp_path):
    from prewarm.node import fingerprint

    fp = dict(fingerprint.current(), **{"triton.key": "0" * 64, "torch.version": "2.9.0"})
    CacheDir(triton_cache).write_build_info({"fingerprint": fp})
    pack(triton_cache, tmp_path / "b")
    install(str(tmp_path / "b"), tmp_path / "n", allow_fingerprint_mismatch=True)
    r = verify(tmp_path / "n")
    rows = {f.factor: f for f in r.factors}
    assert rows["triton.key"].status == "mismatch" and "every key differs" in rows["triton.key"].why
    assert rows["torch.version"].status == "differs"  # informational only
    assert r.integrity_ok and not r.compatible and r.exit_code == FingerprintMismatch.exit_code
    env = dict(os.environ, COLUMNS="250")
    p = run_cli("verify", "--cache-dir", tmp_path / "n", env=env, check=FingerprintMismatch.exit_code)
    assert "triton.key" in p.stdout and "mismatch" in p.stdout


def test_verify_against_a_bundle_and_without_anything_to_compare(node, tmp_path):
    assert verify(node, bundle=str(tmp_path / "bundle")).ok
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IntegrityError, match="no install receipt"):
        verify(empty)


def test_plan_renders_will_hit_and_misses_set_the_exit_code(node, capsys):
    """`verify --plan`: the will-hit check (prewarm.node.willhit) runs after integrity; a miss is exit 5."""
    from prewarm.cli import main
    from prewarm.errors import WillMissError

    manifest = Path(__file__).resolve().parents[1] / "manifests" / "kimi-linear-h200.toml"
    code = main(["verify", "--cache-dir", str(node), "--plan", str(manifest), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == doc["exit_code"] == WillMissError.exit_code and not doc["ok"]
    assert doc["integrity_ok"] and doc["will_hit"]["misses"] > 0  # the toy cache holds none of the KDA kernels


# --- verify fails closed (issue 13) -----------------------------------------------------------------------------


def test_an_unreadable_receipt_is_an_error_naming_it_even_when_another_is_fine(node, tmp_path):
    other = synthetic_cache(tmp_path / "other", 1, seed=3)
    pack(other, tmp_path / "other-bundle")
    install(str(tmp_path / "other-bundle"), node)
    receipts = sorted(CacheDir(node).receipts_dir.glob("*.json"))
    assert len(receipts) == 2
    data = bytearray(receipts[0].read_bytes())
    data[len(data) // 3] ^= 0x01  # one flipped byte
    receipts[0].write_bytes(bytes(data))
    cubin = sorted(node.glob("*/*.cubin"))[0]
    cubin.write_bytes(cubin.read_bytes()[:-1] + b"X")  # and a modified binary it would have caught
    r = verify(node)  # reported with the rest, not instead of it
    assert [t for t in r.tampered_receipts if receipts[0].name in t] and r.exit_code == IntegrityError.exit_code
    if cubin.parent.name in json.loads(receipts[1].read_bytes())["entries"]:  # the intact receipt still covers it
        assert r.modified == [cubin.relative_to(node).as_posix()]
    else:  # no receipt that holds up covers it now
        assert cubin.parent.name in {u.key for u in r.unverified}
    p = run_cli("verify", "--cache-dir", node, check=IntegrityError.exit_code)
    assert f"tampered receipt: install receipt {receipts[0]}" in p.stdout and "Traceback" not in p.stderr


def test_no_receipt_is_integrity_unknown_unless_a_bundle_or_the_build_info_says_what_the_dir_is(node, tmp_path):
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "kimi-linear-h200.toml"
    cubin = sorted(node.glob("*/*.cubin"))[0]
    cubin.write_bytes(cubin.read_bytes()[:-1] + b"X")
    shutil.rmtree(CacheDir(node).receipts_dir)
    p = run_cli("verify", "--cache-dir", node, "--plan", manifest, check=IntegrityError.exit_code)
    assert "integrity unknown" in p.stderr  # was exit 0 (then 5 for the plan) with a modified cubin
    r = verify(node, bundle=str(tmp_path / "bundle"))
    assert r.modified == [cubin.relative_to(node).as_posix()]
    CacheDir(node).write_build_info({"manifest": {"name": "toy"}})  # a build's output dir
    r = verify(node)
    assert r.integrity_ok and r.entries == 0 and "build-info.json" in r.against[0]


def test_links_fifos_and_tmp_leftovers_inside_entries_are_reported_never_a_traceback(node):
    key_dirs = sorted(p for p in node.iterdir() if p.name != META)
    cubin = next(key_dirs[0].glob("*.cubin"))
    cubin.unlink()
    cubin.symlink_to("/etc/passwd")  # an installed file replaced by a symlink
    ptx = next(key_dirs[1].glob("*.ptx"))
    ptx.unlink()
    os.mkfifo(ptx)  # a FIFO: verify must not hang on it
    (key_dirs[2] / "tmp.pid_123_abc").mkdir()
    (key_dirs[2] / "tmp.pid_123_abc" / "k.cubin").write_bytes(b"left by a killed process")
    (key_dirs[3] / "extra.so").symlink_to("/etc/passwd")
    r = verify(node)
    rel = lambda p: p.relative_to(node).as_posix()  # noqa: E731
    assert sorted(r.modified) == sorted([f"{rel(cubin)} (a symlink)", f"{rel(ptx)} (not a regular file)"])
    assert sorted(r.unexpected) == sorted([f"{key_dirs[2].name}/tmp.pid_123_abc/k.cubin",
                                           f"{key_dirs[3].name}/extra.so"])
    p = run_cli("verify", "--cache-dir", node, check=IntegrityError.exit_code)
    assert "Traceback" not in p.stderr


def test_verify_spread_over_processes_finds_what_one_worker_finds(tmp_path):
    """From 64 entries verify hashes in forked processes (threads share one core for the per-file Python)."""
    pack(synthetic_cache(tmp_path / "cache", 90, seed=8, scale=0.02), tmp_path / "bundle")
    node = tmp_path / "node"
    install(str(tmp_path / "bundle"), node, durable=False)
    cubins, ptxs = _entry_files(node, ".cubin"), _entry_files(node, ".ptx")
    cubins[40].write_bytes(cubins[40].read_bytes()[:-1] + b"!")
    ptxs[70].unlink()
    (ptxs[5].parent / "stray.so").write_bytes(b"x")
    reports = [verify(node, workers=w) for w in (1, 2)]
    for r in reports:
        assert r.entries == 90 and r.entries_ok == 87 and r.files == 360
        assert r.modified == [cubins[40].relative_to(node).as_posix()]
        assert r.missing == [ptxs[70].relative_to(node).as_posix()]
        assert r.unexpected == [f"{ptxs[5].parent.name}/stray.so"]
    assert reports[0].bytes_hashed == reports[1].bytes_hashed


def test_the_verdict_is_judged_in_the_library_and_the_cli_returns_it(node):
    """`verify` as a verb is one library call (prewarm.node.verdict.judge): a frozen verdict whose exit code and JSON
    are what the CLI returns and prints; a modified entry makes it the integrity error's."""
    import dataclasses

    from prewarm.node.verdict import judge

    clean = judge(node)
    assert clean.ok and clean.exit_code == 0 and clean.will_hit is None and clean.server_dirs is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        clean.exit_code = 1  # type: ignore[misc]
    cubin = _entry_files(node, ".cubin")[0]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    v = judge(node)
    assert not v.ok and v.exit_code == IntegrityError.exit_code == v.report.exit_code
    p = run_cli("verify", "--cache-dir", node, "--json", check=v.exit_code)
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == v.exit_code and doc["ok"] is False and doc == json.loads(json.dumps(v.to_json()))
