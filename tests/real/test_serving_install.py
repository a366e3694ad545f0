"""prewarm inside a server's own environment: sglang 0.5.23 or vLLM 0.34.0 as pip installs it, with every dependency
(.ci/setup --servers: .venv-sglang, .venv-vllm: torch 2.14, Triton 3.8), prewarm from its wheel by the Dockerfile's
serving-image install line (.ci/wheel_check.py), no GPU and no NVIDIA driver on the box. .ci/run runs this file with
each of those venvs' python, from outside the checkout; the server tested is the one installed there.

- `prewarm plan` of the shipped server manifest plans what the scaffold plans (`.venv` over .ci/setup's assembled
  trees, the kernel files of the same wheel): request ids, kernels and their launch specializations, labels, compile
  count, JIT modules (tests/plan_compare.py);
- the Dockerfile's serving-image stage (TARGET=serving) builds, packs and verifies here, and its bundles, installed at
  another path, verify clean against the plan: vLLM's whole manifest; sglang's with decode batches 1 and 8 only
  (reaching its JIT packed decode and FlashInfer's sampling module), for CI's time.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from dockerfile import REPO, Image, assert_clean, bake, clean_env, run, small_manifest
from prewarm_helpers import TOOLKIT

SERVERS = {"sglang": "kimi-linear-h200-sglang.toml", "vllm": "kimi-linear-h200-vllm.toml"}
INSTALLED = [s for s in SERVERS if importlib.util.find_spec(s) is not None]
BIN = Path(sys.executable).parent  # this venv's: the server's image's python3 and (from the wheel) prewarm
SCAFFOLD = REPO / ".venv" / "bin" / "prewarm"  # the checkout's prewarm over .ci/setup's assembled trees
TIMEOUT = 3000


@pytest.fixture(scope="module")
def server() -> str:
    assert len(INSTALLED) == 1, f"{sys.prefix}: expected one server of {list(SERVERS)} installed, found {INSTALLED}"
    return INSTALLED[0]


def server_env(home: Path, **values: str) -> dict[str, str]:
    """The build box: no GPU (none visible, no driver installed), a HOME of its own (the servers' default cache
    dirs), nothing of this run's Python path, CUDA_HOME for sglang's JIT modules (.ci/setup's pip toolkit: a serving
    image has its own)."""
    env = clean_env(HOME=str(home), CUDA_VISIBLE_DEVICES="", CUDA_HOME=str(TOOLKIT), **values)
    env.pop("PYTHONPATH", None)
    return env


def test_prewarm_runs_from_its_wheel_in_the_server_install(server):
    import prewarm

    site = Path(sysconfig.get_paths()["purelib"])
    assert Path(prewarm.__file__).is_relative_to(site), f"prewarm imported from {prewarm.__file__}, not {site}"
    assert not Path.cwd().is_relative_to(REPO), f"run from {Path.cwd()}: inside the checkout"
    assert (BIN / "prewarm").is_file(), f"{BIN}: no prewarm command (.ci/wheel_check.py installs it)"


@pytest.mark.timeout(TIMEOUT)
def test_plan_in_the_server_install_is_the_scaffolds(server, tmp_path):
    from plan_compare import plan_differences, summary

    manifest = REPO / "manifests" / SERVERS[server]
    (tmp_path / "real").mkdir()
    (tmp_path / "scaffold").mkdir()
    procs = {  # both at once: each spends most of its time importing its server and driving its layer
        "real": subprocess.Popen([str(BIN / "prewarm"), "plan", str(manifest), "--json"], cwd=tmp_path,
                                 env=server_env(tmp_path / "real"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True),
        "scaffold": subprocess.Popen([str(SCAFFOLD), "plan", str(manifest), "--json"], cwd=tmp_path,
                                     env=clean_env(HOME=str(tmp_path / "scaffold")), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True),
    }
    plans = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, f"{name}: prewarm plan {manifest.name} exited {p.returncode}:\n{err[-4000:]}"
        plans[name] = json.loads(out)
    differences = plan_differences(plans["real"], plans["scaffold"])
    assert not differences, (f"{server}: real install {summary(plans['real'])}, scaffold {summary(plans['scaffold'])}:\n"
                             + "\n".join(differences))


@pytest.mark.timeout(TIMEOUT)
def test_the_dockerfile_serving_stage_bakes_here_and_its_bundles_verify_clean_at_another_path(server, tmp_path):
    image = Image(tmp_path, tmp_path / "prewarm-calls.log")
    logged = image.install_tool(BIN / "prewarm", at="/opt/prewarm/logged-bin")  # first on the image's PATH
    manifest = (small_manifest(REPO / "manifests" / SERVERS[server], tmp_path / "small.toml", buckets=(1, 8))
                if server == "sglang" else None)  # vLLM: the shipped manifest, whole
    env = server_env(tmp_path / "home")
    final, found = bake(image, {"TARGET": "serving", "SERVING_MANIFEST": SERVERS[server]}, manifest,
                        base_path=f"{logged}:{BIN}:{os.environ['PATH']}", env=env)
    layouts = {"sglang": ["flashinfer-aot", "sglang-jit"], "vllm": []}[server]  # the dirs past Triton its plan reaches
    assert found == ["build", "pack", "verify", "verify"]
    assert image.verbs_run() == ["build"] + ["pack"] * (1 + len(layouts)) + ["verify"] * (len(layouts) + 1)
    cache, bundle = Path(image.path(final["PREWARM_CACHE"])), Path(image.path(final["PREWARM_BUNDLE"]))
    assert sorted(p.name.removeprefix(f"{bundle.name}.") for p in bundle.parent.glob(f"{bundle.name}.*")) == layouts
    assert Path(image.path(final["TRITON_CACHE_DIR"])) == cache

    # a node: each bundle installed at another path, then verify of the plan against them, as the pre-launch job does
    plan = manifest or Path(image.path(final["PREWARM_MANIFEST"]))
    node = tmp_path / "node"
    node_env = {**env, "TRITON_CACHE_AUTOTUNING": final["TRITON_CACHE_AUTOTUNING"]}
    jit_dirs = []
    for layout in layouts:
        run([str(BIN / "prewarm"), "install", f"{bundle}.{layout}", "--cache-dir", str(node / layout)], node_env,
            f"install {layout}", cwd=tmp_path)
        jit_dirs += ["--jit-dir", f"{layout}={node / layout}"]
    run([str(BIN / "prewarm"), "install", str(bundle), "--cache-dir", str(node / "triton")], node_env, "install",
        cwd=tmp_path)
    p = run([str(BIN / "prewarm"), "verify", "--cache-dir", str(node / "triton"), "--plan", str(plan), *jit_dirs],
            node_env, "verify at the node", cwd=tmp_path)
    assert_clean(p, f"{server}: verify of the installed bundles")
