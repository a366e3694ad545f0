"""Kimi-Linear's MLA layers on vLLM 0.34.0 reach no Triton kernel on the H200: what the vLLM provider's coverage row
``mla`` says (planned: nothing), checked against vLLM's own choices in its real install (``.ci/run`` runs this file in
``.venv-vllm`` only: the ``.venv`` stand-in tree carries no attention selector), under the H200 device profile (no GPU,
no driver: vLLM's platform answers as the profile's device).

vLLM's MLA layer for this model (``vllm.models.kimi_k3.nvidia.mla``, ``q_lora_rank`` null: the full-rank q path)
launches the backend vLLM's selector picks for the decode, the MLA prefill backend, its fused CUDA key-concat and
cache-insert epilogues, and for a long prefix the CUDA gather and ``merge_attn_states``. If vLLM picked TRITON_MLA
(no FA3) or the Triton merge (another dtype or head width), the layer would compile Triton kernels the plan does not
hold: these tests fail then, naming what vLLM picked.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prewarm.building.backends import get_target
from prewarm.planning.manifest import load

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "kimi-linear-h200-vllm.toml"
CONFIG = REPO / "tests" / "fixtures" / "model-configs" / "kimi-linear-48b-a3b-instruct" / "config.json"


@pytest.fixture(scope="module")
def deployment():
    get_target("cuda", "sm_90", "offline", "H200").activate()
    m = load(MANIFEST)
    cfg = json.loads(CONFIG.read_text())
    spec = m.spec()
    heads = cfg["num_attention_heads"] // spec["parallel"]["tensor_parallel"]
    return m, cfg, spec, heads


def test_vllm_picks_flashattention_mla_for_the_decode_and_flashattention_for_the_prefill(deployment):
    import torch
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig
    from vllm.v1.attention.selector import get_attn_backend

    _, cfg, spec, heads = deployment
    assert current_platform.get_device_name() == "NVIDIA H200"
    dtype = getattr(torch, spec["dtypes"]["activation"])
    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(block_size=spec["vllm"]["block_size"]))):
        decode = get_attn_backend(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], dtype, "auto", use_mla=True,
                                  num_heads=heads)
    assert decode.get_name() == "FLASH_ATTN_MLA", decode
    prefill = current_platform.get_mla_prefill_backend_cls(MLAPrefillSelectorConfig(dtype, MLADimensions(
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"])))
    assert prefill.get_name() == "FLASH_ATTN", prefill


def test_a_long_prefix_merges_in_vllms_cuda_op_not_its_triton_merge(deployment, monkeypatch):
    """vLLM's ``merge_attn_states`` (the MLA prefill over a chunked prefix) on this model's heads and v_head_dim, in
    the model dtype: the CUDA op is called, the Triton merge is not."""
    import torch
    from vllm import _custom_ops
    from vllm.v1.attention.ops import merge_attn_states as dispatch
    from vllm.v1.attention.ops import triton_merge_attn_states

    _, cfg, spec, heads = deployment
    called = []
    monkeypatch.setattr(_custom_ops, "merge_attn_states", lambda *a, **k: called.append("cuda"))
    monkeypatch.setattr(triton_merge_attn_states, "merge_attn_states", lambda *a, **k: called.append("triton"))
    dtype = getattr(torch, spec["dtypes"]["activation"])
    tokens = 7
    out = torch.empty(tokens, heads, cfg["v_head_dim"], dtype=dtype)
    lse = torch.zeros(heads, tokens, dtype=torch.float32)
    dispatch.merge_attn_states(out, out.clone(), lse, out.clone(), lse.clone())
    assert called == ["cuda"]


def test_the_plan_says_the_mla_layers_plan_nothing_and_why(deployment):
    from prewarm.providers.vllm.kda import coverage

    m, *_ = deployment
    rows = {r["component"]: r for r in coverage(m.spec())}
    assert rows["mla"]["planned"] == []
    why = rows["mla"]["not_planned"][0]["why"]
    assert "FLASH_ATTN_MLA" in why and "merge_attn_states" in why
