"""Kimi K3's KDA layers on sglang's Ascend path, the ``kda`` component of :mod:`prewarm.providers.sglang.ascend`.

sglang (0.5.23) serves Kimi K3's KDA layers on NPU with ``AscendKDAAttnBackend``
(``sglang/srt/hardware_backend/npu/attention/ascend_kda_backend.py``), under ``AscendKDAHybridLinearAttnBackend`` for
the state updates after a speculative verify. The backend routes through sgl-kernel-npu, not through the CUDA path's
``TritonKDAKernel`` methods: its prefill gate and DSPARK verify are sgl-kernel-npu's ``fused_kda_gate_npu`` and
``kda_target_verify_npu``, the conv and the prefill core are CANN ops (``torch.ops.npu``), and after each verify
sgl-kernel-npu's ``move_intermediate_cache_kda`` and ``conv_state_rollback`` update the pools. :func:`calls` therefore
drives the backend's own forward methods (``forward_extend``, ``forward_decode``, ``_forward_target_verify`` through
``forward_extend``), the hybrid backend's ``update_mamba_state_after_mtp_verify`` and the model layer's ``o_norm``, on
fake npu tensors (``prewarm.providers.sglang.common``), with every ``kernel[grid](...)`` captured, so each Triton
launch is planned with the arguments the server passes. What cannot run off the node is stood in: the CANN ops
(:func:`cann_ops`: outputs of the right shape and dtype), and the server objects the backend reads (:class:`_Pool`:
the mamba pool as sglang's ``MambaPool`` lays it out on NPU; ``common.Batch``: the fields of a ``ForwardBatch`` the
forward paths read). The backend object is made without its constructor (which reads the server's published
configuration) and given the attributes the constructors of ``MambaAttnBackendBase``, ``KDAAttnBackend`` and
``AscendKDAAttnBackend`` set (:func:`_backend`).

The envelope (``[spec]``, :func:`prewarm.providers.sglang.common.read_spec`), and what it plans:

- ``spec.sglang.paths``: ``extend`` (prefill, with and without prefix state), ``decode``, ``target_verify``
  (DSPARK chain verify at each draft width, dense and ragged, then the state updates).
- ``spec.sglang.prefill``: ``cann`` (0.5.23: sglang's Triton ``l2norm_fwd`` of q and k, sgl-kernel-npu's gate,
  ``torch.ops.npu.chunk_kda_fwd``) and ``triton`` (the user report's era, the report author's
  ``_AscendKDAExtendKernel``: sgl-kernel-npu's l2norm, sglang's ``chunk_local_cumsum`` (log2 e scale) and
  ``chunk_kda_scaled_dot_kkt_fwd``, sgl-kernel-npu's ``solve_tril_npu``, ``recompute_w_u_fwd_npu``,
  ``chunk_gated_delta_rule_fwd_h_npu`` (state pool by index, exp2) and ``chunk_gla_fwd_o_gk_npu``, called in that
  order with that backend's arguments (:class:`ReportEraExtendKernel`); that backend handed beta over raw).
- ``spec.sglang.track_state``: the radix cache's state tracking (``extra_buffer``: tracked decode rows copied by
  sglang's ``track_mamba_states_all_layers`` at the last KDA layer; a tracked prefill adds no Triton launch).
- Prefill token counts 1..``max_prefill_tokens`` (:func:`prefill_lengths`: every class combination of the ints the
  wrappers derive from them), decode batches 1..max(graph sizes,
  ``max_running_requests``) and verify batches at each draft width (:func:`prewarm.providers.sglang.cuda.batch_sizes`
  stands for every size; the traffic test sweeps others).
- The pools' geometry where it reaches a constexpr: ``conv_state_rollback`` takes the conv pool's strides (layers,
  ``spec.sglang.mamba_pool_slots``, the window ``conv_kernel - 1 + draft - 1``, channels) as constexprs.

Kernels triton-ascend cannot key (sglang 0.5.23's decode kernel and the o_norm's kernel on 3.2.0) are still launched
here: the planner sets them apart as will-fail (``prewarm.planning.plan``), it does not drop them.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from ..capture import batch_sizes, index_tensor
from .common import Batch, MambaPoolView, SglangSpec, hybrid_backend

CHUNK = 64  # the KDA chunk (tokens) of both prefill layouts
LOG2_E = 1.4426950408889634  # the report-era cumsum's scale (exp2 gates)
L2NORM_BLOCK_ROWS = 2048  # sgl-kernel-npu's l2norm_fwd: NB = cdiv(rows, 2048), a specialized int


COMPONENT = "kda"


def import_modules() -> None:
    """Imports the backend and every kernel module either prefill layout reaches (before
    :func:`prewarm.providers.sglang.common.fake_device`, which patches the host-side chunk counting of the modules
    imported)."""
    _import_backend()


def calls(s: SglangSpec, model=None) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) for every call of the envelope: each dtype combination, draft width (a server has one: its
    pools are shaped by it), path; run inside :func:`cann_ops` (the provider enters it)."""
    for combo in s.dtype_combos():
        for draft in s.draft_widths or (0,):
            node = _Node(s, combo, draft)
            for path in s.paths:
                yield from getattr(node, path)()


def coverage(s: SglangSpec, model=None) -> dict:
    """What the KDA layers reach: every Triton kernel of ``AscendKDAAttnBackend``'s paths is launched (the two
    triton-ascend 3.2.0 cannot key are set apart as will-fail by the planner, not here); the CANN ops are not
    Triton."""
    return {"component": COMPONENT, "planned": [],
            "not_planned": [
                {"what": "torch.ops.npu.chunk_kda_fwd, torch.ops.npu.causal_conv1d",
                 "why": "CANN operators (0.5.23's prefill core and the short conv), not Triton: nothing to prewarm"},
                {"what": "sglang --enable-linear-replayssm(-spec)",
                 "why": "ReplaySSM is not planned (spec.sglang.replayssm = [false]); the launch line does not set it"}]}


def prefill_lengths(max_tokens: int, heads: int, vector_cores: int) -> list[list[int]]:
    """Packed prefills (sequence lengths) that stand for 1..``max_tokens`` tokens. The kernels specialize on the
    class of each int the wrappers derive from the token count T (1, a multiple of 16, other): T itself and its chunk
    count (sglang's kernels), and sgl-kernel-npu's ``l2norm_fwd`` over T x heads rows (``fla/l2norm.py``: the rows,
    ``cdiv(rows, 2048)`` blocks, ``cdiv(rows, vector cores)`` rows per core). One sequence of the fewest tokens
    reaching each combination of those classes, and packs of several sequences (a one-token tail, a ragged one)."""
    from prewarm.building.tritoncompat import int_class

    def cdiv(a: int, b: int) -> int:
        return -(a // -b)

    fewest: dict[tuple, int] = {}
    for tokens in range(1, max_tokens + 1):
        rows = tokens * heads
        derived = (tokens, cdiv(tokens, CHUNK), rows, cdiv(rows, L2NORM_BLOCK_ROWS), cdiv(rows, vector_cores))
        fewest.setdefault(tuple(map(int_class, derived)), tokens)
    packs = [[CHUNK, 1], [3, CHUNK + 5, 1]]
    return [[tokens] for tokens in sorted(fewest.values())] + [p for p in packs if sum(p) <= max_tokens]


@contextlib.contextmanager
def cann_ops() -> Iterator[None]:
    """``torch.ops.npu``'s ops that sglang's Ascend KDA backend calls, stood in for planning: CANN kernels, not
    Triton, which run only on a node; each returns tensors of the shape, dtype and device the backend reads."""
    import torch

    def chunk_kda_fwd(q, k, v, g, beta, *, initial_state, output_h=False, **kwargs):
        # [0] out like v, [1] the final state [N, H, V, K] (state_v_first), [10] per-chunk states [1, NT, H, V, K]
        n, h, vd, kd = initial_state.shape
        chunks = math.ceil(q.shape[1] / CHUNK) + n
        states = torch.empty(1, chunks, h, vd, kd, dtype=q.dtype, device=q.device)
        out = [torch.empty_like(v), torch.empty(n, h, vd, kd, dtype=torch.float32, device=q.device)]
        return out + [None] * 8 + [states if output_h else None]

    def causal_conv1d(x, weight, **kwargs):
        return torch.empty_like(x)

    namespace = torch.ops.npu
    stood_in = {"chunk_kda_fwd": chunk_kda_fwd, "causal_conv1d": causal_conv1d}
    before = {name: namespace.__dict__.get(name) for name in stood_in}
    for name, fn in stood_in.items():
        setattr(namespace, name, fn)
    try:
        yield
    finally:
        for name, fn in before.items():
            if fn is None:
                delattr(namespace, name)
            else:
                setattr(namespace, name, fn)


class ReportEraExtendKernel:
    """The user report's Ascend prefill (the report author's sglang fork, ``ascend_kda_backend.py``,
    ``_AscendKDAExtendKernel``): the kernels' real entry points, called in that backend's order with its arguments."""

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

        q, k = l2norm_fwd(q.contiguous()), l2norm_fwd(k.contiguous())
        v, beta = v.contiguous(), beta.contiguous()
        chunk_indices = prepare_chunk_indices(query_start_loc, CHUNK)
        g = chunk_local_cumsum(g.contiguous(), chunk_size=CHUNK, scale=LOG2_E, cu_seqlens=query_start_loc,
                               chunk_indices=chunk_indices)
        scale = k.shape[-1] ** -0.5
        triangular, query_key = chunk_kda_scaled_dot_kkt_fwd(q=q, k=k, gk=g, beta=beta, scale=scale,
                                                             cu_seqlens=query_start_loc, output_dtype=torch.float32)
        triangular = solve_tril_npu(A=triangular, cu_seqlens=query_start_loc, output_dtype=k.dtype)
        w, u, gated_k = recompute_w_u_fwd_npu(k=k, v=v, beta=beta, A=triangular, gk=g, cu_seqlens=query_start_loc,
                                              chunk_indices=chunk_indices)
        chunk_states, new_values = chunk_gated_delta_rule_fwd_h_npu(
            k=gated_k, w=w, u=u, gk=g, initial_state=ssm_states, initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc, chunk_indices=chunk_indices, use_exp2=True)
        out = chunk_gla_fwd_o_gk_npu(q=q, v=new_values, g=g, A=query_key, h=chunk_states, out=v, scale=scale,
                                     cu_seqlens=query_start_loc, chunk_size=CHUNK, chunk_indices=chunk_indices)
        if return_intermediate_states:
            return out, chunk_states.transpose(-1, -2).contiguous()
        return out


@dataclass
class _Pool(MambaPoolView):
    """sglang's hybrid request pool as the KDA backends read it, laid out as 0.5.23's ``MambaPool`` allocates it on
    NPU (``mem_cache/memory_pool.py``, ``hardware_backend/npu/memory_pool_npu.py``): conv ``[layers, slots, window,
    channels]`` (the window widened by draft - 1 under speculation), temporal ``[layers, slots, H, V, K]``, the
    verify scratch ``[layers, requests + 1, draft, H, V, K]``; one layer's cache is a view of each."""

    size: int  # requests (the scratch rows, the verify index table)
    conv: Any
    temporal: Any
    intermediate_ssm: Any
    mamba_map: dict = field(default_factory=dict)


def _import_backend():
    """Imports the backend and every kernel module either prefill layout reaches (before :func:`fake_device`, which
    patches the host-side chunk counting of the modules imported)."""
    try:
        import sgl_kernel_npu.fla.kda_chunk_delta_h  # noqa: F401
        import sgl_kernel_npu.fla.kda_prefill  # noqa: F401
        import sgl_kernel_npu.fla.l2norm  # noqa: F401
        import sgl_kernel_npu.fla.solve_tril  # noqa: F401
        import sgl_kernel_npu.fla.utils  # noqa: F401
        import sglang.kernels.ops.attention.fla.cumsum  # noqa: F401
        import sglang.kernels.ops.attention.fla.fused_norm_gate  # noqa: F401
        import sglang.kernels.ops.attention.fla.kda  # noqa: F401
        from sglang.srt.hardware_backend.npu.attention import ascend_kda_backend  # noqa: F401
    except ImportError as e:
        raise ValueError(f"sglang's Ascend KDA backend is not importable ({e}): install sglang and sgl-kernel-npu "
                         f"(the versions the nodes run)") from e


class _Node:
    """One attention rank of the deployment: its pools, its last KDA layer (the one whose forward also tracks every
    layer's state), the backend per prefill layout and the hybrid backend around it, for one dtype combination."""

    def __init__(self, s: SglangSpec, combo: dict, draft: int):
        import torch

        from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

        self.s, self.draft = s, draft
        self.tag = ",".join([f"{role}={name}" for role, name in combo.items()] + [f"draft={draft}"])
        self.dt = {role: getattr(torch, name) for role, name in combo.items()}
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        self.channels = 2 * h * K + h * V  # the conv's q | k | v
        window = s.conv_kernel - 1 + max(draft - 1, 0)
        slots = s.mamba_pool_slots or s.max_batch + 1
        layers = s.layers
        requests = s.max_batch
        self.pool = _Pool(
            size=requests, mamba_map={i: i for i in range(layers)},
            conv=self.zeros(layers, slots, window, self.channels, dtype=self.dt["activation"]),
            temporal=self.zeros(layers, slots, h, V, K, dtype=self.dt["state"]),
            intermediate_ssm=self.zeros(layers, requests + 1, draft, h, V, K, dtype=self.dt["state"])
            if draft else None)
        self.layer = RadixLinearAttention(
            layer_id=layers - 1, num_q_heads=h, num_k_heads=h, num_v_heads=h, head_q_dim=K, head_k_dim=K,
            head_v_dim=V, conv_weights=self.zeros(self.channels, s.conv_kernel, dtype=torch.float32), bias=None,
            A_log=self.zeros(1, 1, h, 1, dtype=self.dt["gate_params"]),
            dt_bias=self.zeros(h * K, dtype=self.dt["gate_params"]), lower_bound=s.lower_bound)
        self.o_norm = FusedRMSNormGated(V, eps=1e-5, activation="sigmoid", device="npu", dtype=self.dt["activation"])
        self.backends = {prefill: _backend(self.pool, prefill) for prefill in s.prefill or ("cann",)}

    def zeros(self, *shape, dtype):
        import torch

        return torch.zeros(*shape, dtype=dtype, device="npu")

    def index(self, values):
        return index_tensor(list(values), self.dt["index"], "npu")

    def inputs(self, tokens: int, per_head_gate: bool):
        """What Kimi K3's layer hands the backend: the conv input ``[T, channels]``, the raw forget gate (``[1, T, h,
        K]`` in extend and verify, ``[T, hK]`` in decode), raw beta ``[1, T, h]`` (a view at each row stride), and
        the o_norm gate ``[T, hV]``."""
        s = self.s
        h, K = s.heads, s.head_k_dim
        mixed = self.zeros(tokens, self.channels, dtype=self.dt["activation"])
        a = self.zeros(tokens, h * K, dtype=self.dt["gate"])
        if per_head_gate:
            a = a.unflatten(-1, (h, K)).unsqueeze(0)
        for row in s.beta_row_strides:
            b = self.zeros(tokens, row, dtype=self.dt["beta"]).narrow(1, 0, h).unsqueeze(0)
            yield row, mixed, a, b

    def output(self, core, tokens: int):
        """The layer's o_norm after the backend (kimi_k3.py: ``self.o_norm(core_attn_out, g.unflatten(-1, (-1,
        head_dim)))``), the gate ``[T, hV]`` as K3's projections hand it over: its own projection's output
        (``forward_qkvbfg``), or a column slice of the fused ``[q | k | v | g]`` projection (``forward_qkvbfg_fused``:
        a strided gate, which the kernel specializes on)."""
        hv, V = self.s.heads * self.s.head_v_dim, self.s.head_v_dim
        fused = self.zeros(tokens, self.channels + hv, dtype=self.dt["activation"])
        for g in (self.zeros(tokens, hv, dtype=self.dt["activation"]), fused.narrow(1, self.channels, hv)):
            self.o_norm(core, g.unflatten(-1, (-1, V)))

    def metadata(self, lengths: list[int], tracked: bool, **extra):
        import torch
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        n = len(lengths)
        fields = dict(query_start_loc=self.index(itertools.accumulate(lengths, initial=0)),
                      mamba_cache_indices=self.index(range(1, n + 1)), **extra)
        if tracked:  # sglang keeps the track destinations in int64 (its ping-pong map, the graph's static buffer)
            fields.update(mamba_track_indices=index_tensor(list(range(n)), torch.int64, "npu"),
                          has_mamba_track_mask=True)
        return ForwardMetadata(**fields)

    # --- the paths --------------------------------------------------------------------------------------------

    def extend(self):
        """Prefill at each layout and token count, with and without prefix state. A tracked prefill row adds no
        Triton launch (its snapshot is torch indexing), and 0.5.23's init_forward_metadata raises on such batches
        on Ascend (README), so tracking is planned in decode only. The prefill reaches neither the conv pool nor the
        verify scratch, so one draft width's pools stand for all."""
        from sgl_kernel_npu.utils.triton_utils import get_device_properties
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        if self.draft != (s.draft_widths or (0,))[0]:
            return
        lengths_planned = prefill_lengths(s.max_prefill_tokens, s.heads, get_device_properties()[1])
        for prefill, backend in self.backends.items():
            for lengths in lengths_planned:
                for prefix in (False, True):
                    def call(backend=backend, lengths=lengths, prefix=prefix):
                        T = sum(lengths)
                        for _, mixed, a, b in self.inputs(T, per_head_gate=True):
                            batch = Batch(ForwardMode.EXTEND, len(lengths), extend_seq_lens_cpu=list(lengths),
                                          extend_prefix_lens=self.index([int(prefix)] * len(lengths)))
                            backend.forward_metadata = self.metadata(lengths, tracked=False)
                            self.output(backend.forward_extend(self.layer, batch, mixed, a, b), T)

                    yield f"extend[{self.tag},prefill={prefill},lengths={_short(lengths)},prefix={prefix}]", call

    def decode(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        backend = next(iter(self.backends.values()))  # the prefill layout does not reach decode
        for batch_size in batch_sizes(s.max_batch):
            for tracked in (False, True) if s.track_state else (False,):
                def call(batch_size=batch_size, tracked=tracked):
                    for row, mixed, a, b in self.inputs(batch_size, per_head_gate=False):
                        batch = Batch(ForwardMode.DECODE, batch_size,
                                      mamba_track_mask=self._track_mask(batch_size) if tracked else None)
                        backend.forward_metadata = self.metadata([1] * batch_size, tracked)
                        core = backend.forward_decode(self.layer, batch, mixed, a, b)
                        self.output(core, batch_size)

                yield f"decode[{self.tag},B={batch_size},track={tracked}]", call

    def target_verify(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        backend = next(iter(self.backends.values()))
        hybrid = _hybrid(backend)
        for width in (self.draft,) if self.draft else ():
            for batch_size in batch_sizes(s.max_batch):
                for ragged in (False, True):
                    for tracked in (False, True) if s.track_state else (False,):
                        def call(width=width, batch_size=batch_size, ragged=ragged, tracked=tracked):
                            lengths = [1] * batch_size if ragged else [width] * batch_size
                            tokens = sum(lengths)
                            spec = SimpleNamespace(draft_token_num=width,
                                                   ragged_verify_layout=object() if ragged else None)
                            for row, mixed, a, b in self.inputs(tokens, per_head_gate=True):
                                batch = Batch(ForwardMode.TARGET_VERIFY, batch_size, spec_info=spec)
                                backend.forward_metadata = self.metadata(lengths, False, is_target_verify=True,
                                                                         draft_token_num=width)
                                core = backend.forward_extend(self.layer, batch, mixed, a, b)
                                self.output(core, tokens)
                            steps = self.index([width - 1] * batch_size)
                            hybrid.update_mamba_state_after_mtp_verify(
                                steps, self.index(range(batch_size)) if tracked else None,
                                steps if tracked else None, None)

                        yield f"target_verify[{self.tag},B={batch_size},ragged={ragged},track={tracked}]", call

    def _track_mask(self, batch_size: int):
        import torch

        return torch.ones(batch_size, dtype=torch.bool, device="npu")


def _backend(pool: _Pool, prefill: str):
    """``AscendKDAAttnBackend`` (or, for the report-era prefill, the same with that era's extend kernel and gate
    contract) with the attributes its constructors set; the constructors themselves read the server's configuration
    (``runtime_context``), which exists only in a running server."""
    import torch

    from sglang.srt.hardware_backend.npu.attention.ascend_kda_backend import (
        AscendKDAAttnBackend,
        _AscendKDAExtendKernel,
    )
    from sglang.srt.layers.attention.linear.kda_backend import KDAKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import (
        LinearAttnKernelBackend,
        build_verify_intermediate_state_indices,
    )

    cls = AscendKDAAttnBackend if prefill == "cann" else _report_era_backend(AscendKDAAttnBackend)
    backend = cls.__new__(cls)
    triton_backend = LinearAttnKernelBackend.TRITON  # --linear-attn-*-backend triton (the report's launch line)
    backend.__dict__.update(
        pad_slot_id=-1, device="npu", topk=0, is_draft_worker=False, req_to_token_pool=pool, token_to_kv_pool=None,
        enable_unified_memory=False, forward_metadata=None, _mamba_chunk_size=None, _fused_state_indices_ok=False,
        kernel_dispatcher=KDAKernelDispatcher(triton_backend, triton_backend, triton_backend),
        verify_intermediate_state_indices=build_verify_intermediate_state_indices(pool.size, "npu"),
        _fused_chain_verify_fn=None)
    conv = pool.conv
    backend.conv_states_shape = torch.Size((*conv.shape[:-2], conv.shape[-1], conv.shape[-2]))
    backend.kernel_dispatcher.extend_kernel = ReportEraExtendKernel() if prefill == "triton" else \
        _AscendKDAExtendKernel()
    return backend


def _report_era_backend(base):
    """The report era's backend differed from 0.5.23's in its prefill gate contract: beta handed over raw."""
    class ReportEraAscendKDAAttnBackend(base):
        def _prepare_extend_gate_inputs(self, layer, g, beta):
            from sgl_kernel_npu.fla.kda_gate import fused_kda_gate_npu

            gate = fused_kda_gate_npu(g.flatten(-2), layer.A_log, layer.head_k_dim, gate_bias=layer.dt_bias,
                                      lower_bound=layer.lower_bound)
            return gate, beta, None, None

    return ReportEraAscendKDAAttnBackend


def _hybrid(linear_backend):
    """``AscendKDAHybridLinearAttnBackend`` around ``linear_backend`` (its full-attention half is not KDA's)."""
    from sglang.srt.hardware_backend.npu.attention.ascend_kda_backend import AscendKDAHybridLinearAttnBackend

    return hybrid_backend(AscendKDAHybridLinearAttnBackend, linear_backend)


def _short(lengths: list[int]) -> str:
    return "+".join(map(str, lengths)) if len(lengths) <= 4 else f"{len(lengths)}x..{sum(lengths)}"
