"""A refused install leaves the target as it was (issue 57): a link planted in the place of a later entry of the
bundle (a Triton key dir, FlashInfer's module dir, sglang's leaf or a parent of it) is refused before the first
rename, and a rename that fails after others went through puts them all back. Each target's whole tree (names,
kinds, modes, file bytes, link targets, ``.prewarm`` included) is the same before and after, for each layout, and
no staging dir is left. The JIT dirs are shaped as sglang 0.5.23 and FlashInfer publish them (a leaf holding
``sgl_deps.json`` and ``<module>.so``; ``<name>/<name>.so``); the modules are ELF stand-ins, never loaded.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path

import pytest

from prewarm.errors import EnvironmentProblem
from prewarm.shipping import install as install_mod
from prewarm.shipping import layouts
from prewarm.shipping.bundle import INDEX, parse_index
from prewarm.shipping.cachedir import CacheDir
from prewarm.node.verify import verify
from prewarm.shipping.install import install
from prewarm.shipping.nodestamp import jit_node_factors
from prewarm.shipping.pack import pack

from prewarm_helpers import synthetic_cache


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root``, never following a link: its kind and mode, a file's sha256, a link's target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode & 0o7777)
            else:
                out[rel] = ("file", st.st_mode & 0o7777, hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return out


def elf(tag: str) -> bytes:
    return b"\x7fELF\x02\x01\x01" + tag.encode() * 32


def sglang_build(root: Path, modules: list[str], factors: dict) -> list[str]:
    """A sglang JIT dir of ``modules``, one leaf each; its leaves' keys."""
    layouts.mark(root, "sglang-jit")
    keys = []
    for module in modules:
        h = hashlib.sha256(module.encode()).hexdigest()
        leaf = root / "sm90a" / module / f"build-{h[:16]}" / f"deps-{h[16:32]}"
        leaf.mkdir(parents=True)
        (leaf / "sgl_deps.json").write_text(json.dumps([["kernels", f"csrc/{module}.cuh", h]]))
        (leaf / f"{module}.so").write_bytes(elf(module))
        keys.append(leaf.relative_to(root).as_posix())
    CacheDir(root).write_build_info({"fingerprint": factors, "manifest": {"name": "jit", "digest": "cd" * 32}})
    return keys


def flashinfer_build(root: Path, names: list[str], factors: dict) -> list[str]:
    layouts.mark(root, "flashinfer-aot")
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / f"{name}.so").write_bytes(elf(name))
    CacheDir(root).write_build_info({"fingerprint": factors, "manifest": {"name": "aot", "digest": "ef" * 32}})
    return names


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    """Per layout: a bundle already on the node ("before") and a bundle of three entries ("new"), with its keys."""
    root = tmp_path_factory.mktemp("refusal")
    out = {}
    for layout in ("triton", "sglang-jit", "flashinfer-aot"):
        made = {}
        for name, entries in (("before", ["a_first"]), ("new", ["b_one", "b_two", "b_three"])):
            src = root / layout / f"{name}-build"
            if layout == "triton":
                synthetic_cache(src, len(entries), seed=len(name), scale=0.01)
            elif layout == "sglang-jit":
                sglang_build(src, [f"sgl_kernel_jit_{e}" for e in entries], jit_node_factors(layouts.get(layout)))
            else:
                flashinfer_build(src, entries, jit_node_factors(layouts.get(layout)))
            pack(src, root / layout / name)
            made[name] = root / layout / name
        made["keys"] = [e.key for e in parse_index((made["new"] / INDEX).read_bytes(), "t").entries]
        out[layout] = made
    return out


def plant(node: Path, key: str, where: str, elsewhere: Path) -> Path:
    """A link in the place of entry ``key`` (``where``: "entry", or "parent": its nearest parent dir), to a dir
    elsewhere holding what the entry would hold there; returns the link."""
    path = node / key if where == "entry" else (node / key).parent.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    elsewhere.mkdir()
    (elsewhere / "kept.txt").write_text("the link's target is never written")
    path.symlink_to(elsewhere, target_is_directory=True)
    return path


CASES = [("installed", "triton", "entry"), ("installed", "flashinfer-aot", "entry"),
         ("installed", "sglang-jit", "entry"), ("installed", "sglang-jit", "parent"),
         ("fresh", "triton", "entry"), ("fresh", "sglang-jit", "parent")]  # fresh: a dir holding only the link


@pytest.mark.parametrize("node_state,layout,where", CASES)
def test_a_link_planted_under_a_later_entry_leaves_the_target_byte_identical(bundles, tmp_path, layout, where,
                                                                             node_state):
    b, node = bundles[layout], tmp_path / "node"
    if node_state == "installed":  # a node's dir: an earlier bundle of the same layout in it
        install(str(b["before"]), node, durable=False)
    else:
        node.mkdir()
    link = plant(node, b["keys"][-1], where, tmp_path / "elsewhere")
    before, outside = tree(node), tree(tmp_path / "elsewhere")
    with pytest.raises(EnvironmentProblem, match=f"{re.escape(link.name)}.* never followed.*nothing was placed"):
        install(str(b["new"]), node, durable=False)  # exit 11 (the command line's: tests/test_layouts.py)
    assert tree(node) == before and tree(tmp_path / "elsewhere") == outside
    assert not CacheDir(node).staging_dirs()
    link.unlink()  # the link removed, the same install goes through
    assert install(str(b["new"]), node, durable=False).installed == 3
    assert verify(node, check_fingerprint=False).ok


@pytest.mark.parametrize("layout", ["triton", "sglang-jit"])
def test_a_rename_failing_after_others_puts_every_placed_entry_back(bundles, tmp_path, monkeypatch, layout):
    """The last entry's rename fails (a dir it may not write): the entries renamed before it go back into staging,
    a modified entry they had replaced goes back in its place, the parents made for them are removed."""
    b, node = bundles[layout], tmp_path / "node"
    install(str(b["before"]), node, durable=False)
    first = node / b["keys"][0]
    first.mkdir(parents=True)  # the first entry there, modified: the install replaces it
    (first / "sgl_deps.json" if layout == "sglang-jit" else first / "k.json").write_text("modified")
    before = tree(node)
    real, calls = install_mod._place_entry, []

    def failing(key, cache_fd, staging_fd, made):
        calls.append(key)
        if len(calls) == len(b["keys"]):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(key, cache_fd, staging_fd, made)

    monkeypatch.setattr(install_mod, "_place_entry", failing)
    with pytest.raises(EnvironmentProblem, match="Permission denied"):
        install(str(b["new"]), node, durable=False)
    assert len(calls) == 3 and tree(node) == before and not CacheDir(node).staging_dirs()
    monkeypatch.setattr(install_mod, "_place_entry", real)
    assert install(str(b["new"]), node, durable=False).replaced == 1
