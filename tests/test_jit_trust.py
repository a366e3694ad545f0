"""issue 57: verify sees a JIT dir as the library's own loader does. After a signed, trusted install a node attacker
adds one thing to the dir; the library's own lookup (sglang's ``find_prebuilt`` through ``load_jit`` stopped there,
FlashInfer's ``get_aot_artifacts``) is asked what it would load, and verify in signed mode must refuse (exit 13, or 6
where integrity fails), naming exactly that path; without keys it lists it.

No module is built or loaded here: each leaf is made by sglang's own cache functions (its dependency list of the
module's real sources, named by sglang's ``_deps_key``) around a stand-in ``.so`` that nothing executes (every lookup
stops before a load), and FlashInfer's modules are stand-in bytes as in tests/test_layouts.py. The same attacks on a
real built module, through the pre-launch job: tests/test_jit_pipeline.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prewarm.errors import IntegrityError, UnverifiedEntries
from prewarm.providers.sglang.jit import SglangJit, _resolve, _session, capture_requests
from prewarm.shipping import layouts
from prewarm.shipping.cachedir import CacheDir
from prewarm.shipping.nodestamp import jit_node_factors
from prewarm.shipping.signing import keygen

from prewarm_helpers import FIXTURES, JIT_MODULE, REPO, TOOLKIT, copy_cache, run_cli

STANDIN = b"\x7fELF stand-in: no test loads or runs this file"


@pytest.fixture(scope="module", autouse=True)
def cuda_home():
    """sglang's and FlashInfer's key factors run this toolkit's `nvcc --version` (nothing is compiled)."""
    assert (TOOLKIT / "bin" / "nvcc").is_file(), f"{TOOLKIT}: run .ci/setup (it assembles this CUDA toolkit)"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_HOME", str(TOOLKIT))
        mp.delenv("CXX", raising=False)
        mp.delenv("SGLANG_JIT_CACHE_DIR", raising=False)
        yield


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("keys")
    _, pub, _ = keygen(root / "signer")
    return {"key": root / "signer.key", "pub": str(pub)}


def signed(keys) -> list[str]:
    return ["--trust", keys["pub"], "--require-signature"]


def verify_json(node: Path, *flags, code: int) -> dict:
    return json.loads(run_cli("verify", "--cache-dir", node, "--json", *flags, check=code).stdout)


def packed_decode_request():
    """sglang's packed decode as ``fused_recurrent_kda_packed_decode`` calls it on Hopper (batch 8), captured."""
    from sglang.kernels.ops.attention import kda_packed_decode as kpd

    hv, k, batch = 2, 128, 8
    with capture_requests("9.0a") as requests:
        kpd.kda_packed_decode(torch.zeros(batch, 3 * hv * k, dtype=torch.bfloat16),
                              torch.zeros(batch, hv * k, dtype=torch.bfloat16),
                              torch.zeros(batch, hv, dtype=torch.bfloat16), torch.zeros(hv), torch.zeros(hv * k), 0.1,
                              torch.zeros(batch, hv, k, k), torch.zeros(batch, 1, hv, k, dtype=torch.bfloat16),
                              torch.arange(batch, dtype=torch.int32), hv)
    [request] = requests
    assert request.name == JIT_MODULE
    return request


def sglang_leaf(scope: Path, spec, extra: tuple[Path, ...] = ()) -> Path:
    """A leaf in ``scope`` as sglang publishes one: the dependency list of ``spec``'s sources (and ``extra`` files)
    with their current digests, named by sglang's own ``_deps_key``, so that ``find_prebuilt`` takes it; a
    stand-in ``.so``."""
    import msgspec
    from sglang.kernels.jit.utils.compile import cache

    entries = cache._to_entries(dependencies=[Path(s) for s in spec.sources] + list(extra), build_dir=scope / "none")
    leaf = scope / f"deps-{cache._deps_key(entries)}"
    leaf.mkdir(parents=True)
    (leaf / "sgl_deps.json").write_bytes(msgspec.json.encode(entries))
    (leaf / f"{spec.module_name}.so").write_bytes(STANDIN)
    return leaf


def newest(path: Path) -> None:
    """``find_prebuilt`` tries leaves newest first: this one (through a link: its target) first."""
    t = max(p.stat().st_mtime for p in path.parent.iterdir()) + 60
    os.utime(path, (t, t))


@pytest.fixture(scope="module")
def sglang_node(tmp_path_factory, keys) -> dict:
    """A sglang-jit dir holding the packed decode's leaf, packed, signed and installed with --trust."""
    root = tmp_path_factory.mktemp("sglang-trust").resolve()  # sglang's lookup resolves the root's links
    request = packed_decode_request()
    build = root / "build"
    layouts.mark(build, "sglang-jit")
    with _session(build, "9.0a"):
        seen = _resolve(request)
    scope, spec = seen["scope"], seen["spec"]
    leaf = sglang_leaf(scope, spec)
    CacheDir(build).write_build_info({"fingerprint": jit_node_factors(layouts.get("sglang-jit")),
                                      "manifest": {"name": "jit-trust", "digest": "cd" * 32}})
    run_cli("pack", build, "-o", root / "bundle", "--sign", keys["key"])
    node = root / "node"
    run_cli("install", root / "bundle", "--cache-dir", node, *signed(keys))
    [hit] = SglangJit().lookup([request], node, "9.0a")
    assert hit.hit and hit.path == str(node / leaf.relative_to(build) / f"{JIT_MODULE}.so")
    return {"request": request, "spec": spec, "node": node, "scope": node / scope.relative_to(build),
            "key": leaf.relative_to(build).as_posix()}


def sglang_loads(world: dict, node: Path) -> str:
    """What sglang's own lookup would load from ``node`` (load_jit stopped at find_prebuilt: nothing loaded)."""
    [hit] = SglangJit().lookup([world["request"]], node, "9.0a")
    assert hit.hit, hit.reason
    return hit.path


def test_sglang_a_second_leaf_as_a_link_is_what_sglang_loads_and_signed_verify_refuses_it(sglang_node, keys,
                                                                                           tmp_path):
    node = Path(shutil.copytree(sglang_node["node"], tmp_path / "node", symlinks=True))
    verify_json(node, *signed(keys), code=0)  # the copy is clean
    scope = node / sglang_node["scope"].relative_to(sglang_node["node"])
    from sglang.kernels.jit.utils.compile import cache

    # a self-consistent leaf elsewhere (its list names one more real file: another name), linked in as a leaf
    theirs = sglang_leaf(tmp_path / "elsewhere" / scope.name, sglang_node["spec"], (Path(cache.__file__),))
    (scope / theirs.name).symlink_to(theirs)
    newest(theirs)
    key = (scope / theirs.name).relative_to(node).as_posix()
    assert sglang_loads(sglang_node, node) == str(node / key / f"{JIT_MODULE}.so")  # sglang follows it, picks it

    doc = verify_json(node, *signed(keys), code=UnverifiedEntries.exit_code)
    [u] = doc["unverified"]
    assert (u["key"], u["loads"]) == (key, str(node / key / f"{JIT_MODULE}.so")) and doc["integrity_ok"]
    assert "sglang's find_prebuilt follows the link" in u["why"] and str(theirs) in u["why"]
    p = run_cli("verify", "--cache-dir", node, *signed(keys), check=UnverifiedEntries.exit_code)
    assert f"unverified: {key}" in p.stdout.replace("\n", ""), p.stdout
    # without keys: listed, not failed (no plan says a module would come from it: tests/test_jit_pipeline.py)
    doc = verify_json(node, code=0)
    assert [x["key"] for x in doc["unverified"]] == [key]

    # the same leaf as a plain dir (a copy): an entry no receipt covers, refused as before
    (scope / theirs.name).unlink()
    shutil.copytree(theirs, scope / theirs.name)
    newest(scope / theirs.name)
    assert sglang_loads(sglang_node, node) == str(node / key / f"{JIT_MODULE}.so")
    doc = verify_json(node, *signed(keys), code=UnverifiedEntries.exit_code)
    assert [(x["key"], x["loads"]) for x in doc["unverified"]] == [(key, str(node / key / f"{JIT_MODULE}.so"))]


def test_sglang_a_module_dir_replaced_by_a_link_is_an_integrity_fault_naming_what_sglang_loads(sglang_node, keys,
                                                                                                tmp_path):
    """The module's dir (``<target>/<module>``) swapped for a link to a copy holding a leaf of the attacker's: the
    installed leaf is gone from where it was installed (exit 6), and each leaf sglang could pick through the link is
    named."""
    node = Path(shutil.copytree(sglang_node["node"], tmp_path / "node", symlinks=True))
    module_dir = node / sglang_node["key"].split("/")[0] / JIT_MODULE
    copy = Path(shutil.copytree(module_dir, tmp_path / "elsewhere" / JIT_MODULE))
    shutil.rmtree(module_dir)
    module_dir.symlink_to(copy)
    scope = module_dir / sglang_node["scope"].name
    from sglang.kernels.jit.utils.compile import cache

    theirs = sglang_leaf(copy / scope.name, sglang_node["spec"], (Path(cache.__file__),))
    newest(theirs)
    key = f"{(scope / theirs.name).relative_to(node).as_posix()}"
    assert sglang_loads(sglang_node, node) == str(node / key / f"{JIT_MODULE}.so")
    link = f"{module_dir.relative_to(node)} -> {copy}"
    doc = verify_json(node, *signed(keys), code=IntegrityError.exit_code)
    assert doc["modified"] == [f"{sglang_node['key']} (reached through a link: {link})"]  # its bytes are intact
    assert {x["key"]: x["why"].split(": ")[0] for x in doc["unverified"]} == {
        f"{module_dir.relative_to(node)}": f"a link to {copy}",
        key: f"sglang's find_prebuilt follows the link {link} and would load {node / key / JIT_MODULE}.so through it",
        sglang_node["key"]: f"sglang's find_prebuilt follows the link {link} and would load "
                            f"{node / sglang_node['key'] / JIT_MODULE}.so through it"}


def test_sglang_links_and_stray_files_the_loader_never_reads(sglang_node, keys, tmp_path):
    """A link where sglang never looks is still a link no bundle installed (refused in signed mode); a stray file is
    listed, never failed: sglang reads neither."""
    node = Path(shutil.copytree(sglang_node["node"], tmp_path / "node", symlinks=True))
    (node / "notes.txt").write_text("stray")
    doc = verify_json(node, *signed(keys), code=0)
    assert doc["stray"] == ["notes.txt"] and not doc["unverified"]
    (node / "sm90a" / "lib").symlink_to("/usr/lib")
    doc = verify_json(node, *signed(keys), code=UnverifiedEntries.exit_code)
    assert [(x["key"], x["why"].split(":")[0]) for x in doc["unverified"]] == [("sm90a/lib", "a link to /usr/lib")]


# --- FlashInfer: <aot>/<name>/<name>.so for any name -------------------------------------------------------------

_FLASHINFER = """
import json, sys
from pathlib import Path
import torch
import flashinfer.jit.env as jit_env
from flashinfer.jit.attention.modules import get_batch_prefill_uri
job = json.loads(sys.argv[1])
jit_env.FLASHINFER_AOT_DIR = Path(job["aot"])
# the name of FlashInfer's own batch-prefill module (bf16, head dim 128): what its JitSpec is called
long = get_batch_prefill_uri("fa2", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False,
                             False, False)
print(json.dumps({"long": long, "loads": {n: [str(a.path) for a in jit_env.get_aot_artifacts(n)]
                                          for n in job["names"]}}))
"""


def flashinfer_loads(aot: Path, *names: str) -> dict:
    """FlashInfer's own answer (``get_aot_artifacts``, what ``JitSpec.try_load`` loads) for each name, with its AOT
    dir at ``aot``; and the name of its batch-prefill module. In a child: FlashInfer reads its env at import."""
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": "9.0a"}
    p = subprocess.run([sys.executable, "-c", _FLASHINFER, json.dumps({"aot": str(aot), "names": names})],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def flashinfer_node(tmp_path_factory, keys) -> dict:
    """A FlashInfer AOT dir (the sampling module, stand-in bytes) packed, signed and installed with --trust."""
    root = tmp_path_factory.mktemp("flashinfer-trust").resolve()
    src = root / "aot"
    layouts.mark(src, "flashinfer-aot")
    (src / "sampling").mkdir()
    (src / "sampling" / "sampling.so").write_bytes(STANDIN)
    run_cli("pack", src, "-o", root / "bundle", "--sign", keys["key"])
    node = root / "site-packages" / "flashinfer" / "data" / "aot"
    run_cli("install", root / "bundle", "--cache-dir", node, *signed(keys))
    answer = flashinfer_loads(node, "sampling")
    assert answer["loads"] == {"sampling": [str(node / "sampling" / "sampling.so")]}
    assert len(answer["long"]) > 128, answer["long"]
    verify_json(node, *signed(keys), code=0)
    return {"node": node, "bundle": root / "bundle", "long": answer["long"]}


def plant(node: Path, case: str, long: str, elsewhere: Path) -> str:
    """One hostile module dir of ``case``; returns its name."""
    name = {"long": long, "dash": "sampling-v2", "dot": "sampling.v2", "link": "norm"}[case]
    where = elsewhere / name if case == "link" else node / name
    where.mkdir(parents=True)
    (where / f"{name}.so").write_bytes(STANDIN)
    if case == "link":
        (node / name).symlink_to(where)
    return name


CASES = ("long", "dash", "dot", "link")


def test_flashinfer_module_dirs_flashinfer_loads_are_each_refused_in_signed_mode_naming_what_it_loads(
        flashinfer_node, keys, tmp_path):
    """Module dirs under a real FlashInfer name longer than 128 characters, names with a `-` or a `.`, one that is a
    link: FlashInfer loads each (asked for all at once: one child); signed verify names each with exactly the path
    FlashInfer gives (exit 13); without keys each is listed."""
    node = Path(shutil.copytree(flashinfer_node["node"], tmp_path / "aot", symlinks=True))
    names = [plant(node, case, flashinfer_node["long"], tmp_path / "elsewhere") for case in CASES]
    loads = flashinfer_loads(node, *names)["loads"]
    assert loads == {name: [str(node / name / f"{name}.so")] for name in names}  # FlashInfer would load each
    doc = verify_json(node, *signed(keys), "--no-fingerprint", code=UnverifiedEntries.exit_code)
    assert {u["key"]: [u["loads"]] for u in doc["unverified"]} == loads and doc["integrity_ok"]
    why = {u["key"]: u["why"] for u in doc["unverified"]}
    assert why["norm"].startswith(f"FlashInfer's get_aot_artifacts follows the link norm -> {tmp_path / 'elsewhere'}")
    assert why["sampling.v2"].startswith("FlashInfer's get_aot_artifacts would load ")  # no bundle can hold the name
    assert why[flashinfer_node["long"]].startswith("no receipt names it")  # a name prewarm ships: an entry
    doc = verify_json(node, "--no-fingerprint", code=0)  # without keys: listed
    assert sorted(u["key"] for u in doc["unverified"]) == sorted(names)


TOY_PLAN = """name = "toy-add"
[target]
backend = "cuda"
arch = "sm_90"
[[kernels]]
function = "prewarm_toy.kernels:add_kernel"
label = "add"
args = { x_ptr = { tensor = "float32" }, y_ptr = { tensor = "float32" }, out_ptr = { tensor = "float32" }, n = 1000, BLOCK = [64, 256] }
options = { num_warps = 4 }
"""


def test_the_prelaunch_job_in_signed_mode_refuses_a_flashinfer_dir_with_modules_nothing_signed(
        flashinfer_node, keys, toy_cache_master, tmp_path):
    """deploy/prelaunch.sh with PREWARM_TRUST and PREWARM_JIT_SOURCES: the AOT dir is verified in signed mode with
    the Triton cache; every planted module dir is named, the server stays down. Without PREWARM_TRUST the same node
    starts (nothing planned comes from them), the modules listed."""
    from prewarm.shipping.pack import pack

    pack(copy_cache(toy_cache_master, tmp_path / "toy-build"), tmp_path / "toy", signing_key=keys["key"])
    (tmp_path / "toy.toml").write_text(TOY_PLAN)
    node = Path(shutil.copytree(flashinfer_node["node"], tmp_path / "aot", symlinks=True))
    names = [plant(node, case, flashinfer_node["long"], tmp_path / "elsewhere") for case in CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PREWARM_SOURCE=str(tmp_path / "toy"), PREWARM_MANIFEST=str(tmp_path / "toy.toml"), PREWARM_GUARD="off",
               PREWARM_JIT_SOURCES=f"flashinfer-aot={flashinfer_node['bundle']}", PREWARM_FLASHINFER_AOT_DIR=str(node),
               PYTHONPATH=str(FIXTURES))

    def prelaunch(**extra) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", str(REPO / "deploy" / "prelaunch.sh"), "echo", "server-started"],
                              env={**env, **extra}, capture_output=True, text=True, timeout=600)

    p = prelaunch(PREWARM_TRUST=keys["pub"])
    out = p.stdout.replace("\n", "")
    assert p.returncode == UnverifiedEntries.exit_code and "server-started" not in p.stdout, p.stdout + p.stderr
    assert all(f"unverified: {name}: " in out and f"would load {node / name / name}.so" in out for name in names), \
        p.stdout
    p = prelaunch()
    assert p.returncode == 0 and p.stdout.rstrip().endswith("server-started"), p.stdout + p.stderr
    assert f"{len(names)} entries unverified" in p.stdout.replace("\n", ""), p.stdout


def test_a_jit_dir_given_is_checked_with_the_cache_dir_in_one_verdict(sglang_node, flashinfer_node, keys, tmp_path):
    """`--jit-dir` puts each JIT dir's own check in the one report and exit code (no --plan needed); a dir of
    another layout than the one named is refused, naming both."""
    sglang, aot = sglang_node["node"], Path(shutil.copytree(flashinfer_node["node"], tmp_path / "aot", symlinks=True))
    plant(aot, "link", flashinfer_node["long"], tmp_path / "elsewhere")
    doc = verify_json(sglang, *signed(keys), "--no-fingerprint", "--jit-dir", f"flashinfer-aot={aot}",
                      code=UnverifiedEntries.exit_code)
    assert doc["ok"] is False and doc["unverified"] == []  # the sglang dir is clean; the AOT dir is not
    assert [u["key"] for u in doc["jit_verify"]["flashinfer-aot"]["unverified"]] == ["norm"]
    p = run_cli("verify", "--cache-dir", sglang, "--no-fingerprint", "--jit-dir", f"sglang-jit={aot}",
                check=IntegrityError.exit_code)
    assert f"--jit-dir sglang-jit={aot}: {aot} is a flashinfer-aot cache dir" in p.stderr, p.stderr
