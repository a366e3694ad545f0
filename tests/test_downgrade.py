"""Bundles carry their build's sequence inside the signed index (issue 57): a node refuses an older build of a bundle
name than the one it last installed (exit 15, both sequences named) unless --allow-downgrade, after which the older
build is the latest; the sequence cannot be edited under a signature; an index without one (packed before
sequences) is sequence 0; pack's default is the build's time, so the same dir packs to the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from prewarm.errors import DowngradeRefused, SignatureError
from prewarm.node import fingerprint
from prewarm.shipping.bundle import INDEX, Index, parse_index
from prewarm.shipping.cachedir import CacheDir
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.signing import keygen

from prewarm_helpers import run_cli, synthetic_cache


def build(root: Path, name: str, seed: int) -> Path:
    src = synthetic_cache(root, 3, seed=seed, scale=0.01)
    CacheDir(src).write_build_info({"fingerprint": fingerprint.current(), "manifest": {"name": name, "digest": "ab"}})
    return src


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("downgrade")
    _, pub, _ = keygen(root / "signer")
    src = build(root / "build", "kda", 5)
    for seq in (3, 5):
        pack(src, root / f"v{seq}", signing_key=root / "signer.key", sequence=seq)
    pack(build(root / "other-build", "other", 6), root / "other", sequence=1)
    return {"root": root, "pub": str(pub), "v3": root / "v3", "v5": root / "v5", "other": root / "other"}


def receipts(node: Path) -> dict[str, int]:
    return {r.digest: r.seq for r in CacheDir(node).receipts()}


def test_an_older_build_is_refused_unless_allowed_and_then_it_is_the_latest(world, tmp_path):
    node, trust = tmp_path / "node", {"trusted_keys": [world["pub"]], "durable": False}
    install(str(world["v5"]), node, **trust)
    before = receipts(node)
    p = run_cli("install", world["v3"], "--cache-dir", node, "--trust", world["pub"], check=DowngradeRefused.exit_code)
    assert "'kda' sequence 3 is older than sequence 5" in p.stderr and "--allow-downgrade" in p.stderr, p.stderr
    assert receipts(node) == before and "Traceback" not in p.stderr
    install(str(world["v3"]), node, allow_downgrade=True, **trust)  # a rollback, on purpose
    install(str(world["v3"]), node, **trust)  # it is the latest now: every restart passes
    assert install(str(world["other"]), node, durable=False).installed == 3  # another name: not compared
    assert not install(str(world["v5"]), node, **trust).noop  # the newer build goes on again, as the latest
    seq = receipts(node)
    assert seq[hashlib.sha256((world["v5"] / INDEX).read_bytes()).hexdigest()] == max(seq.values())
    with pytest.raises(DowngradeRefused):
        install(str(world["v3"]), node, **trust)


def _reindexed(src: Path, out: Path, **change) -> Path:
    """A copy of bundle ``src`` whose index is rebuilt with ``change`` (checksum recomputed, signature kept)."""
    shutil.copytree(src, out)
    index = parse_index((src / INDEX).read_bytes(), "t")
    fields = {"fingerprint": index.fingerprint, "manifest": index.manifest, "entries": index.entries,
              "layout": index.layout, "sequence": index.sequence, **change}
    (out / INDEX).write_bytes(Index(**fields).to_bytes())
    return out


def test_the_sequence_is_signed(world, tmp_path):
    """A later sequence written into a signed index: the signature no longer verifies, with or without --trust."""
    forged = _reindexed(world["v3"], tmp_path / "forged", sequence=9)
    for trust in ([], [world["pub"]]):
        with pytest.raises(SignatureError, match="does not verify"):
            install(str(forged), tmp_path / "node", trusted_keys=trust)
        assert not (tmp_path / "node").exists()


def test_an_index_without_a_sequence_is_sequence_0(world, tmp_path):
    old = _reindexed(world["v5"], tmp_path / "old", sequence=None)
    (old / "index.json.sig").unlink()
    assert b'"sequence"' not in (old / INDEX).read_bytes()
    install(str(world["v5"]), tmp_path / "a", durable=False)
    with pytest.raises(DowngradeRefused, match="sequence 0 is older than sequence 5"):
        install(str(old), tmp_path / "a", durable=False)
    install(str(old), tmp_path / "b", durable=False)  # before any sequenced build: installs, and so does the next
    assert install(str(world["v5"]), tmp_path / "b", durable=False).present == 3


def test_the_default_sequence_is_the_builds_time_and_packs_the_same_bytes(tmp_path):
    src = build(tmp_path / "build", "kda", 7)
    files = [p for p in src.rglob("*") if p.is_file()]
    for i, path in enumerate(files):
        os.utime(path, (1_700_000_000, 1_700_000_000 + i))
    newest = 1_700_000_000 + len(files) - 1
    a, b = pack(src, tmp_path / "a"), pack(src, tmp_path / "b")
    assert a.index.sequence == newest and (tmp_path / "a" / INDEX).read_bytes() == (tmp_path / "b" / INDEX).read_bytes()
    doc = json.loads(run_cli("pack", src, "-o", tmp_path / "c", "--sequence", "42", "--json").stdout)
    assert doc["sequence"] == 42 and parse_index((tmp_path / "c" / INDEX).read_bytes(), "t").sequence == 42
