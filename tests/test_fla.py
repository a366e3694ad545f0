"""fla-core 0.6.0's KDA planned and built offline under the H200 profile (prewarm.providers.fla_kda).

Coverage is checked against traffic written independently of the provider (``prewarm.providers.fla_traffic``: random
lengths, sequence counts, batch sizes, beta dtypes, views) run through fla's public API on meta tensors: every
compile request it makes must be a planned one. Builds run as CLI processes, so the device profile never reaches
this test process's later tests.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm import backends, devices, tritoncompat
from prewarm.manifest import load
from prewarm.plan import expand, expand_all, plan, resolve
from prewarm.providers import fla_traffic

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-fla.toml"
FIXED_SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def planned():
    """The shipped manifest planned in this process (H200 profile on), every compile it expands to; afterwards
    torch.cuda and Triton's driver are put back for the other tests."""
    from triton.runtime.driver import driver

    saved = driver._active
    try:
        m = load(MANIFEST)
        backends.activate_for_planning(m)
        p = plan(m)
        yield m, p, expand_all(p.requests)
    finally:
        devices.deactivate()
        driver._active = saved


def test_the_plan_answers_as_the_h200_and_takes_fla_hopper_path(planned):
    import fla.utils.hardware as hw

    assert devices.active() is devices.PROFILES["H200"]
    assert hw.IS_NVIDIA_HOPPER and hw.device == "cuda" and hw.check_shared_mem("hopper")


def test_every_autotune_config_fla_keeps_is_a_compile(planned):
    """For each planned call of an autotuned fla kernel that prunes nothing, one compile per config."""
    from triton.runtime.autotuner import Autotuner

    _, p, _ = planned
    checked = 0
    for r in p.requests:
        obj = resolve(r.kernel)
        while not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
            obj = obj.fn
        if isinstance(obj, Autotuner) and obj.early_config_prune is None and obj.perf_model is None:
            assert len({c.specialization for c in expand(r)}) == len(obj.configs), r.label
            checked += 1
    assert checked >= 8  # l2norm at each token bucket, at least


def test_every_l2norm_token_bucket_of_the_envelope_is_planned(planned):
    """fla's own l2norm_fwd at token counts across the envelope picks only planned NB values."""
    import torch
    from fla.modules.norm.l2norm import l2norm_fwd

    from prewarm.providers.fla_kda import intercepted

    _, p, _ = planned
    nb_planned = {r.kwargs["NB"] for r in p.requests if r.kernel.endswith(":l2norm_fwd_kernel")}
    heads, d = 32, 128
    seen = set()
    for t in sorted({1, 2047, 2048, 2049, 16383, 16384, *random.Random(7).sample(range(1, 16385), 200)}):
        with intercepted() as launches:
            l2norm_fwd(torch.empty(1, t, heads, d, dtype=torch.bfloat16, device="meta"))
        seen |= {launch.kwargs["NB"] for launch in launches}
    assert seen == nb_planned == set(range(1, 9))


def seeds() -> list[int]:
    return FIXED_SEEDS + [random.SystemRandom().randrange(10**3, 10**9)]


@pytest.mark.parametrize("seed", seeds())
def test_independent_fla_traffic_requests_nothing_the_plan_lacks(planned, seed):
    from prewarm.providers.fla_kda import intercepted

    m, _, compiles = planned
    have = {c.specialization for c in compiles}
    missed: dict[str, str] = {}
    n = 0
    for call in fla_traffic.calls(m.spec(), seed, 30, "meta"):
        with intercepted() as launches:
            call.run()
        for launch in launches:
            with tritoncompat.compile_requests(skip=True) as captured:
                tritoncompat.warmup(launch.kernel, launch.args, launch.kwargs, grid=(1,))
            n += len(captured)
            for data in captured:
                if data not in have:
                    missed.setdefault(data, f"{call.label} -> {tritoncompat.kernel_ref(launch.kernel)}")
    assert n > 0
    assert not missed, f"seed {seed}: {len(missed)} unplanned compile requests, e.g. {list(missed.values())[:5]}"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *args], capture_output=True, text=True, cwd=REPO)


def small_manifest(tmp_path: Path, device_line: str, serving: str) -> Path:
    text = MANIFEST.read_text().replace('device = "H200"', device_line)
    text = text.split("[spec.serving]")[0] + "[spec.serving]\n" + serving + '\n[[kernels]]\nprovider = "prewarm.providers.fla_kda"\n'
    path = tmp_path / "fla.toml"
    path.write_text(text)
    return path


def test_without_a_device_the_plan_says_which_key_to_set(tmp_path):
    done = run_cli("plan", str(small_manifest(tmp_path, "", "prefill = false\ndecode_batch_buckets = [1]")))
    assert done.returncode == 3, done.stderr
    assert "[target] device = \"H200\"" in done.stderr and "Traceback" not in done.stderr


def test_decode_and_verify_build_offline_in_worker_processes_and_verify_clean(tmp_path):
    manifest = small_manifest(tmp_path, 'device = "H200"',
                              "prefill = false\ndecode_batch_buckets = [1, 64]\ndraft_widths = [3]")
    done = run_cli("build", str(manifest), "--cache-dir", str(tmp_path / "cache"), "--mode", "offline",
                   "--workers", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # fused_recurrent_kda: {bf16, fp32 gate} x {bf16, fp32 beta} x {equal-length, packed}; N, T never specialized
    assert (report["failed"], report["compiled"]) == (0, 8)
    check = run_cli("verify", "--cache-dir", str(tmp_path / "cache"), "--plan", str(manifest), "--json")
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def build_record_only(tmp_path: Path, record: str, entry_extra: str = "") -> dict:
    """`prewarm build --mode offline` of a manifest holding only the H200 target and ``record``; its JSON report."""
    (tmp_path / "m.toml").write_text('[target]\nbackend = "cuda"\narch = "sm_90"\ndevice = "H200"\n'
                                     f'[[kernels]]\nrecord = "{record}"\n{entry_extra}')
    built = run_cli("build", str(tmp_path / "m.toml"), "--cache-dir", str(tmp_path / "cache"), "--workers", "2",
                    "--mode", "offline", "--json")
    assert built.returncode == 0, built.stderr[-3000:]
    return json.loads(built.stdout)


RECORDED_FLA_APP = """
import sys
from prewarm.backends import get_target
get_target("cuda", "sm_90", "offline", "H200").activate()  # stands in for the GPU the recording was made on
from prewarm import tritoncompat
from prewarm.manifest import load
from prewarm.providers import fla_traffic
from prewarm.providers.fla_kda import intercepted

spec = load(sys.argv[1]).spec()
for call in fla_traffic.calls(spec, 11, 40, "meta"):
    if call.label.startswith(("decode", "verify")):  # what a server compiles at a launch (kept small: no prefill)
        with intercepted() as launches:
            call.run()
        for launch in launches:
            tritoncompat.warmup(launch.kernel, launch.args, launch.kwargs, grid=(1,))
"""


def test_a_record_only_manifest_over_an_fla_recording_from_another_host_builds_offline(tmp_path):
    """fla traffic recorded by `prewarm record` (options rewritten to another host's paths) -> a manifest of only
    that record and the device -> every request builds in workers, into the recording process's own keys."""
    import os

    app = tmp_path / "app.py"
    app.write_text(RECORDED_FLA_APP)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "app-cache")}
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "record", "-o", str(tmp_path / "local.jsonl"), "--",
                           sys.executable, str(app), str(MANIFEST)],
                          capture_output=True, text=True, cwd=REPO, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = []
    for line in (tmp_path / "local.jsonl").read_text().splitlines():
        entry = json.loads(line)
        data = json.loads(entry["specialization_data"])
        data["options"]["extern_libs"] = [["libdevice", "/h200/venv/triton/backends/nvidia/lib/libdevice.10.bc"]]
        lines.append(json.dumps({**entry, "specialization_data": json.dumps(data)}))
    (tmp_path / "h200.jsonl").write_text("\n".join(lines) + "\n")
    report = build_record_only(tmp_path, "h200.jsonl")
    assert report["failed"] == 0 and report["compiled"] == report["compiles"] >= 2
    assert {r["key"] for r in report["results"]} == {p.name for p in (tmp_path / "app-cache").iterdir()
                                                     if not p.name.startswith(".")} - _launcher_dirs(tmp_path / "app-cache")


def _launcher_dirs(cache: Path) -> set[str]:
    """Key dirs holding no kernel (a launcher .so or cuda_utils.so built at a launch)."""
    return {d.name for d in cache.iterdir() if d.is_dir() and not any(f.suffix == ".cubin" for f in d.iterdir())}


H200_RECORDING = REPO / "bench" / "results" / "fla-h200.jsonl"  # `prewarm record` around fla traffic, on the H200


def test_a_recording_made_on_the_h200_builds_offline_here_closed_over_beta(tmp_path):
    """The real recording (libdevice at the H200 machine's path, which this box lacks): one recorded request of each
    fla kernel, closed over beta's other dtype, builds here with nothing failed (the whole recording:
    manifests/fla-h200-recorded.toml)."""
    lines = [json.loads(line) for line in H200_RECORDING.read_text().splitlines()]
    libdevice = json.loads(lines[0]["specialization_data"])["options"]["extern_libs"][0][1]
    assert not Path(libdevice).exists()  # recorded on another machine: replay must normalize it
    one_each = {e["kernel"]: e for e in reversed(lines)}
    (tmp_path / "sample.jsonl").write_text("".join(json.dumps(e) + "\n" for e in one_each.values()))
    report = build_record_only(tmp_path, "sample.jsonl", 'close = true\n[kernels.close_dtypes]\nbeta = ["bfloat16", "float32"]\n')
    closed = [r for r in report["results"] if "closed" in r["label"]]
    assert report["failed"] == 0 and report["compiled"] == report["compiles"] == len(one_each) + len(closed)
    # beta is a pointer of 4 of the 8 kernels (recompute, intra token-parallel, inter+solve, recurrent)
    assert {r["kernel"].split(":")[1] for r in closed} >= {"fused_recurrent_kda_fwd_kernel",
                                                             "recompute_w_u_fwd_kda_kernel"}
