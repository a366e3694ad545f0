"""Plain-PyTorch KDA, the test oracle: the token-by-token recurrence and the chunked stages, all in fp32."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gate_ref(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None):
    """Activated log-decay from the raw gate [..., H, K]."""
    H, K = raw.shape[-2:]
    x = raw.float() + dt_bias.float().view(H, K)
    a = torch.exp(A_log.float()).view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * x)


def _seqs(T: int, B: int, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def recurrent_ref(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                  cu_seqlens=None, use_qk_l2norm=False):
    """Token-by-token KDA: (o [B,T,H,V] fp32, final states [N,H,K,V] fp32). g is the log-decay (already activated)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    dev = q.device
    o = torch.zeros(B, T, H, V, device=dev)
    finals = []
    for n, (b, s, e) in enumerate(_seqs(T, B, cu_seqlens)):
        if initial_state is None:
            S = torch.zeros(H, K, V, device=dev)
        else:
            i = n if initial_state_indices is None else int(initial_state_indices[n])
            S = initial_state[i].float().clone()
        for t in range(s, e):
            S = S * torch.exp(g[b, t])[:, :, None]
            d = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S))
            S = S + k[b, t][:, :, None] * d[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    return o, torch.stack(finals)


def chunk_stages_ref(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                     cu_seqlens=None, chunk_size: int = 64) -> dict[str, torch.Tensor]:
    """Every intermediate of the chunked forward in the kernels' layouts (fp32), chunk by chunk."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    out = {name: torch.zeros(B, T, H, d) for name, d in
           [("G", K), ("Akk", BT), ("Aqk", BT), ("Ainv", BT), ("w", K), ("u", V), ("kg", K), ("v_new", V), ("o", V)]}
    hs, finals = [], []
    for n, (b, s, e) in enumerate(_seqs(T, B, cu_seqlens)):
        if initial_state is None:
            S = torch.zeros(H, K, V)
        else:
            i = n if initial_state_indices is None else int(initial_state_indices[n])
            S = initial_state[i].float().clone()
        for c0 in range(s, e, BT):
            c1 = min(c0 + BT, e)
            L = c1 - c0
            sl = (b, slice(c0, c1))
            G = torch.cumsum(g[sl], 0)  # [L,H,K]
            diff = G[:, None] - G[None, :]  # [i,j,H,K]
            tril = torch.tril(torch.ones(L, L, dtype=torch.bool))
            decay = torch.exp(torch.where(tril[:, :, None, None], diff, torch.full_like(diff, -torch.inf)))
            Aqk = torch.einsum("ihc,jhc,ijhc->ihj", q[sl], k[sl], decay) * scale
            Akk = torch.einsum("ihc,jhc,ijhc->ihj", k[sl], k[sl], decay) * beta[sl][:, :, None]
            strict = torch.tril(torch.ones(L, L), -1)
            Akk = Akk * strict[:, None, :]
            Ainv = torch.linalg.inv(torch.eye(L)[None] + Akk.permute(1, 0, 2))  # [H,L,L]
            bk = beta[sl][..., None] * k[sl] * torch.exp(G)
            w = torch.einsum("hij,jhk->ihk", Ainv, bk)
            u = torch.einsum("hij,jhv->ihv", Ainv, beta[sl][..., None] * v[sl])
            kg = k[sl] * torch.exp(G[-1][None] - G)
            hs.append(S.clone())
            v_new = u - torch.einsum("ihk,hkv->ihv", w, S)
            o = torch.einsum("ihk,hkv->ihv", q[sl] * torch.exp(G) * scale, S) + torch.einsum("ihj,jhv->ihv", Aqk, v_new)
            S = S * torch.exp(G[-1])[:, :, None] + torch.einsum("ihk,ihv->hkv", kg, v_new)
            # G as the kernels hold it: in base 2
            for name, val in [("G", G / math.log(2)), ("Aqk", Aqk), ("Akk", Akk), ("w", w), ("u", u), ("kg", kg),
                              ("v_new", v_new), ("o", o)]:
                out[name][b, c0:c1, :, : val.shape[-1]] = val
            out["Ainv"][b, c0:c1, :, :L] = Ainv.permute(1, 0, 2)
        finals.append(S)
    out["h"] = torch.stack(hs)  # [total chunks, H, K, V] in sequence order
    out["final_state"] = torch.stack(finals)
    return out
