"""Past Triton, through the CLI as a container build step and a node run it: a manifest whose plan reaches sglang's JIT
packed decode (``prewarm.providers.sglang.cuda``: bf16 decode batches of 8 or more leave Triton for the module
``kda_packed_decode``) is built without a GPU (`prewarm build`: the Triton cache, and beside it the sglang-jit dir
that sglang's own ``load_jit`` built for sm_90a with the nvcc .ci/setup installs), each dir packs to its own bundle
and installs at another path, and `verify --plan` finds the module by sglang's own lookup. A node with another host
compiler is refused at install and told at verify, naming it; the pre-launch job installs the modules where the
server reads them and checks the server's own view; under `prewarm guard --mode error` a process that would build the
module is refused and counted, one on the installed dir builds nothing. FlashInfer's module (its build takes
~100 s here) is left to tests/test_jit.py, through the same library interface."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm.node import metrics
from prewarm.shipping.signing import keygen
from prewarm_helpers import JIT_MODULE as MODULE, TOOLKIT, build_jit_bundles

REPO = Path(__file__).resolve().parents[1]
# a serving process's first packed decode of a covered batch, as sglang makes it on an H200 (the module getter;
# its .run needs the GPU): the guard installs at `import triton` and hooks sglang's build step once it is imported
SERVER = """
import triton
from sglang.kernels.jit.utils.arch import override_jit_cuda_arch
from sglang.kernels.ops.attention import kda_packed_decode
with override_jit_cuda_arch(9, 0):
    kda_packed_decode._jit_kda_packed_decode_module()
print("served")
"""


def env_of(tmp_path: Path, **values: str) -> dict[str, str]:
    """A node's environment: the toolkit the build used, HOME in the test's dir, no setting of the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_", "SGLANG_", "CXX"))}
    return {**env, "CUDA_HOME": str(TOOLKIT), "HOME": str(tmp_path / "home"), **values}


def prewarm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The manifest, its build (Triton + sglang-jit beside it) and both bundles."""
    return build_jit_bundles(tmp_path_factory.mktemp("jit-pipeline"), env_of(tmp_path_factory.getbasetemp()))


def test_installed_at_another_path_verify_finds_the_module_by_sglangs_lookup(built, tmp_path):
    node, jit_dir = tmp_path / "node", tmp_path / "sglang-jit"
    env = env_of(tmp_path, SGLANG_JIT_CACHE_DIR=str(jit_dir))  # install's default dir for the layout: sglang's
    for bundle, where in ((built["bundle"], ["--cache-dir", str(node)]), (built["jit"], [])):
        p = prewarm("install", str(bundle), *where, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
    [leaf] = jit_dir.glob(f"sm90a/{MODULE}/build-*/deps-*")
    assert (leaf / f"{MODULE}.so").is_file() and (leaf / "sgl_deps.json").is_file()
    p = prewarm("verify", "--cache-dir", str(node), "--plan", str(built["manifest"]), "--json", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    hit = json.loads(p.stdout)["will_hit"]
    assert [(j["name"], j["hit"], j["path"]) for j in hit["jit"]] == [(MODULE, True, str(leaf / f"{MODULE}.so"))]
    assert hit["jit_dirs"] == {"sglang-jit": str(jit_dir)}
    p = prewarm("verify", "--cache-dir", str(jit_dir), env=env)  # what the dir holds is what the bundle listed
    assert p.returncode == 0 and p.stdout.rstrip().endswith("clean"), p.stdout + p.stderr

    # a file of the installed module changed: integrity names it; sglang's lookup would still load it (its leaf
    # hashes its dependencies, not its .so): only verify sees it
    (leaf / f"{MODULE}.so").write_bytes(b"not a module")
    p = prewarm("verify", "--cache-dir", str(jit_dir), env=env)
    assert p.returncode == 6 and f"{MODULE}.so" in " ".join(p.stdout.split()), p.stdout + p.stderr


def test_a_node_with_another_host_compiler_is_refused_at_install_and_told_at_verify(built, tmp_path):
    """sglang keys its modules on `$CXX --version`: a node whose compiler differs would rebuild every one."""
    env = env_of(tmp_path, CXX="g++")  # another binary: its --version's first line names it
    p = prewarm("install", str(built["jit"]), "--cache-dir", str(tmp_path / "refused"), env=env)
    assert p.returncode == 8 and "sglang.jit.cxx" in p.stderr and not (tmp_path / "refused" / "sm90a").exists(), \
        p.stdout + p.stderr
    jit_dir = tmp_path / "sglang-jit"
    p = prewarm("install", str(built["jit"]), "--cache-dir", str(jit_dir), env=env_of(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    node = tmp_path / "node"
    assert prewarm("install", str(built["bundle"]), "--cache-dir", str(node), env=env).returncode == 0
    p = prewarm("verify", "--cache-dir", str(node), "--plan", str(built["manifest"]), "--jit-dir",
                f"sglang-jit={jit_dir}", "--json", env=env)
    assert p.returncode == 8, p.stdout + p.stderr  # the JIT dir's own check: its factors are not this node's
    doc = json.loads(p.stdout)
    [cxx] = [f for f in doc["jit_verify"]["sglang-jit"]["factors"] if f["status"] == "mismatch"]
    assert cxx["factor"] == "sglang.jit.cxx" and cxx["node"].startswith("g++ "), cxx
    [miss] = doc["will_hit"]["jit"]  # and sglang's own lookup says why it would rebuild
    assert not miss["hit"] and "sglang.jit.cxx differs: 'g++ " in miss["reason"], miss
    # the summary: each line's status is that of what it counts (every Triton compile hits; the module misses)
    p = prewarm("verify", "--cache-dir", str(node), "--plan", str(built["manifest"]), "--jit-dir",
                f"sglang-jit={jit_dir}", env=env)
    out = " ".join(p.stdout.split())
    assert p.returncode == 8 and re.search(r"will-hit ok (\d+)/\1 planned compiles hit", out), p.stdout
    assert "jit modules PROBLEM 0/1 modules past Triton" in out and "mismatch sglang.jit.cxx" in out, p.stdout


_INSTALL = """
import sys
from prewarm.errors import PrewarmError
from prewarm.shipping.install import install
try:
    install(sys.argv[1], sys.argv[2], durable=False)
    print("installed, sglang imported:", "sglang.kernels.jit.utils" in sys.modules)
except PrewarmError as e:
    print(type(e).__name__, e)
"""


def test_a_remembered_toolchain_is_reused_only_while_its_compilers_are_unchanged(built, tmp_path):
    """sglang's factors (importing it: torch; running nvcc and c++) are remembered in the dir and reused, sglang not
    even imported, so a pod start does not pay seconds per install; a host compiler replaced in place (same $CXX,
    another version) is still refused."""
    cxx = tmp_path / "bin" / "c++"  # the node's compiler, at a path of its own
    cxx.parent.mkdir()
    cxx.write_text(f'#!/bin/sh\nexec {shutil.which("c++")} "$@"\n')
    cxx.chmod(0o755)
    env = env_of(tmp_path, CXX=str(cxx))

    def install() -> str:
        return subprocess.run([sys.executable, "-c", _INSTALL, str(built["jit"]), str(tmp_path / "jit")], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()

    assert install() == "installed, sglang imported: True"  # computed, and remembered
    assert install() == "installed, sglang imported: False"  # reused
    cxx.write_text('#!/bin/sh\necho "c++ (a newer release) 99.1.0"\n')  # replaced in place: --version differs
    refused = install()
    assert refused.startswith("FingerprintMismatch") and "sglang.jit.cxx" in refused, refused


def test_the_guard_refuses_and_counts_a_build_and_the_installed_dir_builds_nothing(built, tmp_path):
    prom = tmp_path / "node.prom"
    guard = ["guard", "--mode", "error", "--metrics-textfile", str(prom), "--", sys.executable, "-c", SERVER]
    p = prewarm(*guard, env=env_of(tmp_path, SGLANG_JIT_CACHE_DIR=str(tmp_path / "empty")))
    assert p.returncode != 0 and "served" not in p.stdout, p.stdout + p.stderr
    assert f"prewarm guard: refusing to build sglang:{MODULE}: sglang load_jit: no usable build under" in p.stderr
    assert "UncoveredJitBuild" in p.stderr and not list((tmp_path / "empty").rglob("*.so"))
    assert metrics.read(str(prom))[0][metrics.JIT_BUILDS] == {f"sglang:{MODULE}": 1.0}

    jit_dir = tmp_path / "sglang-jit"
    env = env_of(tmp_path, SGLANG_JIT_CACHE_DIR=str(jit_dir))
    assert prewarm("install", str(built["jit"]), env=env).returncode == 0
    prom.unlink()
    p = prewarm(*guard, env=env)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("served"), p.stdout + p.stderr
    assert metrics.read(str(prom))[0].get(metrics.JIT_BUILDS, {}) == {}


def test_the_prelaunch_job_installs_where_the_server_reads_and_checks_the_servers_view(built, tmp_path):
    node, jit_dir = tmp_path / "node", tmp_path / "home" / ".cache" / "sglang" / "jit"  # sglang's default
    env = env_of(tmp_path, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", TRITON_CACHE_DIR=str(node),
                 PREWARM_SOURCE=str(built["bundle"]), PREWARM_MANIFEST=str(built["manifest"]),
                 PREWARM_JIT_SOURCES=f"sglang-jit={built['jit']}", PREWARM_SERVER="sglang")
    server = [sys.executable, "-c", "import os; print('serving with', os.environ['SGLANG_JIT_CACHE_DIR'])"]
    p = subprocess.run(["/bin/sh", str(REPO / "deploy" / "prelaunch.sh"), *server], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0 and p.stdout.rstrip().endswith(f"serving with {jit_dir}"), p.stdout + p.stderr
    assert list(jit_dir.glob(f"sm90a/{MODULE}/build-*/deps-*/{MODULE}.so"))
    out = " ".join(p.stdout.split())
    assert "jit modules ok 1/1 modules past Triton found by their library's own lookup" in out, out

    # a server started apart, with another SGLANG_JIT_CACHE_DIR: its own view, checked, the variable named
    p = prewarm("verify", "--cache-dir", str(node), "--server", "sglang", "--jit-dir", f"sglang-jit={jit_dir}",
                env={**env, "SGLANG_JIT_CACHE_DIR": str(tmp_path / "elsewhere")})
    assert p.returncode == 14, p.stdout + p.stderr
    assert f"set SGLANG_JIT_CACHE_DIR={jit_dir} in the server's environment" in " ".join(p.stdout.split()), p.stdout


# --- issue 57: what sglang's own lookup would load, judged as the Triton cache is ----------------------------------


def second_leaf(leaf: Path, where: Path) -> Path:
    """A leaf of the module built in ``leaf`` that sglang's ``find_prebuilt`` takes: the build's dependency list and
    one more real file, named by sglang's own ``_deps_key``, newer than every leaf beside ``leaf``; its ``.so`` a
    stand-in nothing loads (every lookup here stops at find_prebuilt)."""
    import msgspec
    from sglang.kernels.jit.utils.compile import cache

    entries = msgspec.json.decode((leaf / "sgl_deps.json").read_bytes(), type=list[cache._DepEntry])
    entries += cache._to_entries(dependencies=[Path(cache.__file__)], build_dir=where / "none")
    theirs = where / f"deps-{cache._deps_key(entries)}"
    theirs.mkdir(parents=True)
    (theirs / "sgl_deps.json").write_bytes(msgspec.json.encode(entries))
    (theirs / f"{MODULE}.so").write_bytes(b"\x7fELF stand-in: never loaded")
    t = max(p.stat().st_mtime for p in leaf.parent.iterdir()) + 60
    os.utime(theirs, (t, t))
    return theirs


@pytest.fixture(scope="module")
def signed(built, tmp_path_factory) -> dict:
    """The same build's two dirs packed again, signed."""
    root = tmp_path_factory.mktemp("signed")
    _, pub, _ = keygen(root / "signer")
    work, env = built["bundle"].parent, env_of(tmp_path_factory.getbasetemp())
    for suffix in ("", ".sglang-jit"):
        p = prewarm("pack", str(work / f"build{suffix}"), "-o", str(root / f"bundle{suffix}"), "--sign",
                    str(root / "signer.key"), env=env)
        assert p.returncode == 0, p.stdout + p.stderr
    return {"pub": str(pub), "bundle": root / "bundle", "jit": root / "bundle.sglang-jit"}


@pytest.mark.parametrize("as_link", [False, True], ids=["plain-dir", "link"])
def test_a_planned_module_sglang_would_load_from_a_leaf_no_receipt_covers_fails_without_keys(built, tmp_path,
                                                                                           as_link):
    """No --trust: a second leaf planted beside the installed one (a plain dir or a link to one) is what sglang's
    own lookup picks for the planned module, so verify --plan --jit-dir fails (exit 13), naming it, as for a planned
    Triton compile served from an entry no receipt covers."""
    node, jit_dir = tmp_path / "node", tmp_path / "sglang-jit"
    env = env_of(tmp_path)
    for bundle, where in ((built["bundle"], node), (built["jit"], jit_dir)):
        assert prewarm("install", str(bundle), "--cache-dir", str(where), env=env).returncode == 0
    [leaf] = jit_dir.glob(f"sm90a/{MODULE}/build-*/deps-*")
    theirs = second_leaf(leaf, tmp_path / "elsewhere" if as_link else leaf.parent)
    if as_link:
        (leaf.parent / theirs.name).symlink_to(theirs)
    key = (leaf.parent / theirs.name).relative_to(jit_dir).as_posix()
    p = prewarm("verify", "--cache-dir", str(node), "--plan", str(built["manifest"]), "--jit-dir",
                f"sglang-jit={jit_dir}", "--json", env=env)
    assert p.returncode == 13, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    [hit] = doc["will_hit"]["jit"]  # sglang's own lookup (load_jit stopped at find_prebuilt) picks the planted leaf
    assert hit["hit"] and hit["path"] == str(jit_dir.resolve() / key / f"{MODULE}.so"), hit
    jit = doc["jit_verify"]["sglang-jit"]
    assert jit["planned_unverified"] == [f"{key}/{MODULE}.so (sglang {MODULE})"] and jit["integrity_ok"]
    assert [u["key"] for u in jit["unverified"]] == [key] and doc["planned_unverified"] == []


def test_the_prelaunch_signed_mode_refuses_a_second_leaf_linked_in_after_a_trusted_install(built, signed, tmp_path):
    """After a signed, trusted install, a self-consistent leaf linked in beside the module's (sglang follows it and
    picks it): the pre-launch job in signed mode (PREWARM_TRUST) names it (exit 13) and the server stays down."""
    node, jit_dir = tmp_path / "node", tmp_path / "home" / ".cache" / "sglang" / "jit"
    env = env_of(tmp_path, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", TRITON_CACHE_DIR=str(node),
                 PREWARM_SOURCE=str(signed["bundle"]), PREWARM_MANIFEST=str(built["manifest"]),
                 PREWARM_JIT_SOURCES=f"sglang-jit={signed['jit']}", PREWARM_TRUST=signed["pub"], PREWARM_GUARD="off")
    p = prewarm("install", str(signed["jit"]), "--cache-dir", str(jit_dir), "--trust", signed["pub"],
                "--require-signature", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    [leaf] = jit_dir.glob(f"sm90a/{MODULE}/build-*/deps-*")
    theirs = second_leaf(leaf, tmp_path / "elsewhere")
    (leaf.parent / theirs.name).symlink_to(theirs)
    key = (leaf.parent / theirs.name).relative_to(jit_dir).as_posix()
    p = subprocess.run(["/bin/sh", str(REPO / "deploy" / "prelaunch.sh"), "echo", "server-started"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 13 and "server-started" not in p.stdout, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    assert f"unverified: {key}: sglang's find_prebuilt follows the link {key} -> {theirs}" in out, p.stdout
    assert f"planned compile from an unverified entry: {key}/{MODULE}.so (sglang {MODULE})" in out, p.stdout
    assert "jit modules ok 1/1" in out  # found: from the planted leaf, which is the problem
