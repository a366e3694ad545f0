"""Target verify's causal conv (sglang's ``_causal_conv1d_update_kernel``) planned on the speculative conv windows
as sglang 0.5.23 lays them out for KDA, checked by the key Triton computes for each launch.

sglang's ``MambaPool`` deduplicates the per-draft-step conv windows (one ``[draft + kernel - 2, dim]`` buffer per
slot, an overlapping view) only where ``conv_window_dedup_enabled`` allows it, which it never does for KDA: Kimi's
``KimiLinearCacheParams.is_kda`` is True and its state shape sets ``disable_conv_window_dedup`` (the backend transposes
the window before the conv, which the overlapping view cannot take). So a linear draft chain gets the dense
``[layers, requests + 1, draft, kernel - 1, dim]`` windows a tree gets, and the conv update's constexprs
``stride_inter_seq`` / ``stride_inter_step`` are ``draft x (kernel - 1) x dim`` / ``(kernel - 1) x dim`` (36864 at
Kimi-Linear 48B's TP 1). A plan drawn on the deduplicated picture ((draft + 2) x 12288 / 12288) missed every chain
verify launch of a real run: an H100 compiled them in each fresh process.

The launches here are the layer traffic's (``traffic.sglang_layer``: its pool written from ``memory_pool.py``, not
from the provider), through sglang's own ``KDAAttnBackend``; where sglang itself is installed (``.venv-sglang``) its
own ``MambaPool`` is built too and must lay the windows out as the traffic and the plan's derived geometry do.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest

from prewarm.building.backends import get_target
from prewarm.building.probe import planned_keys
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan_for
from prewarm.providers.sglang import common as sglang_env
from prewarm.providers.sglang import cuda as sglang_cuda
from test_sglang import MANIFEST, runtime_compiles
from traffic import Call, sglang_layer

CONV_UPDATE = "_causal_conv1d_update_kernel"
BATCHES = (1, 2, 3, 16, 17, 65, 128)  # each int class of the launch's batch; odd and even, past the graph buckets


def _narrowed(m):
    """The shipped manifest narrowed to target verify and one dtype per role (the verify conv's keys do not depend on
    the other paths; each role's first dtype is one the deployment runs)."""
    spec = {**m.spec_table, "dtypes": {role: [names[0]] for role, names in
                                       sglang_env.read_spec(m.spec()).dtypes.items()},
            "sglang": {**m.spec_table["sglang"], "paths": ["target_verify"]}}
    return dataclasses.replace(m, spec_table=spec)


@pytest.fixture(scope="module")
def planned():
    m = _narrowed(load(MANIFEST))
    p = plan_for(m, get_target("cuda", "sm_90", "offline", "H200"))
    return m, p, planned_keys(p.compiles)


def _verify_calls(m, widths_trees) -> list[Call]:
    """The layer traffic's target verify at each (draft width, tree) and batch size, dense (and for a chain ragged),
    on its own pools."""
    s = sglang_env.read_spec(m.spec())
    traffic = sglang_layer._Traffic(s, random.Random(0), "cuda")
    roles = {role: names[0] for role, names in s.dtypes.items()}
    out = []
    for width, tree in widths_trees:
        for row in s.beta_row_strides:
            for batch in BATCHES:
                ragged = [[1 + i % width for i in range(batch)]] if not tree else []  # ragged: a chain only
                for lens in [[width] * batch, *ragged]:
                    d = dict(kind="target_verify", **roles, beta_row=row, batch=batch, slots=list(range(1, batch + 1)),
                             tracked=[False] * batch, width=width, tree=tree, lens=lens, accepted=[1] * batch,
                             seq_lens=[1] * batch)
                    out.append(traffic.call(len(out), d))
    return out


def _conv_updates(compiles) -> list:
    return [c for c in compiles.values() if c.kernel.endswith(f":{CONV_UPDATE}")]


def test_chain_verify_conv_launches_on_dense_windows_are_planned(planned):
    """Chain verify (topk 1) at every draft width: the conv update's window strides are the dense layout's, and every
    launch's key is in the plan (before the fix: none of them was)."""
    m, _, keys = planned
    s = sglang_env.read_spec(m.spec())
    window, dim = s.conv_kernel - 1, 2 * s.heads * s.head_k_dim + s.heads * s.head_v_dim
    compiles, _ = runtime_compiles(m.spec(), _verify_calls(m, [(w, False) for w in s.draft_widths]))
    conv = _conv_updates(compiles)
    strides = {(c.parsed.args["stride_inter_seq"].value, c.parsed.args["stride_inter_step"].value) for c in conv}
    assert strides == {(w * window * dim, window * dim) for w in s.draft_widths}
    missing = [c.label for key, c in planned_keys(conv).items() if key not in keys]
    assert not missing, f"{len(missing)} of {len(conv)} chain verify conv compiles not planned, e.g. {missing[:3]}"


def test_tree_verify_conv_launches_are_planned(planned):
    """Tree verify (topk > 1) at every draft width, on the same dense windows, with the retrieve tables as EAGLE
    builds them (``traffic.sglang_layer``: rows of one ``[3, bs, draft]`` int64 buffer): at an odd draft width and an
    odd batch retrieve_next_token's pointer is not 16-byte aligned, another specialization class and a compile of its
    own, which a real run's eager tree verify makes (batches past the largest --cuda-graph-bs bucket)."""
    m, _, keys = planned
    s = sglang_env.read_spec(m.spec())
    compiles, _ = runtime_compiles(m.spec(), _verify_calls(m, [(w, True) for w in s.draft_widths]))
    conv = _conv_updates(compiles)
    assert conv and all(c.parsed.args["HAS_EAGLE_TREE_CUSTOM_ATTN_MASK"].value for c in conv)
    assert {("tt.divisibility", 16) in c.parsed.args["retrieve_next_token_ptr"].attrs for c in conv} == {True, False}
    missing = [c.label for key, c in planned_keys(conv).items() if key not in keys]
    assert not missing, f"{len(missing)} of {len(conv)} tree verify conv compiles not planned, e.g. {missing[:3]}"


def test_the_derived_window_strides_are_the_traffics_pool(planned):
    """``prewarm plan``'s derived geometry (the verify conv window's slot stride) is the stride of the traffic's pool,
    chain and tree alike."""
    m, _, _ = planned
    s = sglang_env.read_spec(m.spec())
    derived = {key: value for key, value, _ in sglang_cuda.geometry(s)}
    traffic = sglang_layer._Traffic(s, random.Random(0), "cuda")
    roles = {role: names[0] for role, names in s.dtypes.items()}
    with sglang_env.fake_device("cuda"):
        for width in s.draft_widths:
            for tree in (False, True):
                server = sglang_layer._Server(traffic, {**roles, "width": width, "tree": tree})
                window = server.pool.mamba2_layer_cache(s.layers - 1).intermediate_conv_window[0]
                assert window.stride(0) == derived[f"verify conv window slot stride, draft {width}"], (width, tree)
                assert window.is_contiguous(), (width, tree)


def _sglang_installed() -> bool:
    """Whether sglang itself is importable here (its memory pool), not the build/sglang stand-in."""
    try:
        return importlib.util.find_spec("sglang.srt.configs.mamba_utils") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _sglang_installed(), reason="sglang's own memory pool is not installed here (the "
                    "build/sglang stand-in): run in .venv-sglang")
def test_sglangs_own_mamba_pool_lays_the_windows_out_as_planned():
    """sglang's own ``MambaPool`` for Kimi-Linear's state (``KimiLinearStateShape.create``), chain (topk 1) and tree,
    at each draft width: its conv windows have the strides the plan derives (its constructor's warm-up copy kernel
    captured, not run)."""
    from prewarm.providers import capture
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    m = load(MANIFEST)
    s = sglang_env.read_spec(m.spec())
    derived = {key: value for key, value, _ in sglang_cuda.geometry(s)}
    get_target("cuda", "sm_90", "offline", "H200").activate()
    shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=s.heads, head_dim=s.head_k_dim,
                                        conv_kernel_size=s.conv_kernel)
    params = KimiLinearCacheParams(shape=shape, layers=list(range(s.layers)))
    with sglang_env.published_parallel(s), sglang_env.fake_device("cuda"):
        for width in s.draft_widths:
            for topk in (1, 4):
                pools = []
                capture.launches_of(lambda: pools.append(MambaPool(
                    size=s.mamba_pool_slots - 1, spec_state_size=s.max_batch, cache_params=params,
                    mamba_layer_ids=list(range(s.layers)), device="cuda", speculative_num_draft_tokens=width,
                    speculative_eagle_topk=topk)))
                window = pools[0].mamba_cache.intermediate_conv_window[0][s.layers - 1]
                assert window.stride(0) == derived[f"verify conv window slot stride, draft {width}"], (width, topk)
                assert window.stride(1) == (s.conv_kernel - 1) * window.shape[-1], (width, topk)
