"""Kimi-Linear on vLLM 0.34.0 planned at model level around its KDA layers: the shipped H200 manifest's plan holds the
MoE's ``fused_moe_kernel`` at the configs vLLM's own lookup picks over every token count the deployment reaches, the V2
model runner's input-preparation and state-update kernels, its staged writes, the hybrid model state's mamba bookkeeping
and the MTP drafter's kernels; checked against independent model-level traffic (``tests/traffic/vllm_model.py``: written
from ``TritonExperts.apply`` and ``GPUModelRunner``; ``tests/traffic/vllm_step.py``: from ``RequestState``,
``BlockTables``, ``MambaHybridModelState`` and ``MTPSpeculator.propose``, with vLLM's own KV-cache grouping; neither
from the provider) by the key Triton computes for each compile request on fake tensors. The coverage hook says per
component what is planned and what the model reaches unplanned."""
from __future__ import annotations

from pathlib import Path

import pytest

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.building.probe import planned_keys
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for
from test_vllm import not_planned, runtime_compiles
from traffic import vllm_model as traffic
from traffic import vllm_step as step_traffic
from traffic.closure import fresh_seed

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
STEPS_PER_SEED = 40
RUNNER_KERNELS = {"_prepare_prefill_inputs_kernel", "_prepare_pos_seq_lens_kernel",
                  "_combine_sampled_and_draft_tokens_kernel", "_get_num_sampled_and_rejected_kernel",
                  "_post_update_kernel", "_post_update_num_computed_tokens_kernel", "_expand_idx_mapping_kernel",
                  "_gumbel_sample_kernel", "_gumbel_combine_kernel", "_compute_local_logits_stats_kernel",
                  "_rejection_kernel", "_resample_kernel", "_insert_resampled_kernel", "_gather_block_tables_kernel",
                  "_compute_slot_mappings_kernel"}


@pytest.fixture(scope="module")
def planned():
    m = load(MANIFEST)
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def _configs(p) -> set:
    """(BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages, naive) of each planned
    fused_moe_kernel compile."""
    out = set()
    for c in p.compiles:
        if c.kernel.endswith(":fused_moe_kernel"):
            s = tritoncompat.parse_specialization(c.specialization)
            a = s.args
            out.add((a["BLOCK_SIZE_M"].value, a["BLOCK_SIZE_N"].value, a["BLOCK_SIZE_K"].value,
                     a["GROUP_SIZE_M"].value, s.options["num_warps"], s.options["num_stages"],
                     a["naive_block_assignment"].value))
    return out


def test_the_moe_is_planned_at_every_config_vllm_picks_for_the_deployments_token_counts(planned):
    """No E=256,N=1024 bf16 config ships for the H200, so vLLM's defaults apply; they change at 32, 64, 96, 128 and
    512 tokens (tile M 16/32/64/128, N 64/128, K 128/64, 3 stages above 32 tokens, 8 warps above 128), and up to 8
    tokens (8 x top-8 x 4 <= 256 experts) the kernel takes the naive block assignment (no sorted token ids): 7
    variants, every one planned up to the 8192-token step budget (GROUP_SIZE_M stays 1 below 128 tokens per
    expert)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    _, p, _ = planned
    expected = set()
    for M in range(1, 8193):
        c = try_get_optimal_moe_config((256, 2048, 2304), (256, 2304, 1024), 8, None, M)
        expected.add((c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["GROUP_SIZE_M"], c["num_warps"],
                      c["num_stages"], M <= 8))
    assert len(expected) == 7 and _configs(p) == expected


def test_the_runner_kernels_are_planned(planned):
    _, p, _ = planned
    assert RUNNER_KERNELS <= {c.kernel.split(":")[1] for c in p.compiles if ".v1.worker.gpu." in c.kernel}
    # the sampler's kernel is planned on the model's bf16 logits and on their processed fp32 copy
    logits = {tritoncompat.parse_specialization(c.specialization).args["logits_ptr"].type for c in p.compiles
              if c.kernel.endswith(":_gumbel_sample_kernel")}
    assert logits == {"*bf16", "*fp32"}, logits


@pytest.mark.parametrize("seed", [11, fresh_seed()], ids=lambda s: f"seed{s}")
def test_model_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(traffic.calls(m.spec(), seed, STEPS_PER_SEED, "cuda"))
    compiles = runtime_compiles(calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    assert {c.options["kind"] for c in calls} >= {"moe", "prefill", "decode", "spec"}
    assert {c.options.get("processed") for c in calls} >= {True, False}
    kernels = {c.kernel.split(":")[1] for c in compiles.values()}
    assert "fused_moe_kernel" in kernels and RUNNER_KERNELS <= kernels, RUNNER_KERNELS - kernels


def test_the_traffic_would_catch_a_token_count_the_plan_lacks(planned):
    """The comparison can fail: a plan without the MoE's smallest token counts (the naive block assignment) misses
    what a one-token decode step launches."""
    m, p, keys = planned
    small = [c for c in p.compiles if c.kernel.endswith(":fused_moe_kernel")
             and tritoncompat.parse_specialization(c.specialization).args["naive_block_assignment"].value]
    assert small
    without = {k: c for k, c in keys.items() if c not in small}
    one_token = traffic._Steps(m.spec(), __import__("random").Random(0), "cuda")
    from traffic import Call

    compiles = runtime_compiles([Call("one token", lambda: one_token.moe_step(1))])
    assert not not_planned(list(compiles.values()), planned)
    assert not_planned(list(compiles.values()), (m, p, without))


def test_coverage_names_each_component_and_what_it_does_not_plan(planned):
    from prewarm.providers.vllm import kda

    m, p, _ = planned
    rows = {r["component"]: r for r in kda.coverage(m.spec())}
    assert set(rows) == {"kda", "moe", "runner", "sampler", "rejection_sampler", "staged", "mamba", "speculator", "mla",
                         "dense_mlp", "sampler_options"}
    by_component = {}
    for c in p.compiles:  # each compile's component: its label's first part
        by_component.setdefault(c.label.split("/")[0], set()).add(c.kernel)
    for name in ("kda", "moe", "runner", "sampler", "rejection_sampler", "staged", "mamba", "speculator",
                 "sampler_options"):
        assert rows[name]["planned"] and set(rows[name]["planned"]) == by_component[name], name
    assert all(item["what"] and item["why"] for r in rows.values() for item in r["not_planned"])
    # without the model tables only the layer is planned, and coverage says so
    spec = m.spec()
    bare = {**spec, "vllm": {k: v for k, v in spec["vllm"].items() if not k.startswith("moe_")}}
    rows = {r["component"]: r for r in kda.coverage(bare)}
    assert not rows["moe"]["planned"] and "absent" in rows["moe"]["not_planned"][0]["why"]


def test_prewarm_manifest_derives_the_model_keys_the_shipped_manifest_holds(tmp_path):
    """The MoE's widths and the runner's max_model_len / vocabulary come from config.json (and --max-model-len) as
    `prewarm manifest --server vllm` reads them: re-deriving the shipped manifest gives its values."""
    import subprocess
    import sys
    import tomllib

    from prewarm.providers.vllm.kda import MODEL_KEYS

    launch = ["--tensor-parallel-size", "1", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
              "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    out = tmp_path / "m.toml"
    for extra, length in (([], 1048576), (["--max-model-len", "65536"], 65536)):
        p = subprocess.run([sys.executable, "-m", "prewarm.cli", "manifest",
                            str(REPO / "tests/fixtures/model-configs/kimi-linear-48b-a3b-instruct"), "--server",
                            "vllm", "--target", "cuda:sm_90:H200", "-o", str(out), "--", *launch, *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        derived = tomllib.loads(out.read_text())["spec"]["vllm"]
        shipped = tomllib.loads(MANIFEST.read_text())["spec"]["vllm"]
        # (max_logprobs is written only where the launch line sets --max-logprobs: neither has it)
        assert {k: derived.get(k) for k in MODEL_KEYS} == {**{k: shipped.get(k) for k in MODEL_KEYS},
                                                           "max_model_len": length}


@pytest.mark.parametrize("change,key", [
    ({"moe_top_k": None}, "vllm.moe_top_k"),  # the MoE's widths come together
    ({"moe_top_k": 512}, "vllm.moe_top_k"),
    ({"moe_intermediate_size": 1001}, "vllm.moe_intermediate_size"),  # not divisible by TP 8
    ({"vocab_size": None}, "vllm.vocab_size"),
    ({"max_model_len": 0}, "vllm.max_model_len"),
])
def test_a_model_key_vllm_cannot_serve_is_refused_naming_it(change, key):
    from prewarm.providers.vllm import kda
    from prewarm_kernels.spec import SpecError

    import tomllib

    spec = tomllib.loads(MANIFEST.read_text())["spec"]
    spec["parallel"] = {"tensor_parallel": 8, "attention_dp": 1}
    spec["model"]["kda_heads"] = 32
    vllm = {k: v for k, v in {**spec["vllm"], **change}.items() if v is not None}
    spec = {**spec, "vllm": vllm, "backend": "cuda"}
    with pytest.raises(SpecError) as e:
        kda.model_components(spec, kda.read_spec(spec))
    assert e.value.key == key


# --- the runner step beyond input preparation: staged writes, mamba bookkeeping (tests/traffic/vllm_step.py) ---

STEP_STEPS_PER_SEED = 20
STEP_SEED = 3  # a seed whose steps reach every kernel below (a fresh seed's reach a subset)
STEP_KERNELS = {"_apply_write_kernel", "_scatter_num_accepted_kernel", "preprocess_mamba_align_fused_kernel",
                "precopy_mamba_align_fused_kernel", "get_aligned_state_indices_multi_group_kernel",
                "postprocess_mamba_fused_kernel", "_prepare_prefill_inputs_kernel", "_argmax_partial", "_argmax_finish",
                "_prepare_decode_inputs_kernel", "_update_draft_inputs_kernel", "_temperature_kernel", "_min_p_kernel",
                "_penalties_kernel", "_bincount_kernel", "_gather_draft_sampled_kernel"}


@pytest.mark.parametrize("seed", [STEP_SEED, fresh_seed()], ids=lambda s: f"seed{s}")
def test_step_traffic_requests_nothing_the_plan_lacks(planned, seed):
    m, _, _ = planned
    calls = list(step_traffic.calls(m.spec(), seed, STEP_STEPS_PER_SEED, "cuda"))
    compiles = runtime_compiles(calls)
    missing = not_planned(list(compiles.values()), planned)
    assert not missing, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): not planned:\n{missing}"
    assert {c.options["kind"] for c in calls} == {"staged", "mamba", "draft", "sampling", "verify"}
    kernels = {c.kernel.split(":")[1] for c in compiles.values()}
    assert kernels <= STEP_KERNELS and (seed != STEP_SEED or kernels == STEP_KERNELS), STEP_KERNELS ^ kernels


def test_the_kda_groups_vllm_makes_are_the_manifests(planned):
    """vLLM's hybrid allocator (its own grouping over config.json's 7 MLA and 20 KDA layers) makes 3 KDA groups,
    which the aligned-index kernel takes as a constexpr: the manifest's mamba_groups and the plan's NUM_GROUPS."""
    m, p, _ = planned
    steps = step_traffic._Steps(m.spec(), __import__("random").Random(0), "cuda")
    kv = steps.kv_cache_config()
    kda = [g for g in kv.kv_cache_groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    assert len(kda) == m.spec()["vllm"]["mamba_groups"] == 3 and len(kv.kv_cache_groups) == 4
    groups = {tritoncompat.parse_specialization(c.specialization).args["NUM_GROUPS"].value for c in p.compiles
              if c.kernel.endswith(":get_aligned_state_indices_multi_group_kernel")}
    assert groups == {3}


def test_the_traffic_would_catch_a_block_table_width_the_plan_lacks(planned):
    """The comparison can fail: the mamba block table's row stride (cdiv(max_model_len, block) + the speculative
    blocks: 515) is an int the state-copy kernels specialize on; a deployment whose max_model_len makes it a multiple
    of 16 requests keys this plan lacks."""
    m, _, _ = planned
    spec = m.spec()
    other = {**spec, "vllm": {**spec["vllm"], "max_model_len": (512 + 13) * 2048}}  # width 528 = 16 x 33
    calls = [c for c in step_traffic.calls(other, 1, 8, "cuda") if c.options["kind"] == "mamba"]
    assert calls
    assert not_planned(list(runtime_compiles(calls).values()), planned)
