"""Seeded, server-like forwards of sglang 0.5.23's CUDA KDA layer: the independent layer-level traffic that
``tests/test_sglang_layer.py`` (fake tensors, under the real Triton key computation) and
``bench/sglang_layer_traffic.py`` (the H200) check the plan of ``prewarm.providers.sglang.cuda`` against.

Written from sglang's own sources, never from the provider: the backend is ``KDAAttnBackend``
(``srt/layers/attention/linear/kda_backend.py``) with the state its constructors leave for ``--linear-attn-backend
triton``, under ``HybridLinearAttnBackend`` (``hybrid_linear_attn_backend.py``) for the commit after a verify. Each
forward gets the ``ForwardMetadata`` that ``MambaAttnBackendBase._forward_metadata`` builds from the batch (int32
``query_start_loc`` and mamba slots; the radix cache's track rows as ``_init_track_conv_indices`` and
``_init_track_ssm_indices`` compute them, int64 destinations), the pool as ``MambaPool.__init__`` allocates it on
CUDA (conv ``[layers, size + 1, kernel - 1, dim]``, temporal ``[layers, size + 1, H, V, K]``, the verify scratch
``[layers, requests + 1, draft, H, V, K]``, the per-step conv windows dense ``[layers, requests + 1, draft, kernel - 1,
dim]`` for a chain and a tree: ``conv_window_dedup_enabled`` never deduplicates KDA's), and the inputs Kimi-Linear's
``KimiDeltaAttention.forward`` hands over (``models/kimi_linear.py``: q/k/v and beta column slices of the fused
projection or their own outputs, the forget gate and the o_norm gate the two halves of one batched matmul), then
``o_norm`` (``FusedRMSNormGated``) on the output. After a verify: ``fused_commit_track_indices`` and
``update_mamba_state_after_mtp_verify`` (``speculative/spec_utils.py``) with accept tables as EAGLE's verify fills
them (int32).

Every call draws on its own, within the manifest's envelope (``read_spec``): the forward mode; each role's dtype;
beta's layout; for a prefill the number of sequences, every length up to the token budget, which sequences
continue a cached prefix, which the radix cache tracks (and at which length), DP padding past the logical tokens;
for a decode the batch size (a seeded permutation of 1..the largest batch: a run of enough calls sees every size),
CUDA-graph padded rows (the padding slot 0), tracked rows; for a verify the draft width, chain or tree, dense or
ragged (chain: 1..width tokens per request), the accepted lengths and the tracked commits. Pools are made per server
shape (draft width, chain or tree, dtypes) and only the current one is kept, so a GPU run holds one at a time. Values
are valid for a real run (slots in the pool, distinct per batch; track positions inside the batch; accept tables
within the draft), so the bench runs the same calls on the H200.
"""
from __future__ import annotations

import gc
import itertools
import random
from types import SimpleNamespace
from typing import Iterator

from prewarm.providers.capture import index_tensor
from prewarm.providers.sglang.common import published_parallel, read_spec
from traffic import Call, cycle, short

CHUNK = 64  # sglang's mamba chunk size (MambaAttnBackendBase.mamba_chunk_size's default): the track grid
TRACK_INTERVAL = 256  # --mamba-track-interval's default


def calls(spec: dict, seed: int, n: int, device: str) -> Iterator[Call]:
    """``n`` seeded layer forwards within ``spec``'s envelope, tensors on ``device`` (choices drawn when a call is
    made, tensors when it runs)."""
    traffic = _Traffic(read_spec(spec), random.Random(seed), device)
    for i in range(n):
        yield traffic.draw(i)


class _Traffic:
    def __init__(self, s, rng: random.Random, device: str):
        import torch

        self.s, self.rng, self.device, self.torch = s, rng, device, torch
        self.batches = {kind: cycle(rng, range(1, s.max_batch + 1)) for kind in ("decode", "target_verify")}
        self.widths = cycle(rng, s.draft_widths) if s.draft_widths else None
        self.kinds = [k for k, paths in (("extend", ("extend",)), ("decode", ("packed_decode", "decode")),
                                         ("target_verify", ("target_verify",)))
                      if set(paths) & set(s.paths) and (k != "target_verify" or s.draft_widths)]
        self.server = None  # (key, _Server): the pools of the last server shape drawn

    def draw(self, i: int) -> Call:
        return self.call(i, self.choose(self.rng.choice(self.kinds)))

    def call(self, i: int, d: dict) -> Call:
        label = f"{d['kind']}#{i}[" + ",".join(f"{k}={short(v)}" for k, v in d.items() if k != "kind") + "]"
        return Call(label, lambda: self.run(d), d)

    def roles(self, kind: str) -> dict:
        """A call's forward mode, each role's dtype and beta's layout."""
        s, rng = self.s, self.rng
        return {"kind": kind, **{role: rng.choice(names) for role, names in s.dtypes.items()},
                "beta_row": rng.choice(s.beta_row_strides)}

    def choose(self, kind: str) -> dict:
        """What one call of ``kind`` draws (extend, decode, target_verify)."""
        s, rng = self.s, self.rng
        d = self.roles(kind)
        slots = s.mamba_pool_slots - 1  # slot 0 is the pool's padding slot
        if kind == "extend":
            seqs = rng.randint(1, min(s.max_batch, slots, s.max_prefill_tokens))
            total = rng.randint(seqs, s.max_prefill_tokens)
            cuts = sorted(rng.sample(range(1, total), seqs - 1))
            d["lengths"] = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            d["physical"] = total + rng.choice([0, 0, rng.randint(1, 64)])  # DP-attention padding past the batch
            d["slots"] = rng.sample(range(1, slots + 1), seqs)
            d["prefix"] = [rng.choice([0, 0, rng.randint(1, 5000)]) for _ in range(seqs)]
            # the radix cache tracks a request at the last multiple of the track grid it reaches (0: untracked)
            d["track_at"] = [rng.choice([0, rng.randint(1, length)]) if s.track_state else 0
                             for length in d["lengths"]]
        else:
            d["batch"] = batch = next(self.batches[kind])
            batch = min(batch, slots)
            d["slots"] = rng.sample(range(1, slots + 1), batch)
            if batch > 1 and rng.random() < 0.3:  # a CUDA-graph bucket: its padded rows carry the padding slot 0
                pad = rng.randint(1, batch - 1)
                d["slots"][batch - pad:] = [0] * pad
            d["tracked"] = [s.track_state and rng.random() < 0.3 for _ in range(batch)]
            if kind == "target_verify":
                d["width"] = width = next(self.widths)
                d["tree"] = s.eagle_tree and rng.random() < 0.4
                ragged = not d["tree"] and rng.random() < 0.4  # ragged verify layouts: a linear chain only
                d["lens"] = [rng.randint(1, width) for _ in range(batch)] if ragged else [width] * batch
                d["accepted"] = [rng.randint(1, n) for n in d["lens"]]
                d["seq_lens"] = [rng.randint(1, 100000) for _ in range(batch)]
        return d

    # --- the server: pools, backend, layer ----------------------------------------------------------------------

    def server_for(self, d: dict) -> "_Server":
        key = (d["activation"], d["state"], d["gate_params"], d.get("width", 0), d.get("tree", False))
        if self.server is None or self.server[0] != key:
            from torch._subclasses.fake_tensor import is_fake

            held = self.server is not None and not is_fake(self.server[1].pool.mamba_pool.mamba_cache.temporal)
            self.server = None  # the previous pools go before the next are made (a GPU holds one set)
            if held:  # ... also where they sit in reference cycles (a graph server's captured forwards refer back to
                gc.collect()  # it, the pool's index lambda to the pool): 10-31 GiB a set for the H200 manifest
            self.server = (key, self.make_server(d))
        return self.server[1]

    def make_server(self, d: dict) -> "_Server":
        return _Server(self, d)

    def run(self, d: dict):
        server = self.server_for(d)
        return getattr(server, d["kind"])(d)


class _Server:
    """One rank of a deployment: the mamba pool (``MambaPool`` on CUDA), the KDA backend and the hybrid backend
    around it, the model's last KDA layer and its o_norm."""

    def __init__(self, traffic: _Traffic, d: dict):
        import torch
        from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend, KDAKernelDispatcher
        from sglang.srt.layers.attention.linear.utils import (
            LinearAttnKernelBackend,
            build_verify_intermediate_state_indices,
        )
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

        s = traffic.s
        self.s, self.device, self.torch = s, traffic.device, torch
        self.dt = lambda name: getattr(torch, d[name])  # noqa: E731
        h, K, V, L = s.heads, s.head_k_dim, s.head_v_dim, s.layers
        self.dim = 2 * h * K + h * V
        width, tree = d.get("width", 0), d.get("tree", False)
        size, requests = s.mamba_pool_slots - 1, s.max_batch
        zeros = self.zeros
        conv = zeros(L, size + 1, s.conv_kernel - 1, self.dim, dtype=self.dt("activation"))
        temporal = zeros(L, size + 1, h, V, K, dtype=self.dt("state"))
        inter_ssm = inter_conv = None
        if width:  # MambaPool's SpeculativeState
            inter_ssm = zeros(L, requests + 1, width, h, V, K, dtype=self.dt("state"))
            # dense windows, chain and tree: conv_window_dedup_enabled(..., is_kda=True) is False (KDA transposes
            # the window before its conv), so MambaPool takes its "original dense layout" branch over the conv
            # shape (kernel - 1, dim)
            inter_conv = zeros(L, requests + 1, width, s.conv_kernel - 1, self.dim, dtype=self.dt("activation"))

        def cache(layer=None):
            at = (lambda t: t) if layer is None else (lambda t: None if t is None else t[layer])
            return SimpleNamespace(conv=[at(conv)], temporal=at(temporal), intermediate_ssm=at(inter_ssm),
                                   intermediate_conv_window=[at(inter_conv)], replayssm_d=None, replayssm_k=None,
                                   replayssm_g=None)

        self.pool = SimpleNamespace(
            size=requests, mamba_map={i: i for i in range(L)}, mamba_pool=SimpleNamespace(mamba_cache=cache()),
            mamba2_layer_cache=cache, get_speculative_mamba2_params_all_layers=cache,
            translate_mamba_indices=lambda t: t,
            short_conv_pool=SimpleNamespace(conv_state=None, intermediate_conv_state=None),
            ngram_pool=SimpleNamespace(context=None, intermediate_context=None))
        triton = LinearAttnKernelBackend.TRITON
        with published_parallel(s):  # the server's published parallel config (eager batches pad to attention TP)
            verify_indices = build_verify_intermediate_state_indices(requests, self.device)
        backend = KDAAttnBackend.__new__(KDAAttnBackend)
        backend.__dict__.update(  # MambaAttnBackendBase.__init__, then KDAAttnBackend.__init__ (triton everywhere)
            pad_slot_id=-1, device=self.device, topk=2 if tree else 1, is_draft_worker=False,
            req_to_token_pool=self.pool, token_to_kv_pool=None, enable_unified_memory=False, forward_metadata=None,
            _mamba_chunk_size=CHUNK, prefill_graph_metadata=None, accept_lens_pool=None, _fused_chain_verify_fn=None,
            conv_states_shape=conv[0].transpose(-1, -2).shape,
            kernel_dispatcher=KDAKernelDispatcher(triton, triton, triton),
            verify_intermediate_state_indices=verify_indices)
        self.backend = backend
        full = SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=self.pool, kv_index_translator=None,
                               needs_cpu_seq_lens=False, use_captured_forward_metadata_for_breakable_cuda_graph=False)
        self.hybrid = HybridLinearAttnBackend(full, backend, [])
        params = self.dt("gate_params")
        self.layer = RadixLinearAttention(  # KimiDeltaAttention.attn: qkv_conv1d's weight is fp32
            layer_id=L - 1, num_q_heads=h, num_k_heads=h, num_v_heads=h, head_q_dim=K, head_k_dim=K, head_v_dim=V,
            conv_weights=zeros(self.dim, s.conv_kernel, dtype=torch.float32), bias=None,
            A_log=zeros(1, 1, h, 1, dtype=params), dt_bias=zeros(h * K, dtype=params), lower_bound=s.lower_bound)
        self.o_norm = FusedRMSNormGated(V, eps=1e-5, activation="sigmoid", device=self.device,
                                        dtype=self.dt("activation"))

    def zeros(self, *shape, dtype):
        return self.torch.zeros(*shape, dtype=dtype, device=self.device)

    def index(self, values, dtype=None):
        return index_tensor(list(values), dtype or self.torch.int32, self.device)

    def projections(self, d: dict, tokens: int):
        """KimiDeltaAttention.forward_qkvbfg(_fused): (mixed_qkv, beta [T, h], forget gate [T, hK], o_norm gate
        [T, hV])."""
        s = self.s
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        row = d["beta_row"]
        dt = {role: getattr(self.torch, d[role]) for role in ("activation", "beta", "gate")}  # this call's
        if row >= self.dim + h:  # fused_qkvbfg_a_proj, split [3hK, h, 2K]: q/k/v and beta column slices of a row
            fused = self.zeros(tokens, row, dtype=dt["activation"])
            mixed = fused[:, :self.dim]
            beta = (fused if d["beta"] == d["activation"] else
                    self.zeros(tokens, row, dtype=dt["beta"]))[:, self.dim:self.dim + h]
        else:  # qkv_proj and b_proj (a quantized checkpoint)
            mixed = self.zeros(tokens, self.dim, dtype=dt["activation"])
            beta = self.zeros(tokens, row, dtype=dt["beta"])[:, :h]
        fg = self.zeros(2, tokens, h * K, dtype=dt["gate"])  # fused_fg_b_proj: one batched matmul
        g = fg[1] if d["gate"] == d["activation"] and K == V else self.zeros(tokens, h * V, dtype=dt["activation"])
        return mixed, beta, fg[0], g

    def finish(self, core, g):
        """KimiDeltaAttention.forward after the attention: o_norm(core, g per head)."""
        with self.torch.no_grad():
            return self.o_norm(core, g.unflatten(-1, (-1, self.s.head_v_dim)))

    def metadata(self, **fields):
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        return ForwardMetadata(**fields)

    # --- forward modes -------------------------------------------------------------------------------------------

    def extend(self, d: dict):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        torch, s = self.torch, self.s
        lengths, prefix, track_at = d["lengths"], d["prefix"], d["track_at"]
        bs, total = len(lengths), sum(lengths)
        starts = list(itertools.accumulate(lengths, initial=0))
        mixed, beta, f, g = self.projections(d, d["physical"])
        f = f.unflatten(-1, (-1, s.head_k_dim)).unsqueeze(0)  # forward: [T, H*K] -> [1, T, H, K] outside decode
        fields = dict(query_start_loc=self.index(starts), logical_num_tokens=total,
                      mamba_cache_indices=self.index(d["slots"]))
        tracked = [i for i in range(bs) if track_at[i]]
        mask = None
        if tracked:  # _init_track_conv_indices / _init_track_ssm_indices (the device path)
            mask = torch.tensor([bool(t) for t in track_at], device=self.device)
            dst = [self.free_slot(d, j) for j in range(len(tracked))]
            window = self.backend.conv_states_shape[-1]
            conv_rows = [[min(max(starts[i] + (track_at[i] // CHUNK) * CHUNK - window + w, 0), total - 1)
                          for w in range(window)] for i in tracked]
            unaligned = [j for j, i in enumerate(tracked) if track_at[i] % CHUNK]
            aligned = [j for j, i in enumerate(tracked) if not track_at[i] % CHUNK]
            h_offsets = list(itertools.accumulate([(n - 1) // CHUNK + 1 for n in lengths], initial=0))
            chunk_idx = [-1] * bs
            for j in unaligned:
                chunk_idx[tracked[j]] = track_at[tracked[j]] // CHUNK
            long = lambda values: self.index(values, torch.int64)  # noqa: E731
            fields.update(
                has_mamba_track_mask=True, mamba_track_indices=long(dst), mamba_track_mask_indices=long(tracked),
                conv_states_mask_indices=long(dst), track_conv_indices=long(conv_rows),
                track_chunk_idx=self.index(chunk_idx),
                track_ssm_h_src=long([h_offsets[tracked[j]] + track_at[tracked[j]] // CHUNK for j in unaligned]),
                track_ssm_h_dst=long([dst[j] for j in unaligned]),
                track_ssm_h_batch_src=long([tracked[j] for j in unaligned]),
                track_ssm_final_src=long([d["slots"][tracked[j]] for j in aligned]),
                track_ssm_final_dst=long([dst[j] for j in aligned]))
        self.backend.forward_metadata = self.metadata(**fields)
        batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=bs, extend_seq_lens_cpu=list(lengths),
                                extend_prefix_lens=self.index(prefix), spec_info=None, mamba_track_mask=mask)
        core = self.backend.forward_extend(self.layer, batch, mixed, f, beta.unsqueeze(0))
        return self.finish(core, g)

    def free_slot(self, d: dict, j: int) -> int:
        """A track destination: a pool slot this batch does not run in (the radix cache's ping-pong slots)."""
        free = [x for x in range(1, self.s.mamba_pool_slots) if x not in set(d["slots"])] or [0]
        return free[j % len(free)]

    def decode(self, d: dict):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        torch = self.torch
        bs = len(d["slots"])
        mixed, beta, f, g = self.projections(d, bs)
        fields = dict(query_start_loc=self.index(range(bs + 1)), mamba_cache_indices=self.index(d["slots"]))
        mask = None
        if any(d["tracked"]):
            mask = torch.tensor(d["tracked"], device=self.device)
            fields["mamba_track_indices"] = self.index([self.free_slot(d, j) for j in range(bs)], torch.int64)
        self.backend.forward_metadata = self.metadata(**fields)
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs, extend_prefix_lens=None,
                                spec_info=None, mamba_track_mask=mask)
        core = self.backend.forward_decode(self.layer, batch, mixed, f, beta.unsqueeze(0))
        return self.finish(core, g)

    def target_verify(self, d: dict):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        torch = self.torch
        lens, width, bs = d["lens"], d["width"], len(d["slots"])
        tokens = sum(lens)
        cu = self.index(itertools.accumulate(lens, initial=0))
        ragged = any(n != width for n in lens)
        spec = SimpleNamespace(draft_token_num=width,
                               ragged_verify_layout=SimpleNamespace(qo_indptr_device=cu) if ragged else None)
        fields = dict(query_start_loc=cu, mamba_cache_indices=self.index(d["slots"]), is_target_verify=True,
                      draft_token_num=width)
        if d["tree"]:  # the EAGLE verify input's retrieve tables, a chain-shaped tree; the parent table empty_like
            nxt, sibling = self.retrieve_tables(bs, width)
            fields.update(retrieve_next_token=nxt, retrieve_next_sibling=sibling,
                          retrieve_parent_token=torch.empty_like(nxt))
        self.backend.forward_metadata = self.metadata(**fields)
        mixed, beta, f, g = self.projections(d, tokens)
        batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, spec_info=spec,
                                req_pool_indices=self.index(range(bs), torch.int64), mamba_track_mask=None)
        out = self.finish(self.backend.forward_extend(self.layer, batch, mixed, f, beta.unsqueeze(0)), g)
        self.commit(d)
        return out

    def retrieve_tables(self, bs: int, width: int):
        """``eagle_utils.build_tree_kernel_efficient``'s retrieve_next_token and retrieve_next_sibling: rows 1 and 2 of
        one int64 ``[3, bs, width]`` buffer (row 0 is retrieve_index), so row 1 starts bs x width x 8 bytes in (not
        16-byte aligned where bs x width is odd); filled as its tree kernel fills a chain-shaped tree."""
        buf = self.torch.full((3, bs, width), -1, dtype=self.torch.int64, device=self.device)
        _, nxt, sibling = buf
        nxt[:, :-1].copy_(self.index([list(range(1, width))] * bs, self.torch.int64))
        return nxt, sibling

    def commit(self, d: dict):
        """The state commit after a verify (spec_utils): the accepted steps, then the backend's scatter."""
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_commit_track_indices

        torch = self.torch
        width, bs = d["width"], len(d["slots"])
        # eagle_utils: accept_index [bs, width] int32 (flat draft rows, -1 past the accepted), accept_lens int32
        accept_index = self.index([[i * width + j if j < n else -1 for j in range(width)]
                                   for i, n in enumerate(d["accepted"])])
        track = any(d["tracked"])
        last, to_track = fused_commit_track_indices(
            accept_index, self.index(d["accepted"]), self.index(d["seq_lens"], torch.int64) if track else None,
            width, TRACK_INTERVAL if track else 0)
        self.hybrid.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last, mamba_steps_to_track=to_track, model=None,
            mamba_track_indices=self.index([self.free_slot(d, j) for j in range(bs)], torch.int64) if track else None,
            req_pool_indices=self.index(range(bs), torch.int64))
