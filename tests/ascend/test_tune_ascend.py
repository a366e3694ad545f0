"""`prewarm tune` for an Ascend manifest (triton-ascend 3.2.0, no NPU, no torch_npu): this project's kernels run
pinned configs there and triton-ascend 3.2 keeps no autotune results (no ``cache_results``), so the plan makes no
tuning key and tune writes the table the same way, with no row, needing no device. What only a node can show: a
triton-ascend that keeps results (3.4+ upstream core) tuning keys benchmarked on the NPU. A real process."""
from __future__ import annotations

import os
import tomllib

from conftest import ARCH, REPO, run_prewarm


def test_tune_of_the_ascend_manifest_writes_a_table_without_rows_and_needs_no_device(tmp_path):
    table = tmp_path / "k3.tuned.toml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ASCEND_ARCH"}  # no node here to ask
    p = run_prewarm("tune", REPO / "manifests" / "kimi-k3-ascend-a3.toml", "-o", table, env=env)
    assert p.returncode == 0, p.stderr
    assert "no planned call is autotuned with results Triton can keep on disk" in p.stderr
    doc = tomllib.loads(table.read_text())
    assert doc["meta"] == {"device": ARCH, "manifest": "kimi-k3-ascend-a3", "triton": "3.2.0"}
    assert "tuned" not in doc
