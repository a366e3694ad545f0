"""Closing a real recording: sglang 0.5.23's KDA kernels, 80 requests recorded on an H200 (issue 24's evidence,
``tests/fixtures/sglang-0.5.23-kda-h200-record.jsonl``). ``close = true`` used to plan 11,026 compiles: every
specialized int of every request in every class, strides whose class never changes included. It now closes only the
ints the recording saw in more than one class."""
from __future__ import annotations

import shutil
from pathlib import Path

from prewarm.building import backends, tritoncompat
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for

RECORDING = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23-kda-h200-record.jsonl"


def test_closing_the_sglang_recording_plans_a_few_hundred_compiles_and_keeps_every_recorded_request(tmp_path):
    shutil.copy(RECORDING, tmp_path / "rec.jsonl")
    path = tmp_path / "sglang.toml"  # the recording predates recorded devices: the manifest names it
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\ndevice = "H200"\n\n'
                    '[[kernels]]\nrecord = "rec.jsonl"\nclose = true\n')
    p = plan_for(*backends.select(load(path), "offline"))
    assert len(p.requests) == 80
    assert len(p.compiles) <= 300  # the bound: a few hundred
    # the one int that took two classes: the verify kernel's cache_steps (other, and a multiple of 16); its strides,
    # T (do_not_specialize) and every other kernel's ints stay as recorded
    closed = {(c.kernel.split(":")[1], c.closing) for c in p.compiles if c.closing}
    assert closed == {("fused_sigmoid_gating_delta_rule_update_kernel", what)
                      for what in ("cache_steps=1", "cache_steps%16=0", "cache_steps other")}
    assert len(p.compiles) == 80 + 10  # 5 verify/decode requests x the 2 classes each lacks
    planned = {tritoncompat.on_disk(c.specialization) for c in p.compiles if not c.closing}
    assert {tritoncompat.on_disk(r.specialization) for r in p.requests} == planned
