"""What every KDA wrapper shares: chunk geometry, the varlen chunk position, and the canonical form of inputs.

The canonical form is the closure contract of the public API (``chunk_kda_fwd``, ``recurrent_kda``,
``l2norm_rstd``): whatever a caller passes, only the dtypes a manifest declares (activation for q/k/v, gate for
g) and fixed ones (fp32 beta/A_log/dt_bias/states, int32 indices) reach a kernel, always contiguous and 16-byte
aligned, so the set of compiled variants depends on the deployment and never on incidental caller choices.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..index import ChunkIndex, prepare_chunk_index

# Autotune results on disk (`<fn>.autotune.json` in TRITON_CACHE_DIR) so a prewarmed node never autotunes.
# triton 3.2 (triton-ascend) has no such option; on Ascend the kernels run with pinned configs anyway.
AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

# Prefill kernels' autotune keys carry the batch's token bucket: the best tiling depends on how many programs a
# grid has, which grows with the tokens (without it, a process's first prefill decided the configs of every later one,
# and a history of small batches left long prefills at 1.45-1.61x fla on the H200). The buckets are fixed, so the
# runtime, the plan (one call per bucket up to the manifest's max_prefill_tokens) and any traffic agree without the
# runtime knowing the manifest; the last one holds every larger batch. A bucket is a runtime int the kernels do not
# specialize on (``do_not_specialize``) and do not read: it changes the tuning key, never a compiled variant.
TOKEN_BUCKETS = (256, 1024, 4096, 16384, 65536)

BT = 64  # chunk size
BC = 16  # sub-chunk size of the intra-chunk kernels
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # G, the cumulative decay, is held in base 2 (cumsum.py)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
ALIGN = 16  # bytes: Triton specializes every pointer on data_ptr() % 16
GATE_NONE, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2


def token_bucket(tokens: int) -> int:
    """The autotune bucket of a prefill of ``tokens`` tokens: the least of TOKEN_BUCKETS holding it, else the last."""
    return next((b for b in TOKEN_BUCKETS if tokens <= b), TOKEN_BUCKETS[-1])


def token_buckets(max_tokens: int | None) -> list[int]:
    """Every bucket a prefill of at most ``max_tokens`` tokens falls in (None: no budget, every bucket)."""
    return list(TOKEN_BUCKETS) if max_tokens is None else [b for b in TOKEN_BUCKETS if b <= token_bucket(max_tokens)]


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for the host: that one is a constexpr function costing ~1 us per call, paid on every launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for the host (likewise ~1 us per call there)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def chunk_bounds(i_t, cu_seqlens, chunk_indices):
    """(chunk index within its sequence, first token, sequence length) in int64, for global chunk ``i_t``."""
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    return i_t, bos, T


@dataclass(frozen=True)
class Layout:
    """Shapes of one chunked call: B, T, H, K, V, the number of chunks (grid) and the chunk index.

    Every call runs as packed sequences: a fixed-length [B, T] batch is B sequences of T tokens, which in a
    contiguous tensor are laid out exactly as a packed [1, B*T] batch, so the kernels have one (varlen) form."""

    B: int
    T: int
    H: int
    K: int
    V: int
    NT: int  # chunks over all sequences
    index: ChunkIndex  # on the CPU
    on_device: ChunkIndex  # the same, on the tensors' device

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.on_device.cu_seqlens

    @property
    def chunk_indices(self) -> torch.Tensor:
        return self.on_device.indices

    @property
    def chunk_offsets(self) -> torch.Tensor:
        return self.on_device.offsets

    @property
    def longest_first(self) -> torch.Tensor:
        return self.on_device.longest_first

    @property
    def num_seqs(self) -> int:
        return len(self.index.longest_first)

    @property
    def bucket(self) -> int:
        """The autotune token bucket of this call (:func:`token_bucket` of its B * T tokens)."""
        return token_bucket(self.B * self.T)


def layout(k: torch.Tensor, v: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> Layout:
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K] (token-major), got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    V = v.shape[-1] if v is not None else K
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, dtype=torch.int32) * T
    elif B != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B == 1 with sequences packed along T, got B={B}")
    idx = prepare_chunk_index(cu_seqlens, BT, B * T)
    return Layout(B, T, H, K, V, idx.num_chunks, idx, idx.to(k.device))


def _check(name: str, t: torch.Tensor, shape: tuple, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (expected one of {[str(d) for d in dtypes]})")


def is_canonical(t: torch.Tensor) -> bool:
    """Contiguous and 16-byte aligned: the one stride layout and pointer class the kernels are compiled for."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def canonical(name: str, t: torch.Tensor, shape: tuple, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """``t`` checked (shape, dtype) and in canonical form: returned as is when it already is, else copied.

    A strided view (q/k/v split out of one fused projection, any last stride) or a tensor at an unaligned offset
    would otherwise be read wrongly (the kernels index token-major) or compile another variant (pointer
    alignment is part of Triton's key). The copy costs one read and one write of ``t``."""
    _check(name, t, shape, dtypes)
    return _copied_if_needed(t)


def _copied_if_needed(t: torch.Tensor) -> torch.Tensor:
    return t if is_canonical(t) else t.clone(memory_format=torch.contiguous_format)


def as_fp32(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A small per-token or per-head parameter (beta, A_log, dt_bias) as a canonical fp32 tensor, whatever float
    dtype the caller holds: its pointer dtype is then never a new compiled variant (a bf16 beta would be one of
    every kernel that reads it). At most a few bytes per token and head."""
    _check(name, t, shape, FLOAT_DTYPES)
    return _copied_if_needed(t if t.dtype == torch.float32 else t.float())


def as_read(name: str, t: torch.Tensor, shape: tuple, activation: torch.dtype) -> torch.Tensor:
    """A small per-token parameter (beta) read in-kernel as given when it is fp32 or the activation dtype (both exact
    in fp32), any other float dtype cast to fp32: two planned variants instead of a cast, which in a launch-bound
    decode step is a whole extra kernel launch (~2 us of GPU time in a CUDA graph, ~5 us of host time eager)."""
    _check(name, t, shape, FLOAT_DTYPES)
    return _copied_if_needed(t if t.dtype in (torch.float32, activation) else t.float())


def as_index(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Sequence -> state-slot indices as a canonical int32 tensor (int64 accepted and narrowed)."""
    _check(name, t, shape, INDEX_DTYPES)
    return _copied_if_needed(t if t.dtype == torch.int32 else t.to(torch.int32))


def as_pool(name: str, pool: torch.Tensor, H: int, K: int, V: int) -> torch.Tensor:
    """A state pool [P, H, K, V]: fp32, contiguous, aligned, or refused. Never copied: a pool is large and decode
    updates it in place (a per-layer slice of a [layers, P, H, K, V] pool is contiguous and aligned)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V) \
            or pool.dtype != torch.float32:
        got = f"{pool.dtype} {tuple(pool.shape)}" if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"{name} must be an fp32 pool [P, H={H}, K={K}, V={V}], got {got}")
    if not is_canonical(pool):
        raise ValueError(f"{name} must be contiguous with a 16-byte aligned data pointer (it is read and written "
                         f"in place, never copied); got strides {pool.stride()}, data_ptr % 16 = "
                         f"{pool.data_ptr() % ALIGN}")
    return pool


@dataclass(frozen=True)
class Gate:
    """The gate as the kernels take it: kind (a constexpr), fp32 A_log / dt_bias or None, lower bound (a float)."""

    kind: int
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float


def gate(A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None, H: int,
         K: int) -> Gate:
    """g is the log-decay (no A_log / dt_bias) or the raw gate activated in-kernel with A_log [H], dt_bias [H*K]."""
    if A_log is None and dt_bias is None:
        if lower_bound is not None:
            raise ValueError("lower_bound applies only to the fused gate (pass A_log and dt_bias)")
        return Gate(GATE_NONE, None, None, 0.0)
    if A_log is None or dt_bias is None:
        raise ValueError("the fused gate needs both A_log [H] and dt_bias [H*K]")
    if lower_bound is not None and not (-5.0 <= float(lower_bound) < 0.0):
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    kind = GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND
    return Gate(kind, as_fp32("A_log", A_log, (H,)), as_fp32("dt_bias", dt_bias, (H * K,)), float(lower_bound or 0.0))


def activations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape_qk: tuple, shape_v: tuple):
    """q, k, v canonical and of one dtype (the manifest's activation dtype)."""
    q, k, v = canonical("q", q, shape_qk), canonical("k", k, shape_qk), canonical("v", v, shape_v)
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return q, k, v


def check_rstd(q_rstd: torch.Tensor | None, k_rstd: torch.Tensor | None, L: Layout):
    """Both L2-norm factors (canonical fp32 [B, T, H]) or neither."""
    if (q_rstd is None) != (k_rstd is None):
        raise ValueError("pass both q_rstd and k_rstd (from l2norm_rstd) or neither")
    if q_rstd is None:
        return None, None
    shape = (L.B, L.T, L.H)
    return canonical("q_rstd", q_rstd, shape, (torch.float32,)), canonical("k_rstd", k_rstd, shape, (torch.float32,))
