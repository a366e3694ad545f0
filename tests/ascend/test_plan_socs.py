"""Planning needs no node: `prewarm plan` of an Ascend manifest listing several SoCs plans every SoC on a machine
without an NPU (here: triton-ascend 3.2.0, no torch_npu), each under its target-only driver, and counts the
compiles. Before, `plan --compiles` failed closed (exit 8: "this node's Ascend SoC is unknown"). Real processes."""
from __future__ import annotations

import json
import os

from conftest import ARCH, TOY_COMPILES, TOY_KERNELS, run_prewarm, write_manifest

SOCS = [ARCH, "Ascend910_9392"]


def no_node_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_ASCEND_ARCH"}


def test_plan_compiles_plans_every_soc_without_a_node(tmp_path):
    path = write_manifest(tmp_path / "two.toml", TOY_KERNELS, SOCS)
    p = run_prewarm("plan", path, "--compiles", "--json", env=no_node_env())
    assert p.returncode == 0, p.stderr
    docs = json.loads(p.stdout)["socs"]
    assert [d["target"]["arch"] for d in docs] == SOCS
    assert [d["manifest"]["name"] for d in docs] == [f"ascend-toy-{soc}" for soc in SOCS]
    assert [(d["counts"]["requests"], d["counts"]["compiles"], len(d["compiles"])) for d in docs] == \
        [(4, TOY_COMPILES, TOY_COMPILES)] * 2
    assert [d["target_mode"] for d in docs] == ["offline", "offline"]


def test_plan_lists_each_socs_requests_and_compile_count(tmp_path):
    path = write_manifest(tmp_path / "two.toml", TOY_KERNELS, SOCS)
    p = run_prewarm("plan", path, env=no_node_env())
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for soc in SOCS:
        assert f"ascend-toy-{soc}: 4 requests for npu {soc}" in text
        assert f"4 requests -> {TOY_COMPILES} compiles for npu {soc} (offline)" in text
