"""Kimi-Linear's MLA layers in the sglang CUDA plan (``prewarm.providers.sglang.model_mla``): what a user of the
shipped H200 manifest gets planned for sglang's FA3 backend at each CUDA graph bucket and forward mode, what a
deployment without graphs or without MLA widths gets, and that the KV store follows sglang's own dispatch for the
target GPU. The independent check of these launches against traffic written from sglang's sources is not here."""
from __future__ import annotations

import copy

import pytest

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.providers.capture import launches_of
from prewarm.providers.sglang import model, model_mla
from prewarm.providers.sglang.common import fake_device, published_parallel, read_spec
from prewarm_kernels.spec import SpecError
from test_sglang import MANIFEST

KV_STORE_JIT = "sgl_kernel_jit_set_mla_kv_buffer_1024_128_1024_128_true"  # bf16: 512 x 2 nope, 64 x 2 rope bytes


def _plan(spec: dict) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """(label, kernel name, its arguments by name) of every MLA launch, and the sglang JIT modules reached."""
    s = read_spec(spec)
    out = []
    with published_parallel(s), fake_device(s.device) as device:
        for label, call in model_mla.calls(spec, s, s.device):
            for launch in launches_of(call):
                fn = tritoncompat.jit_function(launch.kernel)
                out.append((label, fn.fn.__name__, {**dict(zip(fn.arg_names, launch.args)), **launch.kwargs}))
    return out, [j.name for j in device.jit]


@pytest.fixture(scope="module")
def h200():
    get_target("cuda", "sm_90", "offline", "H200").activate()
    spec = load(MANIFEST).spec()
    return spec, read_spec(spec), _plan(spec)


def test_every_graph_bucket_gets_its_decode_and_verify_metadata(h200):
    """Decode (no delta) and chain verify (delta: the draft width) fill the page table at every --cuda-graph-bs
    bucket; tree verify builds its page table there with req_to_token's row (context + 4 + width) as a constexpr."""
    spec, s, (launches, _) = h200
    metadata = {(a["B"], a["SEQ_LEN_DELTA"]) for label, k, a in launches
                if k == "_fused_decode_metadata_kernel" and "draft" not in label}
    assert metadata == {(bs, d) for bs in s.graph_buckets for d in (0, *s.draft_widths)}
    context = spec["sglang"]["model"]["context_length"]
    tree = {(label.split("[")[1], a["req_to_token_stride"]) for label, k, a in launches
            if k == "create_trtllm_mha_kv_indices_triton"}
    assert tree == {(f"bs={bs},w={w}]", context + 4 + w) for bs in s.graph_buckets for w in s.draft_widths}
    assert s.graph_buckets == (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64) and s.draft_widths == (2, 3, 4)


def test_the_eagle_draft_graphs_get_their_step_and_draft_extend_metadata(h200):
    """The draft runners' FA3 backends at every bucket: a chain of width w drafts w - 1 steps, its draft graph's step
    backends 0..w - 3 fill the decode metadata with SEQ_LEN_DELTA step + 1 (width 2: none; 3: delta 1; 4: deltas 1
    and 2); the draft-extend graph records draft_extend_set_metadata (page size 1, no SWA) at every width, each
    over req_to_token's row of context + 4 + w."""
    spec, s, (launches, _) = h200
    context = spec["sglang"]["model"]["context_length"]
    steps = {(a["B"], a["SEQ_LEN_DELTA"], a["req_to_token_stride_0"]) for label, k, a in launches
             if k == "_fused_decode_metadata_kernel" and "graph_draft_metadata" in label}
    assert steps == {(bs, d, context + 4 + w) for bs in s.graph_buckets for w, d in ((3, 1), (4, 1), (4, 2))}
    extend = {(a["B"], a["req_to_token_stride_0"], a["PAGE_SIZE_ONE"], a["HAS_SWA"]) for _, k, a in launches
              if k == "_draft_extend_metadata_kernel"}
    assert extend == {(bs, context + 4 + w, True, False) for bs in s.graph_buckets for w in s.draft_widths}


def test_the_kv_store_is_sglangs_jit_module_on_hopper_and_prefill_concats_both_rope_layouts(h200):
    """On sm_90 sglang writes bf16 latent rows with its JIT set_mla_kv_buffer (planned as a JIT request, no Triton
    store); prefill's K concat takes k_pe as the latent row's slice (pitch 576) and as the cache's read-back copy
    (pitch 64); a prefix read back gathers its indices and rows."""
    _, _, (launches, jit) = h200
    kernels = {k for _, k, _ in launches}
    assert KV_STORE_JIT in jit and "set_mla_kv_buffer_kernel" not in kernels
    assert {a["rope_stride0"] for _, k, a in launches if k == "concat_and_cast_mha_k_kernel"} == {576, 64}
    assert {a["head_cnt"] for _, k, a in launches if k == "concat_and_cast_mha_k_kernel"} == {32}
    assert {"create_flashinfer_kv_indices_triton", "create_chunked_prefix_cache_kv_indices",
            "get_mla_kv_buffer_kernel"} <= kernels
    assert {k.split(":")[1] for k in model_mla.KERNELS} == kernels


def test_a_deployment_without_graphs_plans_no_graph_metadata(h200):
    spec, _, _ = h200
    eager = copy.deepcopy(spec)
    eager["serving"]["decode_batch_buckets"] = []
    launches, jit = _plan(eager)
    kernels = {k for _, k, _ in launches}
    assert not kernels & {"_fused_decode_metadata_kernel", "_draft_extend_metadata_kernel",
                          "create_trtllm_mha_kv_indices_triton"}
    assert "concat_and_cast_mha_k_kernel" in kernels and KV_STORE_JIT in jit


def test_no_mla_widths_plan_nothing_and_coverage_says_why(h200):
    spec, _, _ = h200
    bare = copy.deepcopy(spec)
    del bare["sglang"]["model"]["kv_lora_rank"]
    assert _plan(bare) == ([], [])
    entry = model_mla.coverage(bare)
    assert entry["planned"] == [] and "kv_lora_rank" in entry["not_planned"][0]["why"]
    assert model_mla in model.COMPONENTS and not any(name == "mla" for name, _, _ in model.NOT_PLANNED)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("qk_rope_head_dim", "64"),
                                        ("context_length", None)])
def test_a_bad_mla_width_names_its_key(h200, key, value):
    spec, _, _ = h200
    bad = copy.deepcopy(spec)
    if value is None:
        del bad["sglang"]["model"][key]
    else:
        bad["sglang"]["model"][key] = value
    with pytest.raises(SpecError, match=f"sglang.model.{key}"):
        list(model_mla.calls(bad, read_spec(bad), "cuda"))


def test_without_pdl_the_kv_store_is_sglangs_triton_kernel(h200):
    """sglang's dispatch, not the planner's: on an A100 (sm_80, no PDL) the same store is the Triton kernel with the
    whole 576-wide row in one block."""
    spec, _, _ = h200
    get_target("cuda", "sm_80", "offline", "A100").activate()
    try:
        launches, jit = _plan(spec)
    finally:
        get_target("cuda", "sm_90", "offline", "H200").activate()
    stores = [a for _, k, a in launches if k == "set_mla_kv_buffer_kernel"]
    assert stores and KV_STORE_JIT not in jit
    assert {(a["nope_dim"], a["rope_dim"], a["BLOCK"], a["buffer_stride"]) for a in stores} == {(512, 64, 1024, 576)}
