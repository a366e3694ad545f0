"""Running sglang's KDA kernels where there is no device: what the sglang providers and their traffic share.

sglang 0.5.23 makes host-side decisions from the tensors it is given, and planning must make each as the node does:

- ``fused_sigmoid_gating_delta_rule_update`` derives the constexpr ``SPLIT_N_HV_GRID`` from ``q.device.type``
  (``"cuda"`` on the H200, ``"npu"`` on Ascend): on ``meta`` tensors it would plan a variant no server compiles.
  :func:`fake_device` makes the tensors created inside live on the target's device type, faked by torch's
  ``FakeTensorMode`` (shapes, strides, storage offsets; no memory, no device, nothing runs).
- ``chunk_kda`` counts chunks on the host (``prepare_chunk_indices``: ``.tolist()`` of ``cu_seqlens``), which a fake
  tensor cannot answer; so do sgl-kernel-npu's wrappers, with their own copy. ``capture.index_tensor`` keeps the values
  beside a fake index tensor, and inside :func:`fake_device` each library's ``prepare_chunk_indices`` computes from
  them with its own function on the CPU. Data-dependent shapes (the Ascend backend's ``nonzero()`` over valid state
  rows) get unbacked sizes from a shape environment; no Triton launch receives one.
- ``fused_recurrent_kda_packed_decode`` hands bf16 batches of 8 or more to a CUDA JIT module (sglang's ``load_jit``:
  tvm_ffi + nvcc, ``kda_packed_decode``), not a Triton kernel. Inside :func:`fake_device` sglang's own ``load_jit``
  resolves the module it would build and a stand-in takes the call (:func:`prewarm.providers.sglang.jit.
  capture_requests`): the modules reached (:attr:`FakeDevice.jit`) are the plan's JIT requests, built by sglang's own code (:mod:`prewarm.jit`).

:func:`read_spec` is the manifest's envelope as both see it. The deviceless machinery itself (fake tensors, index
values, launch capture, ``as_meta``) is :mod:`prewarm.providers.capture`'s, shared with vLLM's provider.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator

from prewarm_kernels.spec import SpecError

from ..capture import fake_tensors
from ..kdaspec import read_server_kda

FLA_PACKAGE = "sglang.kernels.ops.attention.fla"
# package -> the module whose prepare_chunk_indices its kernels' wrappers import (each reads cu_seqlens on the host)
CHUNK_INDEX_HOMES = {FLA_PACKAGE: f"{FLA_PACKAGE}.index", "sgl_kernel_npu": "sgl_kernel_npu.fla.utils"}
# The forward paths of each backend's sglang KDA backend: on cuda TritonKDAKernel's methods as kda_backend.py calls
# them; on npu AscendKDAAttnBackend's forward modes (ascend_kda_backend.py, driven whole)
PATHS = {"cuda": ("extend", "packed_decode", "decode", "target_verify"),
         "npu": ("extend", "decode", "target_verify")}
# npu: the prefill layouts (spec.sglang.prefill): 0.5.23's (torch.ops.npu.chunk_kda_fwd, a CANN op, between Triton
# kernels) and the user report's era (a Triton decomposition: sglang's cumsum and kkt, sgl-kernel-npu's solve,
# recompute, state and output kernels)
PREFILLS = ("cann", "triton")
# [spec.sglang] keys each backend reads, beside paths and track_state
# (cuda "model": the model's widths, [spec.sglang.model], read by the model components: prewarm.providers.sglang.model)
BACKEND_KEYS = {"cuda": ("beta_row_strides", "eagle_tree", "sampling_backend", "mamba_pool_slots", "conv_kernel",
                         "model"),
                "npu": ("beta_row_strides", "prefill", "mamba_pool_slots", "conv_kernel",
                        "model")}  # npu "model": Kimi K3's widths, read by prewarm.providers.sglang.ascend_model
ROLES = ("activation", "gate", "beta", "gate_params", "state", "index")  # [spec.dtypes] roles, in label order
# cuda: sglang's --sampling-backend values; "flashinfer" (sglang's default where FlashInfer is installed) builds
# FlashInfer's sampling module at the first request with temperature > 0, after the server says ready
SAMPLING_BACKENDS = ("flashinfer", "pytorch")
MAX_PREFILL_TOKENS = 16384  # a prefill batch's token budget when the spec gives none (sglang's chunked prefill)


@dataclass(frozen=True)
class SglangSpec:
    """The envelope of one sglang KDA deployment (one attention rank), as both the provider and the traffic read it."""

    backend: str  # the target's: "cuda" | "npu"
    heads: int  # KDA heads per attention rank
    head_k_dim: int
    head_v_dim: int
    layers: int  # the model's KDA layers (on npu the mamba pools' layer count)
    lower_bound: float | None  # the model's gate lower bound (safe gate), or None
    dtypes: dict  # role (ROLES) -> dtype names
    paths: tuple  # TritonKDAKernel paths the deployment reaches (PATHS)
    max_batch: int  # the largest decode batch: max(largest graph bucket, max_running_requests)
    graph_buckets: tuple  # --cuda-graph-bs: the decode / verify batch sizes the graph runner captures (sorted)
    draft_widths: tuple  # speculative draft token counts > 1
    max_prefill_tokens: int
    beta_row_strides: tuple  # per-token strides of raw beta as the model hands it over
    eagle_tree: bool  # tree verify (--speculative-eagle-topk > 1: retrieve_parent_token)
    track_state: bool  # the prefix cache's per-chunk state snapshot in prefill (track_state)
    prefill: tuple = ()  # npu: PREFILLS planned
    mamba_pool_slots: int = 0  # the mamba state pool's slots (its size + the padding slot): npu, a conv pool
    # stride; cuda, the conv kernels' constexpr num_cache_lines
    conv_kernel: int = 4  # the short conv's kernel size (the conv state window is kernel - 1, on npu + drafts - 1)
    sampling_backend: str = ""  # cuda: --sampling-backend (SAMPLING_BACKENDS): "flashinfer" JIT-builds its sampling module
    parallel: tuple = (1, 1)  # [spec.parallel] (tensor_parallel, attention_dp): --tp-size, --attn-dp-size

    @property
    def device(self) -> str:
        """The torch device type sglang's tensors live on there (the backend's name: cuda, npu)."""
        return self.backend

    def dtype_combos(self) -> list[dict]:
        """Every combination of one dtype per role (the cross product the plan covers)."""
        return [dict(zip(ROLES, combo)) for combo in itertools.product(*(self.dtypes[r] for r in ROLES))]


def read_spec(spec: dict) -> SglangSpec:
    """The KDA serving spec (``read_kda``: model, parallel, dtypes, serving) plus the ``[spec.sglang]`` table:

        paths = every path the backend reaches (PATHS)
        track_state = true
        beta_row_strides = cuda: [heads, 3*heads*head_k_dim + heads + 2*head_k_dim]: raw beta as its own tensor and
                           as a view of Kimi-Linear's fused q/k/v/beta/f_a/g_a projection (both rows per rank);
                           npu: [heads]
        eagle_tree = true (cuda)
        sampling_backend = "flashinfer" (cuda: sglang's default; "pytorch" builds nothing)
        prefill = ["cann", "triton"] (npu)
        mamba_pool_slots = the mamba pool's size + 1 (cuda: required, the conv kernels' num_cache_lines is a
                           constexpr; npu: required with target_verify)
        conv_kernel = 4 (the model's short conv kernel size)

    A bad value is a SpecError naming ``spec.<key>``."""
    read, extra = read_server_kda(
        spec, "sglang", "sglang", tuple(PATHS), f"one of {', '.join(PATHS)} ([target] backend): sglang's KDA kernels",
        {"qk_l2norm": "TritonKDAKernel always L2-normalises q and k in-kernel",
         "fused_gate": "sglang's KDA backend always hands the raw gate with A_log and dt_bias"})
    backend = read["backend"]
    known = sorted(("paths", "track_state") + BACKEND_KEYS[backend])
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise SpecError(f"sglang.{unknown[0]}", extra[unknown[0]],
                        f"no such key for the {backend} backend (known: {', '.join(known)})")
    h, K = read["heads"], read["head_k_dim"]
    paths = extra.get("paths", list(PATHS[backend]))
    if not isinstance(paths, list) or not paths or len(set(paths)) != len(paths) or \
            any(p not in PATHS[backend] for p in paths):
        raise SpecError("sglang.paths", paths, f"a non-empty list of distinct paths out of {list(PATHS[backend])} "
                        f"(on {backend})")
    rows = extra.get("beta_row_strides", [h, 3 * h * K + h + 2 * K] if backend == "cuda" else [h])
    if not isinstance(rows, list) or not rows or len(set(rows)) != len(rows) or \
            any(not isinstance(r, int) or isinstance(r, bool) or r < h for r in rows):
        raise SpecError("sglang.beta_row_strides", rows, f"a non-empty list of distinct integers >= the heads per "
                        f"rank ({h}): beta's per-token stride in each layout the model hands it over")
    switches = {"eagle_tree": False}
    for key in ("eagle_tree", "track_state"):
        if key in known:
            switches[key] = extra.get(key, True)
            if not isinstance(switches[key], bool):
                raise SpecError(f"sglang.{key}", switches[key], "true or false")
    own = {}  # the backend's own keys (BACKEND_KEYS)
    if backend == "cuda":
        own["sampling_backend"] = extra.get("sampling_backend", SAMPLING_BACKENDS[0])
        if own["sampling_backend"] not in SAMPLING_BACKENDS:
            raise SpecError("sglang.sampling_backend", own["sampling_backend"],
                            f"one of {', '.join(SAMPLING_BACKENDS)} (sglang's --sampling-backend)")
    pool_why = {"npu": "conv_state_rollback takes the conv pool's layer stride as a constexpr",
                "cuda": "sglang's causal conv kernels take it as the constexpr num_cache_lines"}[backend]
    for key, least, why in (("mamba_pool_slots", 2, f"the mamba state pool's slots (sglang's mamba pool size + 1): "
                             f"{pool_why}"),
                            ("conv_kernel", 2, "the model's short conv kernel size (config.json)")):
        value = extra.get(key, 4 if key == "conv_kernel" else None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise SpecError(f"sglang.{key}", value, f"an integer >= {least}: {why}")
        own[key] = value or 0
    if backend == "npu":
        own["prefill"] = extra.get("prefill", list(PREFILLS))
        if not isinstance(own["prefill"], list) or not own["prefill"] or \
                len(set(own["prefill"])) != len(own["prefill"]) or any(p not in PREFILLS for p in own["prefill"]):
            raise SpecError("sglang.prefill", own["prefill"], f"a non-empty list out of {list(PREFILLS)}")
        own["prefill"] = tuple(own["prefill"])
    decoding = any(p in paths for p in ("packed_decode", "decode", "target_verify"))
    max_batch = max([*read["decode_batch_buckets"], read["max_running_requests"] or 0])
    if decoding and not max_batch:
        raise SpecError("serving.max_running_requests", ..., "the largest decode batch (or decode_batch_buckets): "
                        "sglang runs eager decode batches of any size up to it")
    if not own["mamba_pool_slots"] and (backend == "cuda" or "target_verify" in paths):
        raise SpecError("sglang.mamba_pool_slots", ..., f"the mamba state pool's slots (sglang's mamba pool size + "
                        f"1): {pool_why} (prewarm manifest writes it from --max-mamba-cache-size)")
    return SglangSpec(backend=backend, heads=h, head_k_dim=K, head_v_dim=read["head_v_dim"], layers=read["layers"],
                      lower_bound=read["gate_lower_bound"], dtypes={r: read["dtypes"][r] for r in ROLES},
                      paths=tuple(paths), max_batch=max(max_batch, 1),
                      graph_buckets=tuple(sorted(set(read["decode_batch_buckets"]))),
                      draft_widths=tuple(sorted(d for d in read["draft_widths"] if d > 1)),
                      max_prefill_tokens=read["max_prefill_tokens"] or MAX_PREFILL_TOKENS,
                      beta_row_strides=tuple(rows), **switches, **own,
                      parallel=tuple((spec.get("parallel") or {}).get(k, 1) for k in ("tensor_parallel", "attention_dp")))


@dataclass
class Batch:
    """The fields of sglang's ``ForwardBatch`` that the KDA backends' forward paths read (the scheduler fills them
    on a node)."""

    forward_mode: Any
    batch_size: int
    extend_prefix_lens: Any = None
    extend_seq_lens_cpu: list | None = None
    spec_info: Any = None
    mamba_track_mask: Any = None


class MambaPoolView:
    """What the KDA backends read of sglang's hybrid request pool, over a provider's ``conv``, ``temporal``,
    ``intermediate_ssm`` tensors (all layers) and ``mamba_map`` (layer id -> layer index): the whole cache, one
    layer's (views of each), the speculative parameters; no ReplaySSM buffers."""

    @property
    def mamba_pool(self):
        return SimpleNamespace(mamba_cache=self._cache(), enable_linear_replayssm=False)

    def _cache(self, layer: int | None = None):
        pick = (lambda t: t) if layer is None else (lambda t: None if t is None else t[layer])
        return SimpleNamespace(conv=[pick(self.conv)], temporal=pick(self.temporal),
                               intermediate_ssm=pick(self.intermediate_ssm), replayssm_d=None, replayssm_k=None,
                               replayssm_g=None, **self._cache_extras(pick))

    def _cache_extras(self, pick) -> dict:
        """A backend's further cache fields, each through ``pick`` (the whole tensor or one layer's)."""
        return {}

    def mamba2_layer_cache(self, layer_id: int):
        return self._cache(self.mamba_map[layer_id])

    def get_speculative_mamba2_params_all_layers(self):
        return self._cache()


def hybrid_backend(hybrid_class, linear_backend):
    """``hybrid_class`` (the backend's ``HybridLinearAttnBackend``) around ``linear_backend``; its full-attention
    half is not KDA's: a stand-in sharing the request pool, whose CUDA-graph state and metadata hooks do nothing."""
    full = SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=linear_backend.req_to_token_pool,
                           kv_index_translator=None, needs_cpu_seq_lens=False,
                           use_captured_forward_metadata_for_breakable_cuda_graph=False,
                           init_cuda_graph_state=lambda max_bs, max_num_tokens: None,
                           init_forward_metadata_out_graph=lambda forward_batch, in_capture=False: None)
    return hybrid_class(full, linear_backend, [])


@contextlib.contextmanager
def published_parallel(s: SglangSpec) -> Iterator[None]:
    """Within the block sglang's parallel configuration is the deployment's, as a server's ``publish`` leaves it in
    ``sglang.srt.runtime_context``: the ``parallel`` namespace of its server args (``--tp-size`` and
    ``--attn-dp-size`` from ``[spec.parallel]``, every other flag at sglang's own default) and the widths publish
    derives from it (``parallel_widths_of``, ``num_dp_ranks_of``; attention DP on where its width is above 1),
    stated with sglang's own ``get_parallel().override``. sglang's code reads it where a planner drives it
    (``get_eager_max_batch_size``: whether eager batches pad to the attention-TP size). No process group is built."""
    import msgspec
    from sglang.srt import runtime_context
    from sglang.srt.arg_groups.fields.parallel import Parallel

    tp, dp = s.parallel
    config = Parallel(tp_size=tp, attn_dp_size=dp)
    published = {**msgspec.structs.asdict(config), **runtime_context.parallel_widths_of(config),
                 "attn_dp_enabled": dp > 1, "num_dp_ranks": runtime_context.num_dp_ranks_of(config)}
    with runtime_context.get_parallel().override(**published):
        yield


@dataclass
class FakeDevice:
    """The device a :func:`fake_device` block creates tensors on, and what sglang did there outside Triton."""

    device: str  # "cuda" | "npu"
    jit: list = field(default_factory=list)  # the sglang JIT modules the calls reached (prewarm.jit.JitRequest)


@contextlib.contextmanager
def fake_device(device: str) -> Iterator[FakeDevice]:
    """Within the block, tensors made on ``device`` (``"cuda"`` or ``"npu"``, whose queries a device profile answers)
    are fake (:func:`prewarm.providers.capture.fake_tensors`); the chunk counting of sglang's fla copy and of
    sgl-kernel-npu (whichever is imported) reads ``capture.index_tensor`` values; each sglang JIT module a call loads
    is resolved by sglang's ``load_jit`` and listed, not built nor run."""
    import sglang.srt.layers.attention.linear.kernels.kda_triton  # noqa: F401  (every kernel module, imported)

    from .jit import capture_requests

    state = FakeDevice(device)
    with capture_requests() as state.jit, fake_tensors(CHUNK_INDEX_HOMES), _platform_of_this_block():
        yield state


@contextlib.contextmanager
def _platform_of_this_block() -> Iterator[None]:
    """sglang's ``current_platform`` (a lazy per-process singleton, which modules also bind by name at import)
    resolved anew within the block, as the device profile answers it, and rebound in every loaded sglang module that
    holds another: a process that touched it before, outside a profile (no CUDA here), keeps a platform without
    Triton, whose capabilities steer sglang's dispatch (``support_triton``: the req_to_token writes, the MLA KV
    store) away from what a GPU node runs. Put back after the block."""
    import sys

    try:
        import sglang.srt.platforms as platforms
        from sglang.srt.platforms.interface import SRTPlatform
    except ImportError:  # an sglang without the platform layer (the stand-in tree's answers as CUDA's)
        yield
        return
    saved = getattr(platforms, "_current_platform", None)
    platforms._current_platform = None
    here = platforms.current_platform
    bound = {name: module for name, module in list(sys.modules.items())
             if name.startswith("sglang.") and isinstance(getattr(module, "current_platform", None), SRTPlatform)
             and module.current_platform is not here}
    olds = {name: module.current_platform for name, module in bound.items()}
    for module in bound.values():
        module.current_platform = here
    try:
        yield
    finally:
        platforms._current_platform = saved
        for name, module in bound.items():
            module.current_platform = olds[name]


@contextlib.contextmanager
def jit_skipped() -> Iterator[list[str]]:
    """Within the block sglang's CUDA JIT packed decode (``kda_packed_decode.kda_packed_decode``, called by
    ``fused_recurrent_kda_packed_decode`` where ``covered()``) does nothing; each call is listed (its batch size)."""
    import sglang.kernels.ops.attention.kda_packed_decode as jit

    calls: list[str] = []
    original = jit.kda_packed_decode

    def skipped(mixed_qkv, *args, **kwargs) -> None:
        calls.append(f"kda_packed_decode(batch={mixed_qkv.shape[0]})")

    jit.kda_packed_decode = skipped
    try:
        yield calls
    finally:
        jit.kda_packed_decode = original
