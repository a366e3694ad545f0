"""The chunked KDA forward (chunk 64, token-major): cumsum -> intra (with the solve) -> recompute -> state -> output."""
from __future__ import annotations

import torch

from .common import activations, as_fp32, layout
from .cumsum import chunk_cumsum
from .intra import chunk_intra
from .l2norm import l2norm_rstd
from .output import chunk_output
from .recompute import chunk_recompute
from .state import chunk_state, initial_states


def chunk_kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  initial_state_indices: torch.Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                  A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward over fixed-length [B, T, ...] or packed varlen (B == 1, ``cu_seqlens`` [N+1]) batches.

    q, k: [B, T, H, K]; v: [B, T, H, V] (one float dtype: the activation dtype); g: [B, T, H, K] log-decay, or the
    raw gate when ``A_log`` [H] and ``dt_bias`` [H*K] are given (activated in the cumsum kernel; ``lower_bound``
    selects the bounded sigmoid gate); beta: [B, T, H], any float dtype (used in fp32, as A_log and dt_bias).
    ``initial_state`` is an fp32 pool [P, H, K, V] indexed per sequence by ``initial_state_indices`` [N] (int32 or
    int64; an index < 0 starts that sequence from zeros; without indices the pool holds exactly N states). Views and unaligned tensors are accepted (copied once, see
    ``common.canonical``). Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None).
    Pass ``cu_seqlens`` on the CPU: the chunk index is built there, and a device tensor would cost a sync.
    """
    L = layout(k, v, cu_seqlens)
    q, k, v = activations(q, k, v, (L.B, L.T, L.H, L.K), (L.B, L.T, L.H, L.V))
    beta = as_fp32("beta", beta, (L.B, L.T, L.H))
    initial_state, initial_state_indices = initial_states(initial_state, initial_state_indices, L)
    scale = L.K ** -0.5 if scale is None else float(scale)
    q_rstd, k_rstd = (l2norm_rstd(q), l2norm_rstd(k)) if use_qk_l2norm else (None, None)
    G = chunk_cumsum(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, _layout=L)
    Ai, Aqk = chunk_intra(q, k, G, beta, scale, q_rstd=q_rstd, k_rstd=k_rstd, _layout=L)
    w, u, kg = chunk_recompute(k, v, beta, G, Ai, k_rstd=k_rstd, _layout=L)
    h, v_new, final = chunk_state(kg, w, u, G, initial_state, initial_state_indices, output_final_state,
                                  _layout=L)
    return chunk_output(q, G, h, Aqk, v_new, scale, q_rstd=q_rstd, _layout=L), final
