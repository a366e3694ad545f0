"""The deployment files run: every `prewarm` command of the Dockerfile, the Kubernetes init containers and the
pre-launch script, parsed from those files (not copied), against the CPU target.

No Docker engine or cluster is needed: the Dockerfile's stages are resolved for a TARGET build arg, ARG/ENV
values are computed from the file, and each RUN line that calls `prewarm` is run with ``/bin/sh -c`` (as
Docker does); the init containers' command/args get Kubernetes' ``$(VAR)`` expansion from their env; the
script runs as is. Image paths (``/opt/prewarm``, ``/run/secrets``, mount paths) map to temp dirs, and the
manifest is a copy of the shipped one with fewer serving shapes (the same target, model and kernels), so the
builds take seconds. ``prewarm`` on PATH is a wrapper that logs each verb before running the real command, so
each test checks that exactly the commands found in the file ran.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dockerfile import (DOCKERFILE, Image, assert_clean, bake, clean_env, expand, prewarm_verbs_in_shell, read_dockerfile,
                        run, small_manifest, stage_chain, walk)
from prewarm_helpers import JIT_MODULE, TOOLKIT, build_jit_bundles

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s-init-container.yaml"
PRELAUNCH = REPO / "deploy" / "prelaunch.sh"
VENV_BIN = Path(sys.executable).parent
ASCEND_PREWARM = REPO / ".venv-ascend" / "bin" / "prewarm"


# stands in for the server program: says whether it runs under the guard and reads shipped autotune results, then
# that it started
SERVER = ["sh", "-c", 'echo "guard=$PREWARM_GUARD record=$PREWARM_GUARD_RECORD autotune=$TRITON_CACHE_AUTOTUNING"; '
                      'echo server-started']


# --- the image build step -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baked(tmp_path_factory) -> dict:
    """The CUDA image's build step, run once: a signed bundle and the baked cache (in temp dirs)."""
    root = tmp_path_factory.mktemp("image")
    image = Image(root, root / "prewarm-calls.log")
    image.install_tool(VENV_BIN / "prewarm")
    secrets = Path(image.path("/run/secrets"))
    secrets.mkdir()
    keys = root / "keys" / "prewarm"
    keys.parent.mkdir()
    run([str(VENV_BIN / "prewarm"), "keygen", "-o", str(keys)], clean_env(), "prewarm keygen")
    (secrets / "prewarm_key").write_bytes(Path(f"{keys}.key").read_bytes())  # what --secret id=prewarm_key mounts
    manifest = small_manifest(REPO / "manifests" / "kimi-linear-h200.toml", root / "kimi-linear-h200-small.toml")
    final_env, found = bake(image, {"TARGET": "cuda"}, manifest)
    return {"image": image, "env": final_env, "found": found, "ran": image.verbs_run(), "manifest": manifest,
            "public_key": Path(f"{keys}.pub")}


def test_dockerfile_cuda_build_step_builds_packs_signs_and_verifies(baked):
    image: Image = baked["image"]
    # the file verifies each dir past Triton against its bundle, then the Triton cache with the plan: this manifest
    # reaches no module past Triton, so only the last ran
    assert baked["found"] == ["build", "pack", "verify", "verify"]
    assert baked["ran"] == ["build", "pack", "verify"]
    bundle = Path(image.path(baked["env"]["PREWARM_BUNDLE"]))
    index = json.loads((bundle / "index.json").read_text())
    assert index["entries"], "the baked bundle is empty"
    assert (bundle / "index.json.sig").is_file(), "the build secret was given but the bundle is not signed"
    cache = Path(image.path(baked["env"]["TRITON_CACHE_DIR"]))
    assert {e["key"] for e in index["entries"]} <= {p.name for p in cache.iterdir()}, "the image's cache lacks entries"


def test_dockerfile_installs_extras_that_exist():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    global_args, stages = read_dockerfile(DOCKERFILE)
    for target in ("cuda", "npu"):
        chain = stage_chain(global_args, stages, {"TARGET": target})
        steps, _ = walk(global_args, chain, {"TARGET": target}, "/usr/bin")
        installs = [expand(text, scope) for kw, text, scope in steps if kw == "RUN" and "pip install" in text]
        assert installs, f"TARGET={target}: no pip install of the project"
        asked = re.findall(r"/opt/prewarm/src\[(\w+)\]", " ".join(installs))
        assert asked == [target], f"TARGET={target}: installs extras {asked}"
        assert target in extras, f"pyproject.toml has no [{target}] extra"


def test_dockerfile_ascend_build_step_plans_and_lowers(tmp_path):
    assert ASCEND_PREWARM.exists(), f"{ASCEND_PREWARM} missing: the Ascend environment is made by .ci/setup"
    image = Image(tmp_path, tmp_path / "prewarm-calls.log")
    image.install_tool(ASCEND_PREWARM)
    manifest = small_manifest(REPO / "manifests" / "kimi-k3-ascend-a3.toml", tmp_path / "k3-small.toml")
    _, found = bake(image, {"TARGET": "npu"}, manifest)
    assert found == ["plan", "lower"]
    assert image.verbs_run() == found
    plan = json.loads(Path(image.path("/opt/prewarm/plan.json")).read_text())
    assert plan, "the image's plan.json is empty"


# --- the pre-launch job as Kubernetes init containers ----------------------------------------------------------


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args ($$ escapes; unknown references stay as written)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def local(value: str, mounts: dict[str, Path], image: Image) -> str:
    """A container path as this test's dirs: volume mounts first, then the image's own paths."""
    for mount_path, host_dir in mounts.items():
        value = value.replace(mount_path, str(host_dir))
    return image.path(value)


def test_k8s_init_containers_install_then_verify_before_the_server(baked, tmp_path):
    image: Image = baked["image"]
    pod = yaml.safe_load(K8S.read_text())["spec"]
    volumes = {v["name"]: tmp_path / "node" / v["name"] for v in pod["volumes"]}
    server = pod["containers"][0]
    server_env = {e["name"]: e["value"] for e in server["env"]}
    found = []
    for attempt in ("first start", "pod restart"):
        for c in pod["initContainers"]:
            env = {}
            for e in c.get("env", []):
                assert "value" in e, f"{c['name']}: env {e['name']} must be a plain value in this example"
                env[e["name"]] = e["value"]
            argv = [k8s_expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            assert not any("$(" in a for a in argv), f"{c['name']}: unresolved reference in {argv}"
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            cache_path = server_env["TRITON_CACHE_DIR"]
            assert env.get("TRITON_CACHE_DIR") == cache_path, f"{c['name']} must use the server's TRITON_CACHE_DIR"
            assert [m["name"] for m in c["volumeMounts"] if m["mountPath"] == cache_path] == [
                m["name"] for m in server["volumeMounts"] if m["mountPath"] == cache_path
            ], f"{c['name']} must mount the server's cache volume at {cache_path}"

            argv = [local(a, mounts, image) for a in argv]
            if argv[:2] == ["prewarm", "verify"]:
                argv[argv.index("--plan") + 1] = str(baked["manifest"])
            if attempt == "first start":
                found.append(argv[1])
            p = run(argv, clean_env(PATH=f"{image.path('/opt/prewarm/venv/bin')}:{os.environ['PATH']}",
                                    **{k: local(v, mounts, image) for k, v in env.items()}),
                    f"{attempt}: init container {c['name']}")
            if argv[1] == "verify":
                assert_clean(p, f"{attempt}: {c['name']}")
            if attempt == "pod restart" and argv[1] == "install":
                assert "nothing to do" in p.stdout, f"a repeated install should be a no-op:\n{p.stdout}"
    assert found == ["install", "verify"]
    assert image.verbs_run() == found * 2
    # the server reads the autotune results the bundle ships, and verify checked them under the same setting
    verify_env = {e["name"]: e["value"] for c in pod["initContainers"]
                  if c.get("command", [])[:2] == ["prewarm", "verify"] for e in c.get("env", [])}
    assert server_env.get("TRITON_CACHE_AUTOTUNING") == verify_env.get("TRITON_CACHE_AUTOTUNING") == "1", \
        "the server and the verify init container must both set TRITON_CACHE_AUTOTUNING=1"
    # the server container's own command: `prewarm guard` with the program after "--" standing in for the server
    argv = [k8s_expand(a, server_env) for a in server.get("command", []) + server.get("args", [])]
    assert argv[:3] == ["prewarm", "guard", "--"], f"the server must run under `prewarm guard`: {argv}"
    mounts = {m["mountPath"]: volumes[m["name"]] for m in server["volumeMounts"]}
    env = {k: local(v, mounts, image) for k, v in server_env.items()}
    p = run(argv[:3] + SERVER, clean_env(PATH=f"{image.path('/opt/prewarm/venv/bin')}:{os.environ['PATH']}", **env),
            "server container")
    assert f"guard=warn record={env['TRITON_CACHE_DIR']}/.prewarm/guard.jsonl" in p.stdout, p.stdout
    assert Path(env["PREWARM_GUARD_PLAN"]).is_file(), "the server's PREWARM_GUARD_PLAN is not the image's manifest"
    assert image.verbs_run() == ["guard"]


# --- the pre-launch script -----------------------------------------------------------------------------------------


def prelaunch(image: Image, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = clean_env(PATH=f"{image.path('/opt/prewarm/venv/bin')}:{os.environ['PATH']}", **env)
    return subprocess.run(["/bin/sh", str(PRELAUNCH), *SERVER], env=env, capture_output=True, text=True, timeout=600)


def test_prelaunch_script_every_branch_runs_and_starts_the_server(baked, tmp_path):
    image: Image = baked["image"]
    found = prewarm_verbs_in_shell(PRELAUNCH.read_text())
    bundle = image.path(baked["env"]["PREWARM_BUNDLE"])
    # modules past Triton (PREWARM_JIT_SOURCES): sglang's packed decode, built here by sglang's own load_jit
    jit = build_jit_bundles(tmp_path / "jit", clean_env(CUDA_HOME=str(TOOLKIT), HOME=str(tmp_path / "home")))["jit"]
    branches = {
        "signed install": {"PREWARM_SOURCE": bundle, "PREWARM_TRUST": str(baked["public_key"])},
        "install": {"PREWARM_SOURCE": f"file://{bundle}", "PREWARM_JIT_SOURCES": f"sglang-jit={jit}",
                    "SGLANG_JIT_CACHE_DIR": str(tmp_path / "sglang-jit"), "CUDA_HOME": str(TOOLKIT)},
        "build on node": {"PREWARM_BUILD_ON_NODE": "1", "PREWARM_SOURCE": str(tmp_path / "node-bundle"),
                          "PREWARM_PUSH": f"file://{tmp_path / 'store-a'} file://{tmp_path / 'store-b'}"},
    }
    ran = []
    for name, extra in branches.items():
        cache = tmp_path / name.replace(" ", "-") / "triton-cache"
        p = prelaunch(image, {"TRITON_CACHE_DIR": str(cache), "PREWARM_MANIFEST": str(baked["manifest"]), **extra})
        assert p.returncode == 0, f"{name}: prelaunch exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        assert_clean(p, name)
        assert p.stdout.rstrip().endswith("server-started"), f"{name}: the server did not start last:\n{p.stdout}"
        assert f"guard=warn record={cache}/.prewarm/guard.jsonl" in p.stdout, f"{name}: not started under the guard"
        assert "autotune=1" in p.stdout, f"{name}: the server would not read shipped autotune results"
        verbs = image.verbs_run()
        assert verbs[-1] == "guard", f"{name}: the server must be exec'd by `prewarm guard` last, ran {verbs}"
        ran += verbs[:-1]
    # each prewarm command of the script ran (the modules' install and verify run before any branch's own)
    assert not Counter(found) - Counter(ran + ["guard"]), f"ran {ran} (+ guard in each branch), the script holds {found}"
    assert list((tmp_path / "sglang-jit").glob(f"sm90a/{JIT_MODULE}/build-*/deps-*/{JIT_MODULE}.so"))
    for store in ("store-a", "store-b"):
        assert (tmp_path / store / "index.json").is_file(), f"the node's bundle was not pushed to {store}"


def test_prelaunch_script_does_not_start_the_server_when_a_planned_kernel_would_miss(baked, tmp_path):
    """The node also serves fp16 activations, which the bundle was not built for: verify fails (exit 5), says what
    differs from the cache's nearest entry, and the server stays down."""
    image: Image = baked["image"]
    wider = small_manifest(REPO / "manifests" / "kimi-linear-h200.toml", tmp_path / "wider.toml")
    wider.write_text(wider.read_text().replace('activation = "bfloat16"', 'activation = ["bfloat16", "float16"]', 1))
    p = prelaunch(image, {"TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "PREWARM_MANIFEST": str(wider),
                          "PREWARM_SOURCE": image.path(baked["env"]["PREWARM_BUNDLE"])})
    assert p.returncode == 5, f"expected the will-miss exit code 5, got {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "cache *bf16, planned *fp16" in p.stdout, p.stdout
    assert "server-started" not in p.stdout
    assert image.verbs_run() == ["install", "verify"]


def test_prelaunch_requiring_autotune_results_refuses_an_offline_bundle(baked, tmp_path, monkeypatch):
    """A bundle from an offline build has no autotune results: the node starts the server by default, and stays
    down with exit 5 when PREWARM_REQUIRE_AUTOTUNE=1 (meant for bundles from a device build)."""
    from prewarm.building.build import build
    from prewarm.shipping.pack import pack

    image: Image = baked["image"]
    fixtures = REPO / "tests" / "fixtures"
    manifest = fixtures / "toy-autotune.toml"  # one autotuned kernel that keeps its results on disk
    monkeypatch.syspath_prepend(str(fixtures))
    env = {"PYTHONPATH": str(fixtures), "PREWARM_MANIFEST": str(manifest), "PREWARM_SOURCE": str(tmp_path / "bundle")}
    build(manifest, tmp_path / "built", workers=1, mode="offline")
    pack(tmp_path / "built", tmp_path / "bundle")
    p = prelaunch(image, {**env, "TRITON_CACHE_DIR": str(tmp_path / "node-a")})
    assert p.returncode == 0 and p.stdout.rstrip().endswith("server-started"), p.stdout + p.stderr
    p = prelaunch(image, {**env, "TRITON_CACHE_DIR": str(tmp_path / "node-b"), "PREWARM_REQUIRE_AUTOTUNE": "1"})
    assert p.returncode == 5, f"expected exit 5, got {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "server-started" not in p.stdout and "0 kept, 2 absent" in p.stdout.replace("\n", " ")
    assert image.verbs_run() == ["install", "verify", "guard", "install", "verify"]


def test_prelaunch_requiring_launchers_refuses_a_bundle_without_them(baked, tmp_path, monkeypatch):
    """PREWARM_REQUIRE_LAUNCHERS=1 (the npu image sets it): a bundle whose launcher the node would have to build at
    first launch keeps the server down with exit 5; with every launcher present it starts."""
    import shutil

    from prewarm.building.build import build
    from prewarm.shipping.pack import pack
    from prewarm.node.willhit import check

    image: Image = baked["image"]
    fixtures = REPO / "tests" / "fixtures"
    manifest = fixtures / "toy-cuda.toml"
    monkeypatch.syspath_prepend(str(fixtures))
    env = {"PYTHONPATH": str(fixtures), "PREWARM_MANIFEST": str(manifest), "PREWARM_REQUIRE_LAUNCHERS": "1"}
    build(manifest, tmp_path / "built", workers=1, mode="offline")
    pack(tmp_path / "built", tmp_path / "full")
    p = prelaunch(image, {**env, "TRITON_CACHE_DIR": str(tmp_path / "node-a"), "PREWARM_SOURCE": str(tmp_path / "full")})
    assert p.returncode == 0 and p.stdout.rstrip().endswith("server-started"), p.stdout + p.stderr
    launcher = next(m for m in check(str(manifest), str(tmp_path / "built")).modules if m.name == "__triton_launcher")
    shutil.rmtree(tmp_path / "built" / launcher.key)
    pack(tmp_path / "built", tmp_path / "partial")
    p = prelaunch(image, {**env, "TRITON_CACHE_DIR": str(tmp_path / "node-b"), "PREWARM_SOURCE": str(tmp_path / "partial")})
    assert p.returncode == 5, f"expected exit 5, got {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "server-started" not in p.stdout and launcher.key in p.stdout
