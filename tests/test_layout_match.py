"""A bundle's layout must match its target dir, and a JIT layout's entries hold only what the library's loader reads
(issue 57). The dir: the layout's own variable decides where a bundle goes without --cache-dir (sglang's JIT dir
whatever TRITON_CACHE_DIR says), and a dir that states no layout is refused when another layout's server reads it
(its variable names it, or it is that server's default dir): exit 11, nothing written. The files: pack ships a
leaf's module (ELF) and its JSON metadata, leaves sglang's build leftovers out, and refuses anything else by name
(exit 9); install refuses the same, and a leftover, in a bundle pack did not write. The leaves are shaped as sglang
0.5.23 publishes them (its ninja build dir renamed: sources, build file, objects, depfiles, ninja's log, the module,
``sgl_deps.json``), with ELF stand-ins for the module: never loaded.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from prewarm.errors import EnvironmentProblem, UnsafeBundleError
from prewarm.shipping import layouts
from prewarm.shipping.bundle import INDEX, OBJECTS, index_bytes, pack_entry, parse_index
from prewarm.shipping.cachedir import CacheDir
from prewarm.shipping.install import install
from prewarm.shipping.nodestamp import jit_node_factors
from prewarm.shipping.pack import pack

from prewarm_helpers import run_cli, synthetic_cache

MODULE = "sgl_kernel_jit_rmsnorm_bf16"
KEY = f"sm90a/{MODULE}/build-0123456789abcdef/deps-fedcba9876543210"
ELF = b"\x7fELF\x02\x01\x01" + b"\0" * 64
LEAF = {"sgl_deps.json": b'[["kernels","csrc/norm.cuh","ab"]]', f"{MODULE}.so": ELF, "prewarm-key.json": b"{}",
        "build.ninja": b"build x.so: link main_0.o\n", ".ninja_log": b"# ninja log v6\n", "main.cpp": b"int f();\n",
        "main_0.o": ELF, "main_0.o.d": b"main_0.o: main.cpp\n"}
SHIPPED = {"sgl_deps.json", f"{MODULE}.so", "prewarm-key.json"}


@pytest.fixture(scope="module")
def factors() -> dict:
    return jit_node_factors(layouts.get("sglang-jit"))


def leaf_dir(root: Path, files: dict[str, bytes], factors: dict) -> Path:
    layouts.mark(root, "sglang-jit")
    for name, data in files.items():
        (root / KEY / name).parent.mkdir(parents=True, exist_ok=True)
        (root / KEY / name).write_bytes(data)
    CacheDir(root).write_build_info({"fingerprint": factors, "manifest": {"name": "jit", "digest": "cd" * 32}})
    return root


def forged(out: Path, files: dict[str, bytes], factors: dict, layout: str = "sglang-jit", key: str = KEY) -> Path:
    """A bundle listing ``files`` for one entry, written without pack (what someone with a bundle writer can make)."""
    src = out.with_name(out.name + "-src") / "entry"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    entry, obj = pack_entry(src, sorted(files), key, groups=False)
    (out / OBJECTS).mkdir(parents=True)
    (out / OBJECTS / entry.object).write_bytes(obj)
    (out / INDEX).write_bytes(index_bytes([entry.to_json()], factors, None, layout=layout, sequence=1))
    return out


def test_pack_ships_the_module_and_its_metadata_and_leaves_the_build_leftovers_out(factors, tmp_path):
    src = leaf_dir(tmp_path / "build", LEAF, factors)
    doc = json.loads(run_cli("pack", src, "-o", tmp_path / "b", "--json").stdout)
    assert doc["left_out"] == sorted(f"{KEY}/{n}" for n in set(LEAF) - SHIPPED)
    (entry,) = parse_index((tmp_path / "b" / INDEX).read_bytes(), "t").entries
    assert {f.path for f in entry.files} == SHIPPED
    node = tmp_path / "node"
    run_cli("install", tmp_path / "b", "--cache-dir", node)
    assert {p.name for p in (node / KEY).iterdir()} == SHIPPED and (node / KEY / f"{MODULE}.so").read_bytes() == ELF


HOSTILE = {
    "a Python file": ("evil.py", b"import os\n"),
    "a .pth": ("x.pth", b"import os; os.system('id')\n"),
    "a shell script": ("run.sh", b"#!/bin/sh\n"),
    "another library": ("libother.so", ELF),
    "a file in a subdir": ("sub/x.json", b"{}"),
    "a script named as the module": (f"{MODULE}.so", b"#!/bin/sh\necho hi\n"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_anything_the_loader_does_not_read_is_refused_by_name_at_pack_and_at_install(factors, tmp_path, case):
    """In process (the command line's exit 9 and message: the next test)."""
    name, data = HOSTILE[case]
    files = {**{n: LEAF[n] for n in SHIPPED}, name: data}
    with pytest.raises(UnsafeBundleError, match=re.escape(f"{KEY}/{name}")):
        pack(leaf_dir(tmp_path / "build", files, factors), tmp_path / "b")
    assert not (tmp_path / "b" / INDEX).exists()
    with pytest.raises(UnsafeBundleError, match=re.escape(f"{KEY}/{name}")):
        install(str(forged(tmp_path / "forged", files, factors)), tmp_path / "node", durable=False)
    assert not (tmp_path / "node").exists()


def test_install_refuses_a_build_leftover_and_a_flashinfer_module_that_is_not_native_code(factors, tmp_path):
    p = run_cli("install", forged(tmp_path / "old", {**{n: LEAF[n] for n in SHIPPED}, "build.ninja": b"x"}, factors),
                "--cache-dir", tmp_path / "node", check=UnsafeBundleError.exit_code)
    assert f"{KEY}/build.ninja is a build leftover" in p.stderr and "re-pack" in p.stderr
    aot = tmp_path / "aot"
    layouts.mark(aot, "flashinfer-aot")
    CacheDir(aot).write_build_info({"fingerprint": {}})  # refused before any factor is compared
    (aot / "sampling").mkdir()
    (aot / "sampling" / "sampling.so").write_text("print('not a module')\n")
    p = run_cli("pack", aot, "-o", tmp_path / "fb", check=UnsafeBundleError.exit_code)
    assert "sampling/sampling.so is not native code" in p.stderr and "get_aot_artifacts" in p.stderr


def _env(tmp_path: Path, **set_) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "SGLANG_JIT_CACHE_DIR")}
    return {**env, "HOME": str(tmp_path / "home"), **{k: str(v) for k, v in set_.items()}}


def test_the_layouts_own_variable_decides_the_dir_and_another_layouts_dir_is_refused(factors, tmp_path):
    run_cli("pack", leaf_dir(tmp_path / "build", {n: LEAF[n] for n in SHIPPED}, factors), "-o", tmp_path / "jit")
    run_cli("pack", synthetic_cache(tmp_path / "tbuild", 1, scale=0.01), "-o", tmp_path / "triton")
    triton_dir, jit_dir = tmp_path / "triton-cache", tmp_path / "jit-cache"
    # no --cache-dir: sglang's JIT dir (its own default), not the Triton dir TRITON_CACHE_DIR names
    out = run_cli("install", tmp_path / "jit", env=_env(tmp_path, TRITON_CACHE_DIR=triton_dir)).stdout
    assert f"{tmp_path / 'home' / '.cache' / 'sglang' / 'jit'}: installed 1 entries" in out
    assert not triton_dir.exists()
    home_triton = tmp_path / "home" / ".triton" / "cache"
    for bundle, target, env, named in (
            (tmp_path / "jit", triton_dir, _env(tmp_path, TRITON_CACHE_DIR=triton_dir),
             f"TRITON_CACHE_DIR={triton_dir}"),
            (tmp_path / "triton", jit_dir, _env(tmp_path, SGLANG_JIT_CACHE_DIR=jit_dir),
             f"SGLANG_JIT_CACHE_DIR={jit_dir}"),
            (tmp_path / "jit", home_triton, _env(tmp_path), "TRITON_CACHE_DIR being unset")):
        p = run_cli("install", bundle, "--cache-dir", target, env=env, check=EnvironmentProblem.exit_code)
        assert named in p.stderr and "states no layout" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not target.exists()
