"""`prewarm ls`: what a node's cache dir holds, as an operator asks it before trusting or cleaning the dir."""
from __future__ import annotations

import json
import shutil

from prewarm.shipping.pack import pack
from prewarm.shipping.install import install
from prewarm.shipping.scan import scan

from prewarm_helpers import run_cli, synthetic_cache


def test_two_bundles_and_the_entries_no_bundle_installed(triton_cache, tmp_path):
    node = tmp_path / "node"
    pack(triton_cache, tmp_path / "toy")
    install(str(tmp_path / "toy"), node)
    synthetic_cache(tmp_path / "synthetic", entries=3)
    pack(tmp_path / "synthetic", tmp_path / "syn")
    install(str(tmp_path / "syn"), node)
    jit = node / "RUNTIMECOMPILEDKEY"  # what the runtime writes when it compiles on the node
    jit.mkdir()
    (jit / "k.cubin").write_bytes(b"\0" * 1000)
    removed = sorted(p for p in node.iterdir() if p.name != ".prewarm")[0]
    shutil.rmtree(removed)

    r = scan(node)
    assert sorted((b.source, b.entries) for b in r.bundles) == [(str(tmp_path / "syn"), 3), (str(tmp_path / "toy"), 5)]
    assert sum(b.entries - b.entries_present for b in r.bundles) == 1  # the removed one, under its bundle
    assert [(e.key, e.files, e.bytes) for e in r.other_entries] == [("RUNTIMECOMPILEDKEY", 1, 1000)]
    assert r.toolchain is None  # CUDA: Triton's own key covers the toolchain, no claim is written

    doc = json.loads(run_cli("ls", "--cache-dir", node, "--json").stdout)
    assert doc == json.loads(json.dumps(r.to_json()))
    text = run_cli("ls", "--cache-dir", node).stdout
    assert "1 entries no bundle installed" in text and "RUNTIMECOMPILEDKEY" in text


def test_a_missing_cache_dir_is_named(tmp_path):
    p = run_cli("ls", "--cache-dir", tmp_path / "nope", check=6)
    assert f"{tmp_path / 'nope'}: cache dir does not exist" in p.stderr
