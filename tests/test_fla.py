"""fla-core 0.6.0's KDA, its whole public API, planned and built offline under the H200 profile
(prewarm.providers.fla.kda).

Coverage is checked against traffic written independently of the provider (``traffic.fla_kda``:
every option of chunk_kda / fused_recurrent_kda / fused_recurrent_kda_fwd / fused_kda_gate drawn per call, random
lengths, sequence counts, batch sizes, views) run through fla's public API on meta tensors: the cache key Triton
computes for every compile it requests must be a planned one's. Builds run as CLI processes, so the device profile
never reaches this test process's later tests.
"""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from traffic.closure import seeds
from prewarm.building import backends, tritoncompat
from prewarm import devices
from prewarm.planning.manifest import load
from prewarm.planning.plan import Compile, expand, expand_all, plan, resolve
from prewarm.building.probe import planned_keys
from traffic import fla_kda as fla_traffic
from prewarm_kernels.spec import SpecError, read_kda

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-fla.toml"


@pytest.fixture(scope="module")
def planned():
    """The shipped manifest planned in this process under the offline CUDA target with the H200 profile: its
    requests, every compile they expand to and the cache key of each (Triton computes them; nothing compiles;
    conftest puts torch.cuda and Triton's driver back after the module)."""
    m = load(MANIFEST)
    backends.activate_for_planning(m)
    p = plan(m)
    compiles = expand_all(p.requests)
    return m, p, compiles, planned_keys(compiles)


def test_the_shipped_h200_table_covers_every_planned_tuning_key(planned):
    """The offline bundle's autotune results come from the shipped table (see test_plan's test of the same name):
    every planned tuning key has its row, measured over the configs the Autotuner benchmarks now."""
    from prewarm_helpers import shipped_table_statuses

    m, p, *_ = planned
    statuses = shipped_table_statuses(m, p.requests)
    assert set(statuses) == {"in table"}, {k: v[:3] for k, v in statuses.items() if k != "in table"}


def test_the_plan_answers_as_the_h200_and_takes_fla_hopper_path(planned):
    import fla.utils.hardware as hw

    assert devices.active() is devices.PROFILES["H200"]
    assert hw.IS_NVIDIA_HOPPER and hw.device == "cuda" and hw.check_shared_mem("hopper")


def test_every_autotune_config_fla_keeps_is_a_compile(planned):
    """For each planned call of an autotuned fla kernel that prunes nothing, one compile per config."""
    from triton.runtime.autotuner import Autotuner

    _, p, _, _ = planned
    checked = 0
    for r in p.requests[::7]:  # a sample across every entry point (each request expands in ~ms per config)
        obj = resolve(r.kernel)
        while not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
            obj = obj.fn
        if isinstance(obj, Autotuner) and obj.early_config_prune is None and obj.perf_model is None:
            assert len({c.specialization for c in expand(r)}) == len(obj.configs), r.label
            checked += 1
    assert checked >= 8


def test_every_l2norm_token_bucket_of_the_envelope_is_planned(planned):
    """fla's own l2norm_fwd at token counts across the envelope picks only planned NB values."""
    import torch
    from fla.modules.norm.l2norm import l2norm_fwd

    from prewarm.providers.fla.kda import intercepted

    _, p, _, _ = planned
    nb_planned = {r.kwargs["NB"] for r in p.requests if r.kernel.endswith(":l2norm_fwd_kernel")}
    heads, d = 32, 128
    seen = set()
    for t in sorted({1, 2047, 2048, 2049, 16383, 16384, *random.Random(7).sample(range(1, 16385), 200)}):
        with intercepted() as launches:
            l2norm_fwd(torch.empty(1, t, heads, d, dtype=torch.bfloat16, device="meta"))
        seen |= {launch.kwargs["NB"] for launch in launches}
    assert seen == nb_planned == set(range(1, 9))


def test_the_options_measured_missing_on_the_h200_are_planned(planned):
    """Issue 24's misses on the H200: chunk_kda without a final state (STORE_FINAL_STATE), int32 cu_seqlens,
    A_log / dt_bias in bf16, fused_recurrent_kda_fwd writing into a pool by ssm_state_indices in place."""
    _, p, _, _ = planned

    def kwargs(kernel: str) -> list[dict]:
        return [r.kwargs for r in p.requests if r.kernel.endswith(f":{kernel}")]

    assert any(k["ht"] is None for k in kwargs("chunk_gated_delta_rule_fwd_kernel_h_blockdim64"))
    assert any((k["cu_seqlens"] or {}).get("tensor") == "int32" for k in kwargs("chunk_gla_fwd_kernel_o"))
    assert {k["A_log"]["tensor"] for k in kwargs("kda_gate_chunk_cumsum_vector_kernel")} >= {"bfloat16", "float32"}
    pool = [k for k in kwargs("fused_recurrent_kda_fwd_kernel") if k["ssm_state_indices"] is not None]
    assert any(k["INPLACE_FINAL_STATE"] and k["num_accepted_tokens"] is None for k in pool)  # decode
    assert {k["stride_indices_seq"] for k in pool if k["num_accepted_tokens"] is not None} == {1, 2, 4}  # [N, D]


def requested(label: str, run, into: dict[str, Compile]) -> None:
    """Run one fla call on meta tensors with its launches captured; add each compile request Triton's JIT makes for
    them (compiles skipped) to ``into``, labelled with the call."""
    from prewarm.providers.fla.kda import intercepted

    with intercepted() as launches:
        run()
    for launch in launches:
        with tritoncompat.compile_requests(skip=True) as captured:
            tritoncompat.warmup(launch.kernel, launch.args, launch.kwargs, grid=(1,))
        for data in captured:
            into.setdefault(data, Compile("", tritoncompat.kernel_ref(launch.kernel), label, data))


def missing(requests: dict[str, Compile], keys: dict) -> list[str]:
    """Each request whose cache key, computed by Triton, is not among ``keys``: its kernel and call."""
    return [f"{c.kernel} <- {c.label}" for key, c in planned_keys(list(requests.values())).items() if key not in keys]


def unplanned(spec: dict, seed: int, keys: dict) -> tuple[list[str], int, set[str]]:
    """Run 60 calls of the independent traffic on meta tensors: (each compile request whose cache key is not among
    ``keys``, labelled with its call; how many distinct requests; the options drawn)."""
    requests: dict[str, Compile] = {}  # one per compile request, labelled with the call that made it
    options: set[str] = set()
    for call in fla_traffic.calls(spec, seed, 60, "meta"):
        options |= {f"{k}={v}" for k, v in call.options.items()}
        requested(call.label, call.run, requests)
    return missing(requests, keys), len(requests), options


@pytest.mark.parametrize("seed", seeds())
def test_independent_fla_traffic_requests_nothing_the_plan_lacks(planned, seed):
    """Every compile the traffic requests is looked up under a key the plan builds (Triton's keys, no compile)."""
    m, _, compiles, keys = planned
    assert len(keys) == len(compiles)  # one key per planned compile
    missed, requested, options = unplanned(m.spec(), seed, keys)
    assert requested > 50 and {"entry=chunk_kda", "entry=fused_recurrent_kda_fwd"} <= options
    assert not missed, f"seed {seed}: {len(missed)} unplanned compile requests, e.g. {missed[:3]}"


def test_every_dtype_combination_of_the_continuous_batching_entrys_index_pointers_is_planned(planned):
    """fused_recurrent_kda_fwd, the call vLLM's and sglang's copies make, hands its kernel three index pointers:
    cu_seqlens, ssm_state_indices ([N] decode, [N, D] verify) and num_accepted_tokens, each its own pointer type.
    Every combination of their dtypes (absent, int32, int64; the H200 miss: int64 cu_seqlens from torch.tensor /
    cumsum with int32 slot indices), called through fla's entry on meta tensors, requests only keys the plan builds."""
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    H, K, N, D, slots = 32, 128, 3, 2, 16  # Kimi-Linear's heads; D: a draft width of the manifest

    def call(cu_seqlens, indices, accepted):
        W = D if accepted else 1  # tokens per sequence: [N] indices hold one (decode), [N, D] one per draft token
        B, T = (1, N * W) if cu_seqlens else (N, W)

        def t(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="meta")

        args = {"q": t(B, T, H, K), "k": t(B, T, H, K), "v": t(B, T, H, K), "g": t(B, T, H, K), "beta": t(B, T, H),
                "A_log": t(H, dtype=torch.float32), "dt_bias": t(H * K, dtype=torch.float32), "lower_bound": None,
                "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True,
                "initial_state": t(slots if indices else N, H, K, K, dtype=torch.float32)}
        if cu_seqlens:
            args["cu_seqlens"] = torch.tensor(range(0, N * W + 1, W), dtype=getattr(torch, cu_seqlens), device="meta")
        if indices:
            args["ssm_state_indices"] = t(*((N, D) if accepted else (N,)), dtype=getattr(torch, indices))
        if accepted:
            args["num_accepted_tokens"] = t(N, dtype=getattr(torch, accepted))
        return lambda: fused_recurrent_kda_fwd(**args)  # writes the state in place (fla's default)

    _, _, _, keys = planned
    combinations = [(cu, ind, acc) for cu, ind, acc in itertools.product([None, "int32", "int64"], repeat=3)
                    if ind or not acc]  # accepted counts index [N, D] state indices
    requests: dict[str, Compile] = {}
    for cu, ind, acc in combinations:
        requested(f"cu_seqlens={cu},ssm_state_indices={ind},num_accepted_tokens={acc}", call(cu, ind, acc), requests)
    assert len(requests) == len(combinations) == 21  # each combination is its own specialization
    misses = missing(requests, keys)
    assert not misses, "unplanned:\n" + "\n".join(misses)


def test_the_closure_check_sees_traffic_outside_the_plan(planned):
    """The same check against traffic the plan does not cover (chunk_kda at chunk size 32): it names the misses."""
    m, _, _, keys = planned
    spec = {**m.spec(), "serving": {**m.spec()["serving"], "chunk_size": [32], "recurrent_state": ["returned"]}}
    missed, _, _ = unplanned(spec, 5, keys)
    assert any(miss.startswith("fla.ops.gla.chunk:chunk_gla_fwd_kernel_o <- chunk_kda[") for miss in missed)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prewarm.cli", *args], capture_output=True, text=True, cwd=REPO)


def small_manifest(tmp_path: Path, device_line: str, serving: str, dtypes: str = 'activation = "bfloat16"') -> Path:
    """Kimi-Linear's KDA shape under ``[target] device_line`` with the given serving and dtypes tables."""
    path = tmp_path / "fla.toml"
    path.write_text(f'[target]\nbackend = "cuda"\narch = "sm_90"\n{device_line}\n'
                    "[spec.model]\nkda_heads = 32\nhead_k_dim = 128\nhead_v_dim = 128\n"
                    f"[spec.dtypes]\n{dtypes}\n[spec.serving]\n{serving}\n"
                    '[[kernels]]\nprovider = "prewarm.providers.fla.kda"\n')
    return path


def test_without_a_device_the_plan_says_which_key_to_set(tmp_path):
    done = run_cli("plan", str(small_manifest(tmp_path, "", "prefill = false\ndecode_batch_buckets = [1]")))
    assert done.returncode == 3, done.stderr
    assert "[target] device = \"H200\"" in done.stderr and "Traceback" not in done.stderr


# decode only, one way of calling fla: what a manifest narrows the API to (every other option left at one value)
NARROW = ("prefill = false\ndecode_batch_buckets = [1]\ngate_in_kernel = [true]\nqk_l2norm_in_kernel = [true]\n"
          "beta_sigmoid_in_kernel = [false]\nvarlen = [true]\n")
NARROW_DTYPES = 'activation = "bfloat16"\ngate = "bfloat16"\nbeta = "bfloat16"\ngate_params = "float32"\n'


def test_a_narrowed_option_is_planned_on_its_values_only_and_plan_says_so(tmp_path):
    """spec.serving.final_state = [true]: no recurrent call without a final state is planned, plan --json's options
    name the axis as set in the manifest, and plan's text prints it; an axis left alone is planned whole."""
    path = small_manifest(tmp_path, 'device = "H200"', NARROW + 'recurrent_state = ["returned"]\nfinal_state = [true]',
                          NARROW_DTYPES + 'index = "int32"')
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    rows = {r["key"]: r for r in doc["options"]["kernels[0] prewarm.providers.fla.kda"]}
    assert rows["spec.serving.final_state"] == {"key": "spec.serving.final_state", "planned": [True],
                                                "accepted": [False, True], "given": True, "narrowed": True}
    assert rows["spec.serving.initial_state"]["planned"] == [False, True] and not rows["spec.serving.initial_state"][
        "narrowed"]
    recurrent = [r["kwargs"] for r in doc["requests"] if r["kernel"].endswith(":fused_recurrent_kda_fwd_kernel")]
    assert len(recurrent) == 2 and all(k["ht"] is not None for k in recurrent)  # with and without initial state
    assert {k["h0"] is None for k in recurrent} == {True, False}
    text = run_cli("plan", str(path))
    assert text.returncode == 0, text.stderr[-3000:]
    assert "narrowed: kernels[0] prewarm.providers.fla.kda: spec.serving.final_state = [true] (set in the manifest; " \
        "the library accepts [false, true])" in text.stdout.replace("\n", " ")


@pytest.mark.parametrize("serving, dtypes, key, expected", [
    ("final_states = [true]", "", "spec.serving.final_states = [True]", "no such key here (known: "),
    ("chunk_size = [48]", "", "spec.serving.chunk_size = [48]", "out of [64, 32]"),
    ("final_state = true", "", "spec.serving.final_state = True", "a non-empty list of distinct values"),
    ("safe_gate = [true]", "", "spec.serving.safe_gate = [True]", "gate_lower_bound in [-5, 0)"),
    ("", 'state = ["fp32"]', "spec.dtypes.state = ['fp32']", "one of bfloat16, float16, float32"),
])
def test_a_misspelled_or_bad_option_is_an_error_naming_its_key(serving, dtypes, key, expected):
    spec = {"model": {"kda_heads": 32, "head_k_dim": 128, "head_v_dim": 128}, "serving": {}, "dtypes": {}}
    for table, text in (("serving", serving), ("dtypes", dtypes)):
        if text:
            spec[table] = tomllib.loads(text)
    with pytest.raises(SpecError) as e:
        read_kda(spec)
    assert key in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize("table, key, value", [("serving", "final_state", [True]), ("dtypes", "index", "int32"),
                                               ("model", "scale", 0.125)])
def test_an_fla_option_given_to_this_projects_provider_is_refused_not_ignored(table, key, value):
    from prewarm_kernels.kda import serving

    spec = {"backend": "cuda", "model": {"kda_heads": 4, "head_k_dim": 64, "head_v_dim": 64}}
    spec[table] = {**spec.get(table, {}), key: value}
    with pytest.raises(SpecError) as e:
        serving.launches(spec)
    assert f"spec.{table}.{key} = {value!r}: expected absent: an option of fla-core's KDA" in str(e.value)


def test_a_misspelled_option_fails_the_plan_with_file_key_and_exit_3(tmp_path):
    path = small_manifest(tmp_path, 'device = "H200"', "prefill = false\nfinal_states = [true]")
    done = run_cli("plan", str(path))
    assert done.returncode == 3 and "Traceback" not in done.stderr
    assert str(path) in done.stderr and "spec.serving.final_states = [True]: expected no such key here" in \
        done.stderr.replace("\n", " ")


def test_continuous_batching_decode_and_verify_build_offline_in_worker_processes_and_verify_clean(tmp_path):
    """fused_recurrent_kda_fwd writing into a state pool by ssm_state_indices ([N] decode, [N, D] + accepted counts
    verify), packed, each index pointer in both dtypes: built offline by worker processes, then verify --plan finds
    every compile."""
    manifest = small_manifest(tmp_path, 'device = "H200"', NARROW + 'draft_widths = [3]\n'
                              'recurrent_state = ["indexed", "indexed_spec"]', NARROW_DTYPES)
    done = run_cli("build", str(manifest), "--cache-dir", str(tmp_path / "cache"), "--mode", "offline",
                   "--workers", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # {int32, int64} per pointer: cu_seqlens x [N] indices (4), cu_seqlens x [N, D] indices x accepted counts for
    # D = 1 and 3 (the width is a constexpr stride: 8 each); N, T not specialized
    assert (report["failed"], report["compiled"]) == (0, 20)
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
from prewarm.building.backends import get_target
get_target("cuda", "sm_90", "offline", "H200").activate()  # stands in for the GPU the recording was made on
from prewarm.building import tritoncompat
from prewarm.planning.manifest import load
from traffic import fla_kda as fla_traffic
from prewarm.providers.fla.kda import intercepted

spec = load(sys.argv[1]).spec()
for call in fla_traffic.calls(spec, 11, 6, "meta"):
    if call.options["entry"] != "chunk_kda":  # what a server compiles at a launch (kept small: no prefill)
        with intercepted() as launches:
            call.run()
        for launch in launches:  # the recurrent kernel only (fused_kda_gate's autotuner would compile 24 configs)
            if tritoncompat.kernel_ref(launch.kernel).endswith(":fused_recurrent_kda_fwd_kernel"):
                tritoncompat.warmup(launch.kernel, launch.args, launch.kwargs, grid=(1,))
"""


def test_a_record_only_manifest_over_an_fla_recording_from_another_host_builds_offline(tmp_path):
    """fla traffic recorded by `prewarm record` (options rewritten to another host's paths) -> a manifest of only
    that record and the device -> every request builds in workers, into the recording process's own keys."""
    import os

    app = tmp_path / "app.py"
    app.write_text(RECORDED_FLA_APP)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "app-cache"),  # tests/ on the path: traffic.fla_kda
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)}
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


def test_every_parameter_of_flas_public_api_is_planned_or_said_not_to_be(planned):
    """Cover the API, not a picture of its callers: each parameter of the installed fla's entry points (read from
    their signatures) has a line in the provider's table saying what plans it, or is listed as not planned (and
    `prewarm plan` says so); a parameter a new fla adds fails here. Every argument the provider passes is one fla
    takes (a renamed one would otherwise land in **kwargs and be ignored)."""
    import inspect

    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.kda.gate import fused_kda_gate

    from prewarm.providers.fla import kda as fla_kda

    fns = {fn.__name__: fn for fn in (chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd, fused_kda_gate)}
    assert set(fns) == set(fla_kda.API)
    for name, fn in fns.items():
        params = set(inspect.signature(fn).parameters)
        assert params == set(fla_kda.API[name]), f"{name}: not in the table {params - set(fla_kda.API[name])}, " \
                                                 f"no longer in fla {set(fla_kda.API[name]) - params}"
    not_planned = {f"{fn}.{p}" for fn, table in fla_kda.API.items() for p, how in table.items()
                   if how.startswith("not planned")}
    assert not_planned == set(fla_kda.NOT_PLANNED)

    m, p, _, _ = planned
    spec = fla_kda._check(m.spec())
    tensors = fla_kda._Tensors(spec, "meta")
    taken = {"chunk_kda": set(inspect.signature(chunk_kda).parameters) | {"A_log", "dt_bias", "chunk_size"},
             "fused_recurrent_kda": set(inspect.signature(fused_recurrent_kda).parameters),
             "fused_recurrent_kda_fwd": set(inspect.signature(fused_recurrent_kda_fwd).parameters)}
    passed = {"chunk_kda": set().union(*(tensors.prefill(c) for c in fla_kda.prefills(spec)))}
    for r in fla_kda.recurrents(spec):
        fn = "fused_recurrent_kda" if r.mode == "returned" else "fused_recurrent_kda_fwd"
        passed.setdefault(fn, set()).update(tensors.recurrent(r))
    for fn, names in passed.items():
        assert names <= taken[fn], f"{fn}: the provider passes {names - taken[fn]}, which fla does not take"
    assert {"A_log", "dt_bias", "chunk_size"} <= passed["chunk_kda"]  # the **kwargs fla reads, as the table says
