"""Seeded, server-like traffic of sglang 0.5.23's Ascend KDA backend within a manifest's envelope: the independent
calls that ``tests/ascend/test_sglang_ascend.py`` checks the plan of :mod:`prewarm.providers.sglang.ascend` against.

Written from sglang's own sources, never from the provider's call builder: the backend is made by its real
constructors (``MambaAttnBackendBase``, ``KDAAttnBackend``, ``AscendKDAAttnBackend``, and the hybrid backend around
it) from a model runner and the configuration a server publishes (:func:`_published`); the state pools as
``MambaPool`` allocates them on NPU for one server (``memory_pool.py``, ``memory_pool_npu.py``: conv ``[layers,
slots, conv_kernel - 1 + draft - 1, channels]``, the window widened by that server's own draft width, temporal
``[layers, slots, H, V, K]``, the verify scratch ``[layers, max_running_requests + 1, draft, H, V, K]``); the
metadata as ``hybrid_linear_attn_backend.py`` fills it (int32 ``query_start_loc`` and slot tables, padded graph rows
at slot -1, int64 track destinations from the ping-pong table or the graph's static buffer, a bool track mask, the
prefix-cache track rows of ``_init_track_ssm_indices``); the layer's inputs as ``kimi_k3.py`` hands them over
(``mixed_qkv`` a view of the fused ``[q, k, v, g]`` projection, the forget gate from ``f_b_proj`` ``[T, hK]``,
unflattened to ``[1, T, h, K]`` outside decode, raw beta from ``b_proj`` ``[1, T, h]``, the o_norm gate the ``g``
quarter of the fused projection). The report-era prefill (the report author's fork,
``_AscendKDAExtendKernel.extend`` and its raw-beta gate contract) is transcribed from that file (:class:`_ForkExtend`).

Every call draws on its own: the path, each role's dtype, the server's draft width (which sizes its pools), the
prefill layout, a pack of 1..N sequences of random lengths up to the token budget, prefix state per sequence, the
tracked rows and where each is tracked, the decode or verify batch (per path a seeded permutation of 1..the largest
batch, so enough calls see every size), whether the batch replays a graph bucket (padded to the next graph size, the
pad rows at slot -1), dense or ragged verify (1..width tokens per request), the accepted steps. ``Call.options``
holds what a call drew. Tracked rows: 0.5.23's ``KDAAttnBackend.init_forward_metadata`` raises on a batch with one
(``_AscendKDAExtendKernel`` has no ``uses_state_checkpoints``), so the metadata is filled here as sglang's
``_forward_metadata`` computes it; a tracked decode batch is drawn only on a graph bucket, whose metadata sglang
fills without that method (``_replay_metadata``); a tracked prefill runs the backend's own track path.

Run the calls inside ``common.fake_device("npu")`` and ``ascend.cann_ops()`` (the CANN ops stood in), after
:func:`import_kernels`.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

from prewarm.providers.capture import index_tensor
from prewarm.providers.sglang.common import published_parallel, read_spec

from . import Call, cycle, short

MAMBA_CHUNK = 64  # hf_text_config.mamba_chunk_size's default: the chunk the prefix cache tracks states at
RMS_NORM_EPS = 1e-5


def import_kernels() -> None:
    """Imports the backend and every kernel module both prefill layouts reach, before ``fake_device`` (which patches
    the host-side chunk counting of the modules already imported)."""
    import sgl_kernel_npu.fla.kda_chunk_delta_h  # noqa: F401
    import sgl_kernel_npu.fla.kda_prefill  # noqa: F401
    import sgl_kernel_npu.fla.l2norm  # noqa: F401
    import sgl_kernel_npu.fla.solve_tril  # noqa: F401
    import sgl_kernel_npu.fla.utils  # noqa: F401
    import sglang.kernels.ops.attention.fla.cumsum  # noqa: F401
    import sglang.kernels.ops.attention.fla.fused_norm_gate  # noqa: F401
    import sglang.kernels.ops.attention.fla.kda  # noqa: F401
    import sglang.srt.hardware_backend.npu.attention.ascend_kda_backend  # noqa: F401


def calls(spec: dict, seed: int, count: int) -> Iterator[Call]:
    """``count`` seeded server-like calls of sglang's Ascend KDA backend within ``spec``'s envelope (drawn when a
    call is made, its tensors made when it runs)."""
    from prewarm_kernels.spec import read_kda

    graphs = read_kda({k: v for k, v in spec.items() if k != "sglang"})["decode_batch_buckets"]
    traffic = _Traffic(read_spec(spec), sorted(graphs), random.Random(seed))
    for i in range(count):
        yield traffic.draw(i)


class _Traffic:
    def __init__(self, s, graphs: list[int], rng: random.Random):
        self.s, self.graphs, self.rng = s, graphs, rng
        # decode and verify batches: per path, every size once before any twice
        self.batches = {kind: cycle(rng, range(1, s.max_batch + 1)) for kind in ("decode", "target_verify")}
        self.kinds = [p for p in s.paths if p != "target_verify" or s.draft_widths]

    def draw(self, i: int) -> Call:
        s, rng = self.s, self.rng
        kind = rng.choice(self.kinds)
        d = {"kind": kind, **{role: rng.choice(names) for role, names in s.dtypes.items()},
             "draft": rng.choice(s.draft_widths) if s.draft_widths else None}
        if kind == "extend":
            d["prefill"] = rng.choice(s.prefill)
            seqs = rng.randint(1, min(s.max_batch, s.max_prefill_tokens))
            # token counts spread over every order of magnitude up to the budget, not only near it
            total = max(seqs, min(s.max_prefill_tokens, int(2 ** rng.uniform(0, math.log2(s.max_prefill_tokens + 1)))))
            cuts = sorted(rng.sample(range(1, total), seqs - 1))
            d["lengths"] = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            d["prefix"] = [rng.randint(1, 4096) if rng.random() < 0.5 else 0 for _ in range(seqs)]
            d["slots"] = rng.sample(range(1, _pool_slots(s)), seqs)
            # the radix cache's track rows: a request whose length crosses a track boundary in this chunk, tracked at
            # that many of its new tokens (a whole number of state chunks, or not)
            d["tracked"] = [s.track_state and rng.random() < 0.3 for _ in range(seqs)]
            d["track_at"] = [rng.choice([n - n % MAMBA_CHUNK or n, rng.randint(1, n)]) for n in d["lengths"]]
        else:
            batch = next(self.batches[kind])
            graphs = [g for g in self.graphs if g >= batch]
            d["graph"] = graphs[0] if graphs and rng.random() < 0.6 else None  # replayed on the next graph bucket
            rows = d["graph"] or batch
            d["batch"], d["rows"] = batch, rows
            d["slots"] = rng.sample(range(1, _pool_slots(s)), batch) + [-1] * (rows - batch)
            tracking = s.track_state and (kind == "target_verify" or d["graph"] is not None)
            d["tracked"] = [tracking and rng.random() < 0.3 for _ in range(batch)] + [False] * (rows - batch)
            if kind == "decode":
                d["layer"] = rng.choice(["last", "other"])  # the all-layers track copy fires at the last KDA layer
            else:
                width = d["draft"]
                ragged = rng.random() < 0.5
                d["lens"] = [rng.randint(1, width) if ragged else width for _ in range(rows)]
                d["ragged"] = ragged
                d["accepted"] = [rng.randint(0, n - 1) for n in d["lens"]]  # last correct step per request
        label = f"{kind}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k != "kind") + "]"
        return Call(label, lambda: getattr(self, kind)(_Server(s, d)), d)

    # --- the paths --------------------------------------------------------------------------------------------

    def extend(self, server: "_Server"):
        """A prefill batch: ``forward_extend`` (conv, gate, the prefill layout's core), then the layer's o_norm."""
        d = server.d
        lengths = d["lengths"]
        T = sum(lengths)
        batch = server.forward_batch("EXTEND", len(lengths), extend_seq_lens_cpu=list(lengths),
                                     extend_prefix_lens=server.index(d["prefix"]))
        backend = server.backend(d["prefill"])
        backend.forward_metadata = server.extend_metadata(batch)
        mixed_qkv, a, b, gate = server.layer_inputs(T, decode=False)
        return server.o_norm(backend.forward_extend(server.layer, batch, mixed_qkv, a, b), gate)

    def decode(self, server: "_Server"):
        """A decode batch (eager, or replayed on a graph bucket), then the o_norm."""
        d = server.d
        rows = d["rows"]
        tracked = any(d["tracked"])
        batch = server.forward_batch("DECODE", rows, mamba_track_mask=server.track_mask() if tracked else None,
                                     mamba_track_indices=server.track_destinations() if tracked else None)
        backend = server.backend("cann")
        backend.forward_metadata = server.decode_metadata(batch, query_tokens=[1] * rows)
        layer = server.layer if d["layer"] == "last" else server.other_layer
        mixed_qkv, a, b, gate = server.layer_inputs(rows, decode=True)
        return server.o_norm(backend.forward_decode(layer, batch, mixed_qkv, a, b), gate)

    def target_verify(self, server: "_Server"):
        """DSPARK verify through ``forward_extend`` (dense or ragged), the o_norm, then the hybrid backend's state
        updates after the verify (accepted steps, the tracked requests' snapshots)."""
        from sglang.srt.hardware_backend.npu.attention.ascend_kda_backend import AscendKDAHybridLinearAttnBackend

        d = server.d
        rows, lens, width = d["rows"], d["lens"], d["draft"]
        starts = server.index(list(itertools.accumulate(lens, initial=0)))
        layout = SimpleNamespace(qo_indptr_device=starts) if d["ragged"] else None
        spec_info = SimpleNamespace(draft_token_num=width, ragged_verify_layout=layout)
        tracked = any(d["tracked"])
        batch = server.forward_batch("TARGET_VERIFY", rows, spec_info=spec_info,
                                     mamba_track_indices=server.track_destinations() if tracked else None)
        backend = server.backend("cann")
        backend.forward_metadata = server.decode_metadata(batch, query_tokens=lens)
        T = sum(lens)
        mixed_qkv, a, b, gate = server.layer_inputs(T, decode=False)
        server.o_norm(backend.forward_extend(server.layer, batch, mixed_qkv, a, b), gate)
        hybrid = AscendKDAHybridLinearAttnBackend(server.full_attention(), backend, [])
        steps = server.index(d["accepted"], "int64")  # accept lengths - 1 (the scheduler's int64 tensor)
        track_steps = [a if t else -1 for a, t in zip(d["accepted"], d["tracked"])]
        hybrid.update_mamba_state_after_mtp_verify(
            steps, batch.mamba_track_indices, server.index(track_steps, "int64") if tracked else None, None)


class _Server:
    """One attention rank of one server for one call: its pools (sized by its draft width), its KDA layer and
    o_norm, and the backend its constructors make."""

    def __init__(self, s, d: dict):
        import torch

        self.s, self.d, self.torch = s, d, torch
        self.dt = {role: getattr(torch, d[role]) for role in s.dtypes}
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        self.channels = 2 * h * K + h * V
        self.pool = _HybridPool(s, d["draft"], conv_dtype=self.dt["activation"], ssm_dtype=self.dt["state"])
        # KDA layers by id (K3 interleaves its full-attention layers; the pool holds the KDA ones in order)
        ids = self.pool.mamba_layer_ids
        self.layer = self._layer(ids[-1])
        self.other_layer = self._layer(ids[len(ids) // 2])

    def zeros(self, *shape, dtype):
        return self.torch.zeros(*shape, dtype=dtype, device="npu")

    def index(self, values, dtype: str | None = None):
        """An index tensor of ``values``: the manifest's index dtype (sglang's slot tables, ``query_start_loc``),
        or ``dtype`` where sglang fixes another."""
        return index_tensor(list(values), getattr(self.torch, dtype) if dtype else self.dt["index"], "npu")

    def _layer(self, layer_id: int):
        """kimi_k3.py's RadixLinearAttention: per-rank heads, the fp32 short-conv weight ``[channels, kernel]`` of
        ``qkv_conv1d`` (squeezed), no conv bias, A_log ``[1, 1, h, 1]``, dt_bias ``[hK]``, the model's lower bound."""
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

        s = self.s
        h, K = s.heads, s.head_k_dim
        conv = self.zeros(self.channels, 1, s.conv_kernel, dtype=self.torch.float32).squeeze(1)
        layer = RadixLinearAttention(layer_id=layer_id, num_q_heads=h, num_k_heads=h, num_v_heads=h, head_q_dim=K,
                                     head_k_dim=K, head_v_dim=s.head_v_dim, conv_weights=conv, bias=None,
                                     A_log=self.zeros(1, 1, h, 1, dtype=self.dt["gate_params"]),
                                     dt_bias=self.zeros(h * K, dtype=self.dt["gate_params"]))
        layer.lower_bound = s.lower_bound
        return layer

    def layer_inputs(self, tokens: int, decode: bool):
        """(mixed_qkv, a, b, the o_norm gate) as KimiK3's linear-attention forward hands them over."""
        s = self.s
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        fused = self.zeros(tokens, 3 * h * K + h * V, dtype=self.dt["activation"])  # fused_qkvg_proj
        mixed_qkv, gate = fused.split([2 * h * K + h * V, h * V], dim=-1)
        a = self.zeros(tokens, h * K, dtype=self.dt["gate"])  # f_b_proj(f_a_proj(x))
        if not decode:
            a = a.unflatten(-1, (-1, K)).unsqueeze(0)
        b = self.zeros(tokens, h, dtype=self.dt["beta"]).unsqueeze(0)  # b_proj(x), unsqueezed
        return mixed_qkv, a, b, gate

    def o_norm(self, core, gate):
        """``self.o_norm(core_attn_out, g_proj_states.unflatten(-1, (-1, head_dim)))``."""
        from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated

        norm = FusedRMSNormGated(self.s.head_v_dim, eps=RMS_NORM_EPS, activation="sigmoid", device="npu",
                                 dtype=self.dt["activation"])
        return norm(core, gate.unflatten(-1, (-1, self.s.head_v_dim)))

    def forward_batch(self, mode: str, batch_size: int, **fields):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        return ForwardBatch(forward_mode=getattr(ForwardMode, mode), batch_size=batch_size, **fields)

    def track_mask(self):
        """The scheduler's bool mask (``seq_lens % track interval == 0``), copied to the device."""
        return index_tensor(self.d["tracked"], self.torch.bool, "npu")

    def track_destinations(self):
        """Each request's ping-pong track slot (int64: ``req_index_to_mamba_ping_pong_track_buffer_mapping``, or the
        graph's static ``mamba_track_indices_buf``)."""
        rows = len(self.d["slots"])
        return self.index(self.free_slots(rows), "int64")

    def free_slots(self, rows: int) -> list[int]:
        """``rows`` pool slots no request of this batch holds (the track destinations)."""
        used = {x for x in self.d["slots"] if x >= 0}
        free = [x for x in range(1, _pool_slots(self.s)) if x not in used]
        return free[:rows]

    # --- metadata as MambaAttnBackendBase fills it --------------------------------------------------------------

    def decode_metadata(self, batch, query_tokens: list[int]):
        """Decode and verify: int32 ``query_start_loc`` (arange, or the ragged layout's qo_indptr), the pool's int32
        slot table (padded graph rows at -1), the track destinations."""
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        spec_info = batch.spec_info
        if spec_info is not None and spec_info.ragged_verify_layout is not None:
            start = spec_info.ragged_verify_layout.qo_indptr_device
        else:
            start = self.index(list(itertools.accumulate(query_tokens, initial=0)))
        return ForwardMetadata(query_start_loc=start, mamba_cache_indices=self.index(self.d["slots"]),
                               mamba_track_indices=batch.mamba_track_indices,
                               has_mamba_track_mask=batch.mamba_track_mask is not None)

    def extend_metadata(self, batch):
        """Prefill: ``query_start_loc`` from the extend start locations, the slot table and, for tracked requests,
        the rows ``_init_track_conv_indices`` / ``_init_track_ssm_indices`` (KDA's branch) compute."""
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        d = self.d
        lengths, slots, tracked = d["lengths"], d["slots"], d["tracked"]
        starts = list(itertools.accumulate(lengths, initial=0))
        fields = dict(query_start_loc=self.index(starts), mamba_cache_indices=self.index(slots),
                      logical_num_tokens=starts[-1])
        rows = [i for i, t in enumerate(tracked) if t]
        if rows:
            at = d["track_at"]  # mamba_track_seqlens - extend_prefix_lens
            destinations = self.free_slots(len(rows))
            window = self.pool.mamba_pool.mamba_cache.conv[0].shape[-2]  # conv_states_shape[-1]: the whole window
            conv_rows = [[min(max(starts[i] + at[i] - window + w, 0), starts[-1] - 1) for w in range(window)]
                         for i in rows]
            aligned = [i for i in rows if at[i] % MAMBA_CHUNK == 0]
            unaligned = [i for i in rows if i not in aligned]
            chunks = [(n - 1) // MAMBA_CHUNK + 1 for n in lengths]
            offsets = list(itertools.accumulate(chunks, initial=0))
            dst = dict(zip(rows, destinations))
            long = "int64"
            fields.update(
                has_mamba_track_mask=True, mamba_track_mask_indices=self.index(rows, long),
                mamba_track_indices=self.index(destinations, long),
                track_conv_indices=self.index([r for row in conv_rows for r in row], long).view(len(rows), -1),
                conv_states_mask_indices=self.index(destinations, long),
                track_ssm_h_src=self.index([offsets[i] + at[i] // MAMBA_CHUNK for i in unaligned], long),
                track_ssm_h_dst=self.index([dst[i] for i in unaligned], long),
                track_ssm_final_src=self.index([slots[i] for i in aligned]),
                track_ssm_final_dst=self.index([dst[i] for i in aligned], long),
                track_chunk_idx=self.index([at[i] // MAMBA_CHUNK if i in unaligned else -1
                                            for i in range(len(lengths))], "int32"))
        return ForwardMetadata(**fields)

    # --- the backend as its constructors make it -----------------------------------------------------------------

    def backend(self, prefill: str):
        """``AscendKDAAttnBackend(model_runner)`` under the server's published configuration; for the report-era
        prefill, the same backend with that era's extend kernel and gate contract."""
        from sglang.srt.hardware_backend.npu.attention.ascend_kda_backend import AscendKDAAttnBackend
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

        triton = LinearAttnKernelBackend.TRITON  # --linear-attn-{decode,prefill,verify}-backend triton
        runner = SimpleNamespace(server_args=SimpleNamespace(enable_mis=False), device="npu", is_draft_worker=False,
                                 req_to_token_pool=self.pool, token_to_kv_pool=None,
                                 linear_attn_backends=SimpleNamespace(decode=triton, prefill=triton, verify=triton))
        cls = AscendKDAAttnBackend if prefill == "cann" else _fork_backend(AscendKDAAttnBackend)
        with _published(self.d["draft"]), published_parallel(self.s):  # as the server publishes its parallel config
            backend = cls(runner)
        if prefill == "triton":
            backend.kernel_dispatcher.extend_kernel = _ForkExtend()
        return backend

    def full_attention(self):
        """The hybrid backend's full-attention half, as far as its constructor reads it (not KDA's)."""
        return SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=self.pool, kv_index_translator=None,
                               needs_cpu_seq_lens=False, use_captured_forward_metadata_for_breakable_cuda_graph=False)


class _HybridPool:
    """``HybridReqToTokenPool`` with its ``MambaPool`` as a server with one draft width allocates them on NPU."""

    def __init__(self, s, draft: int | None, conv_dtype, ssm_dtype):
        import torch

        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        layers, slots = s.layers, _pool_slots(s)
        self.size = s.max_batch  # max_num_reqs
        self.mamba_layer_ids = list(range(layers))
        self.mamba_map = {layer_id: i for i, layer_id in enumerate(self.mamba_layer_ids)}
        window = s.conv_kernel - 1 + ((draft - 1) if draft else 0)  # _init_npu_conv_state
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device="npu")  # noqa: E731
        conv = zeros(layers, slots, window, 2 * h * K + h * V, dtype=conv_dtype)
        temporal = zeros(layers, slots, h, V, K, dtype=ssm_dtype)
        scratch = zeros(layers, s.max_batch + 1, draft, h, V, K, dtype=ssm_dtype) if draft else None
        self.mamba_pool = SimpleNamespace(mamba_cache=_State(conv=[conv], temporal=temporal, intermediate_ssm=scratch),
                                          replayssm_write_pos=None, enable_linear_replayssm=False)

    def mamba2_layer_cache(self, layer_id: int):
        return self.mamba_pool.mamba_cache.at_layer_idx(self.mamba_map[layer_id])

    def get_speculative_mamba2_params_all_layers(self):
        return self.mamba_pool.mamba_cache

    def translate_mamba_indices(self, mamba_indices):
        return mamba_indices


@dataclass(frozen=True)
class _State:
    """``MambaPool.SpeculativeState``: per-layer views by ``at_layer_idx``."""

    conv: list
    temporal: object
    intermediate_ssm: object = None
    intermediate_conv_window: list | None = None
    replayssm_d: object = None
    replayssm_k: object = None
    replayssm_g: object = None

    def at_layer_idx(self, layer: int) -> "_State":
        pick = lambda t: None if t is None else t[layer]  # noqa: E731
        return _State(conv=[c[layer] for c in self.conv], temporal=pick(self.temporal),
                      intermediate_ssm=pick(self.intermediate_ssm))


def _pool_slots(s) -> int:
    """The mamba pool's slots (its size + the padding slot 0): the manifest's, else one per running request."""
    return s.mamba_pool_slots or s.max_batch + 1


@contextlib.contextmanager
def _published(draft: int | None):
    """The configuration a server publishes (``sglang.srt.runtime_context``) as the backends' constructors read it:
    DSPARK chain verify at ``draft`` (topk 1), the radix cache on, no unified memory."""
    import importlib

    spec = SimpleNamespace(speculative_eagle_topk=None, speculative_algorithm="DSPARK" if draft else None,
                           speculative_num_draft_tokens=draft)
    memory = SimpleNamespace(enable_unified_memory=False, disable_radix_cache=False)
    answers = {"get_spec": lambda: spec, "get_memory": lambda: memory}
    modules = [importlib.import_module(name) for name in (
        "sglang.srt.layers.attention.hybrid_linear_attn_backend", "sglang.srt.layers.attention.linear.kda_backend")]
    before = [(m, name, getattr(m, name)) for m in modules for name in answers if hasattr(m, name)]
    for m, name, _ in before:
        setattr(m, name, answers[name])
    try:
        yield
    finally:
        for m, name, fn in before:
            setattr(m, name, fn)


def _fork_backend(base):
    """The report-era backend's prefill gate contract (the fork's ``_prepare_extend_gate_inputs``): the gate
    activated by sgl-kernel-npu's ``fused_kda_gate_npu``, beta handed over raw."""
    class ForkAscendKDAAttnBackend(base):
        def _prepare_extend_gate_inputs(self, layer, g, beta):
            from sgl_kernel_npu.fla.kda_gate import fused_kda_gate_npu

            preactivated_g = fused_kda_gate_npu(g.flatten(-2), layer.A_log, layer.head_k_dim,
                                                gate_bias=layer.dt_bias, lower_bound=layer.lower_bound)
            return preactivated_g, beta, None, None

    return ForkAscendKDAAttnBackend


class _ForkExtend:
    """The report author's ``_AscendKDAExtendKernel.extend`` (McZyWu/sgl-sglang, ``ascend_kda_backend.py``), line
    for line, the kernels called through their real entry points."""

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc,
               return_intermediate_states=False, **kwargs):
        import torch
        from sgl_kernel_npu.fla.kda_chunk_delta_h import chunk_gated_delta_rule_fwd_h_npu
        from sgl_kernel_npu.fla.kda_prefill import chunk_gla_fwd_o_gk_npu, recompute_w_u_fwd_npu
        from sgl_kernel_npu.fla.l2norm import l2norm_fwd
        from sgl_kernel_npu.fla.solve_tril import solve_tril_npu
        from sgl_kernel_npu.fla.utils import prepare_chunk_indices

        from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum
        from sglang.kernels.ops.attention.fla.kda import chunk_kda_scaled_dot_kkt_fwd

        chunk_size = 64
        q = l2norm_fwd(q.contiguous())
        k = l2norm_fwd(k.contiguous())
        v = v.contiguous()
        beta = beta.contiguous()
        chunk_indices = prepare_chunk_indices(query_start_loc, chunk_size)
        g = chunk_local_cumsum(g.contiguous(), chunk_size=chunk_size, scale=1.4426950408889634,
                               cu_seqlens=query_start_loc, chunk_indices=chunk_indices)
        triangular, query_key = chunk_kda_scaled_dot_kkt_fwd(q=q, k=k, gk=g, beta=beta, scale=k.shape[-1] ** -0.5,
                                                             cu_seqlens=query_start_loc, output_dtype=torch.float32)
        triangular = solve_tril_npu(A=triangular, cu_seqlens=query_start_loc, output_dtype=k.dtype)
        w, u, gated_k = recompute_w_u_fwd_npu(k=k, v=v, beta=beta, A=triangular, gk=g, cu_seqlens=query_start_loc,
                                              chunk_indices=chunk_indices)
        chunk_states, new_values = chunk_gated_delta_rule_fwd_h_npu(
            k=gated_k, w=w, u=u, gk=g, initial_state=ssm_states, initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc, chunk_indices=chunk_indices, use_exp2=True)
        out = chunk_gla_fwd_o_gk_npu(q=q, v=new_values, g=g, A=query_key, h=chunk_states, out=v,
                                     scale=k.shape[-1] ** -0.5, cu_seqlens=query_start_loc, chunk_size=chunk_size,
                                     chunk_indices=chunk_indices)
        if return_intermediate_states:
            return out, chunk_states.transpose(-1, -2).contiguous()
        return out
