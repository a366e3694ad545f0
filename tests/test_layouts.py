"""Bundles past Triton (issue 41): a dir of sglang's JIT cache layout and one of FlashInfer's AOT layout
(prewarm.shipping.layouts) packed, signed, installed, verified and listed through the real CLI, with the guarantees a Triton
cache dir has: hostile keys refused by the reader, an interrupted install leaving no half leaf, a dir of another
layout refused, a second install a no-op.

The dirs are shaped as sglang 0.5.23 and FlashInfer 0.7.2 write them (sglang/kernels/jit/utils/compile/cache.py: a
leaf holding ``sgl_deps.json`` and ``<module>.so``, sglang's own ``.lock`` and ``.staging-<uuid>`` beside it); the
``.so`` files are stand-in bytes: no bundle code reads them, and the library's own lookup is prewarm.jit's to test.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm.shipping import layouts
from prewarm.shipping.bundle import INDEX, OBJECTS, Entry, Index, parse_index
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import EnvironmentProblem, FingerprintMismatch, IntegrityError, UnsafeBundleError
from prewarm.shipping.nodestamp import jit_node_factors
from prewarm.shipping.signing import keygen

from prewarm_helpers import run_cli, synthetic_cache

MODULES = ("sgl_kernel_jit_kda_packed_decode_8_8_true", "sgl_kernel_jit_rmsnorm_bf16")


def hex16(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sglang_dir(root: Path) -> list[str]:
    """A sglang JIT cache of two modules, as sglang's publication leaves it; returns the leaves' keys."""
    layouts.mark(root, "sglang-jit")
    keys = []
    for module in MODULES:
        scope = root / "sm90a" / module / f"build-{hex16(module)}"
        leaf = scope / f"deps-{hex16(module + 'deps')}"
        leaf.mkdir(parents=True)
        # a leaf is sglang's ninja build dir, renamed: its sources, build file, objects, ninja's log, the module
        (leaf / "sgl_deps.json").write_text(json.dumps([["kernels", f"csrc/{module}.cuh", "ab" * 32]]))
        (leaf / "build.ninja").write_text(f"build {module}.so: link wrapper_0.o\n")
        (leaf / "wrapper_0.o").write_bytes(b"\x7fELF object")
        (leaf / ".ninja_log").write_text("# ninja log v6\n")
        (leaf / f"{module}.so").write_bytes(b"\x7fELF" + module.encode() * 64)
        (leaf / f"{module}.so").chmod(0o755)
        (scope / ".lock").write_text("")  # sglang's build lock
        (scope / ".staging-0f1e").mkdir()  # a build in progress: not an entry, never packed
        (scope / ".staging-0f1e" / f"{module}.so").write_bytes(b"half")
        keys.append(leaf.relative_to(root).as_posix())
    # what the builder records: the library's factors (this box's, so that this node's check agrees)
    CacheDir(root).write_build_info({"fingerprint": jit_node_factors(layouts.get("sglang-jit")),
                                     "manifest": {"name": "kda", "digest": "cd" * 32}})
    return keys


def leaf_files(root: Path) -> dict[str, tuple[str, int]]:
    """Every file of every entry a bundle ships (no ``.prewarm``, no sglang bookkeeping, no build leftover pack
    leaves out: prewarm.shipping.payload): its sha256 and mode."""
    cache = CacheDir(root)
    keys, _ = cache.entries()
    return {f"{key}/{p.name}": (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode & 0o777)
            for key in keys for p in sorted((root / key).iterdir())
            if not cache.layout.leftovers.fullmatch(p.name)}


def everything(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and META not in p.relative_to(root).parts}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    _, pub, _ = keygen(root / "signer")
    keys = sglang_dir(root / "sglang-build")
    doc = json.loads(run_cli("pack", root / "sglang-build", "-o", root / "sglang", "--sign", root / "signer.key",
                             "--json").stdout)
    assert (doc["layout"], doc["entries"], doc["skipped"]) == ("sglang-jit", 2, [])  # .lock, .staging-*: sglang's
    assert len(doc["left_out"]) == 6  # each leaf's build.ninja, object and ninja log: no loader reads them
    return {"root": root, "pub": str(pub), "keys": keys, "bundle": root / "sglang"}


def test_a_sglang_jit_dir_packs_signs_installs_into_the_dir_sglang_reads_and_verifies(world, tmp_path):
    bundle, pub = world["bundle"], world["pub"]
    index = parse_index((bundle / INDEX).read_bytes(), "t")
    assert index.layout == "sglang-jit" and [e.key for e in index.entries] == sorted(world["keys"])
    assert {f.path for e in index.entries for f in e.files} == {"sgl_deps.json"} | {f"{m}.so" for m in MODULES}
    node = tmp_path / "jit"
    env = {**os.environ, "SGLANG_JIT_CACHE_DIR": str(node)}  # no --cache-dir: the dir sglang reads
    out = run_cli("install", bundle, "--trust", pub, "--require-signature", env=env).stdout
    assert f"{node}: installed 2 entries" in out and "signed by" in out
    assert leaf_files(node) == leaf_files(world["root"] / "sglang-build")  # bytes and modes, at sglang's paths
    assert not list(node.rglob(".staging-*")) and not list(node.rglob(".lock"))
    assert (node / META / "layout").read_text() == "sglang-jit\n" and not CacheDir(node).staging_dirs()
    before = {p: p.stat().st_mtime_ns for p in node.rglob("*")}
    out = run_cli("install", bundle, "--cache-dir", node, "--trust", pub, env=env).stdout  # the node's environment
    assert "already installed (2 entries), nothing to do" in out
    assert {p: p.stat().st_mtime_ns for p in node.rglob("*")} == before

    doc = json.loads(run_cli("verify", "--cache-dir", node, "--trust", pub, "--require-signature", "--json").stdout)
    assert doc["ok"] and doc["layout"] == "sglang-jit"
    assert (doc["entries"], doc["entries_ok"], doc["files"]) == (2, 2, 4)
    # a module the node built itself: listed, not judged; in the signed mode unverified
    own = node / "sm90a" / "sgl_kernel_jit_other" / f"build-{hex16('o')}" / f"deps-{hex16('od')}"
    own.mkdir(parents=True)
    (own / "sgl_kernel_jit_other.so").write_bytes(b"built here")
    scan = json.loads(run_cli("ls", "--cache-dir", node, "--json").stdout)
    assert scan["layout"] == "sglang-jit" and [b["entries_present"] for b in scan["bundles"]] == [2]
    assert [e["key"] for e in scan["other_entries"]] == [own.relative_to(node).as_posix()]
    doc = json.loads(run_cli("verify", "--cache-dir", node, "--trust", pub, "--require-signature", "--json",
                             check=13).stdout)
    assert [u["key"] for u in doc["unverified"]] == [own.relative_to(node).as_posix()] and doc["integrity_ok"]
    so = node / world["keys"][0] / f"{MODULES[0]}.so"
    so.write_bytes(so.read_bytes()[:-1] + b"!")  # an installed module changed
    doc = json.loads(run_cli("verify", "--cache-dir", node, "--json", check=IntegrityError.exit_code).stdout)
    assert doc["modified"] == [f"{world['keys'][0]}/{MODULES[0]}.so"]


def test_a_flashinfer_aot_dir_is_installed_only_into_a_dir_given(tmp_path):
    src = tmp_path / "aot"
    layouts.mark(src, "flashinfer-aot")
    for name in ("sampling", "norm"):
        (src / name).mkdir()
        (src / name / f"{name}.so").write_bytes(b"\x7fELF" + name.encode() * 100)  # native code, or refused
    doc = json.loads(run_cli("pack", src, "-o", tmp_path / "b", "--json").stdout)
    assert (doc["layout"], doc["entries"]) == ("flashinfer-aot", 2)
    p = run_cli("install", tmp_path / "b", check=2)  # FlashInfer's AOT dir is inside its package: no default
    assert "--cache-dir" in p.stderr and "flashinfer-aot" in p.stderr and "Traceback" not in p.stderr
    node = tmp_path / "site-packages" / "flashinfer" / "data" / "aot"
    run_cli("install", tmp_path / "b", "--cache-dir", node)
    assert everything(node) == everything(src)
    assert json.loads(run_cli("verify", "--cache-dir", node, "--json").stdout)["ok"]


def forged(bundle: Path, out: Path, edit) -> Path:
    """A copy of ``bundle`` whose index ``edit`` rewrote (checksum recomputed, unsigned): what an attacker can make."""
    out.mkdir()
    os.symlink(bundle / OBJECTS, out / OBJECTS)
    index = parse_index((bundle / INDEX).read_bytes(), "t")
    (out / INDEX).write_bytes(edit(index).to_bytes())
    return out


def rekeyed(key: str):
    """An index whose first entry is under ``key``."""
    def edit(index: Index) -> Index:
        first = index.entries[0]
        entry = Entry(key, first.object, first.object_size, first.tar_size, first.files)
        return Index(index.fingerprint, index.manifest, (entry,) + index.entries[1:], layout=index.layout)

    return edit


@pytest.mark.parametrize("key", [
    "../x", "/etc/sm90a/sgl_kernel_jit_x/build-0123456789abcdef/deps-0123456789abcdef",
    "sm90a//sgl_kernel_jit_x/build-0123456789abcdef/deps-0123456789abcdef",
    "sm90a/sgl_kernel_jit_x/../build-0123456789abcdef/deps-0123456789abcdef",
    "sm90a/sgl_kernel_jit_x/build-0123456789abcdef/deps-0123456789abcdef/",
    "sm90a/sgl_kernel_jit_x/build-0123456789abcdef",  # a build dir, not a leaf
    "A" * 52,  # a Triton key: not a key of this layout
])
def test_a_key_outside_the_layout_is_refused_by_the_reader(world, tmp_path, key):
    node = tmp_path / "node"
    bad = forged(world["bundle"], tmp_path / "bad", rekeyed(key))
    p = run_cli("install", bad, "--cache-dir", node, check=UnsafeBundleError.exit_code)
    assert "is not a key of the sglang-jit layout" in p.stderr and "Traceback" not in p.stderr
    assert not node.exists() or everything(node) == {}


def test_an_unknown_layout_and_a_tampered_object_are_refused(world, tmp_path):
    node = tmp_path / "node"
    bogus = forged(world["bundle"], tmp_path / "bogus", lambda i: Index(i.fingerprint, i.manifest, i.entries,
                                                                       layout="triton-ish"))
    p = run_cli("install", bogus, "--cache-dir", node, check=UnsafeBundleError.exit_code)
    assert "malformed index: layout 'triton-ish' is not one this prewarm reads" in p.stderr
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", world["bundle"], tampered], check=True)
    obj = sorted((tampered / OBJECTS).iterdir())[1]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 1
    obj.write_bytes(bytes(data))
    p = run_cli("install", tampered, "--cache-dir", node, check=IntegrityError.exit_code)
    assert "corrupted or tampered" in p.stderr
    assert everything(node) == {} and not CacheDir(node).staging_dirs()  # the intact entry was not placed either


_KILLED = """
import os, signal, sys
from prewarm.shipping import install
point = getattr(install, sys.argv[3])
def then_killed(*args, **kwargs):
    point(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # the whole install (its workers are threads here: 2 entries)
setattr(install, sys.argv[3], then_killed)
install.install(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("point", ["unpack_object", "_place_entry"])
def test_an_install_killed_leaves_each_leaf_complete_or_absent_and_a_rerun_finishes(world, tmp_path, point):
    """SIGKILL right after the first entry was staged (nothing placed yet) or placed (one leaf renamed in): every
    leaf in the dir is complete, none half written; a rerun installs the rest and verifies clean."""
    node, src = tmp_path / "node", world["root"] / "sglang-build"
    p = subprocess.run([sys.executable, "-c", _KILLED, str(world["bundle"]), str(node), point], capture_output=True)
    assert p.returncode == -9, p.stderr
    placed = leaf_files(node)
    assert len({k.rsplit("/", 1)[0] for k in placed}) == (1 if point == "_place_entry" else 0)
    assert all(leaf_files(src)[k] == v for k, v in placed.items())  # a leaf there is whole
    out = run_cli("install", world["bundle"], "--cache-dir", node).stdout
    assert f"installed {1 if placed else 2} entries" in out and not CacheDir(node).staging_dirs()
    assert leaf_files(node) == leaf_files(src)
    assert json.loads(run_cli("verify", "--cache-dir", node, "--json").stdout)["ok"]


def test_a_bundle_of_another_layout_is_refused_naming_both(world, tmp_path):
    run_cli("pack", synthetic_cache(tmp_path / "triton-build", 2, scale=0.01), "-o", tmp_path / "tb")
    assert b'"layout"' not in (tmp_path / "tb" / INDEX).read_bytes()  # a Triton index is as before layouts
    triton_node, jit_node = tmp_path / "triton", tmp_path / "jit"
    run_cli("install", tmp_path / "tb", "--cache-dir", triton_node)
    run_cli("install", world["bundle"], "--cache-dir", jit_node)
    for bundle, node, stated, other in ((world["bundle"], triton_node, "triton", "sglang-jit"),
                                        (tmp_path / "tb", jit_node, "sglang-jit", "triton")):
        before = everything(node)
        p = run_cli("install", bundle, "--cache-dir", node, check=EnvironmentProblem.exit_code)
        assert f"is a {stated} cache dir" in p.stderr and f"refusing to put {other} entries" in p.stderr
        assert everything(node) == before
    p = run_cli("verify", "--cache-dir", jit_node, "--bundle", tmp_path / "tb", check=IntegrityError.exit_code)
    assert "is a triton bundle" in p.stderr and "a sglang-jit cache dir" in p.stderr


def test_a_link_in_a_leafs_path_is_never_followed(world, tmp_path):
    """The target dir is a link (to a dir the install must not write into): refused, nothing written there."""
    node, elsewhere = tmp_path / "node", tmp_path / "elsewhere"
    node.mkdir()
    elsewhere.mkdir()
    (node / "sm90a").symlink_to(elsewhere)
    p = run_cli("install", world["bundle"], "--cache-dir", node, check=EnvironmentProblem.exit_code)
    assert "its parent 'sm90a' is a link or a file, never followed" in p.stderr and "Traceback" not in p.stderr
    assert list(elsewhere.iterdir()) == []


def test_the_node_check_compares_the_layouts_own_factors(world, tmp_path):
    """A bundle past Triton is judged by this node's factors for its layout, not Triton's: one its build recorded
    that this node does not have is a gap (exit 8, named), Triton's factors the bundle lacks are no concern."""
    src = tmp_path / "build"
    subprocess.run(["cp", "-r", world["root"] / "sglang-build", src], check=True)
    CacheDir(src).write_build_info({"fingerprint": {**jit_node_factors(layouts.get("sglang-jit")),
                                                    "test.built-elsewhere": "a toolchain no node has"}})
    run_cli("pack", src, "-o", tmp_path / "b")
    p = run_cli("install", tmp_path / "b", "--cache-dir", tmp_path / "node", check=FingerprintMismatch.exit_code)
    assert "test.built-elsewhere" in p.stderr and "triton" not in p.stderr.split("refusing")[1]
    assert not (tmp_path / "node").exists()  # refused before anything was written
    out = run_cli("install", tmp_path / "b", "--cache-dir", tmp_path / "node", "--allow-missing-factors").stdout
    assert "installed 2 entries" in out
