"""Seeded, server-like batches of sglang 0.5.23's serving path around the CUDA KDA layer: CUDA-graph capture and
replay of decode and target verify, the model runner's mamba slot clear / copy and extend positions, the EAGLE
worker's verify commit. The independent traffic that ``tests/test_sglang_graph.py`` (fake tensors, under the real
Triton key computation) and ``bench/sglang_layer_traffic.py --graph`` (the H200, real CUDA graphs) check the plan
of ``prewarm.providers.sglang.cuda`` against.

Written from sglang's own runner, model and worker code, never from the provider; the layer itself (pools, the KDA
backend under ``HybridLinearAttnBackend``, Kimi-Linear's projections and o_norm) is ``traffic.sglang_layer``'s:

- CUDA graphs (``runner/decode_cuda_graph_runner.py``): the graph runner calls ``init_cuda_graph_state(max_bs,
  max_bs * width)`` once, then per bucket of ``--cuda-graph-bs`` (``decode_batch_buckets``, capped at
  ``max_running_requests`` as ``get_batch_sizes_to_capture`` caps them) captures ``init_forward_metadata_out_graph(
  in_capture=True)`` and the forward at the bucket's full size; a replay pads the batch to the smallest bucket that
  holds it (``_pad_to_bucket``), fills the static buffers as ``fill_from`` does (the padded rows of the index
  buffers zeroed: a padded row's slot is -1, its track mask must be False; all of them zeroed before a capture, as
  ``reset_index_buffers``) and calls ``init_forward_metadata_out_graph`` on ``build_replay_fb_view``'s view
  (``req_pool_indices`` the static int64 buffer's first ``bucket`` rows, ``num_padding`` = bucket - batch, the
  static track buffer), whose ``_replay_metadata`` launches ``fused_replay_state_indices`` (the mapping table
  int32, the per-bucket int32 slot buffer) outside the graph. Decode captures ``DECODE``; with EAGLE the target
  captures ``TARGET_VERIFY`` (chain or tree: the tree's retrieve tables are the per-bucket int32 buffers, the spec
  info's int64 tables copied in at replay). On a GPU (``graphs=True``) the forward is captured into a
  ``torch.cuda.CUDAGraph`` and replayed; on fake tensors a replay launches nothing past the metadata, as on a node.
- The model runner (``model_runner._maybe_execute_deferred_mamba_cow_and_clear``, ``memory_pool.MambaPool``): before
  an extend, the fresh requests' slots are cleared and a prefix-cache hit's checkpoint slot copied into its slot
  (``fused_clear_conv_slots`` / ``fused_copy_conv_slots`` over ``build_conv_slot_descriptor(conv)``, int64 slots, for
  a bf16 conv pool), after the pool's own warm-up copy at construction; ``ForwardBatch.init_new`` computes the
  extend positions (``compute_position_triton``: int32 prefix and extend lengths).
- The EAGLE worker (``eagle_worker_common``): after a verify, ``prepare_verify_commit_outputs`` over ``eagle_sample``'s
  outputs (predict int32 ``[tokens]``, accept_index int32 ``[bs, depth]``, accept_lens int32, the batch's int64
  seq_lens); a chain (topk 1, depth = the draft width) with the draft width and the track grid, its step indices
  handed to the commit; a tree (depth = steps + 1 <= the width) without, its steps from ``fused_commit_track_indices``
  (``_verify_commit_step_indices``); then ``update_mamba_state_after_mtp_verify``.

Every call draws on its own: the kind (extend, graph decode, graph verify, eager verify), each role's dtype, beta's
layout (the fused projection's row, ``3*h*K + h + 2*K`` = 12576 at Kimi-Linear 48B's TP 1, or b_proj's own), graph
batch sizes as seeded permutations of 1..the largest bucket (so every bucket and every padding of it comes), the
draft width, chain or tree and the tree's depth, accepted lengths, tracked rows, prefill requests fresh, continuing a
prefix-cache checkpoint or a chunked prefill.
"""
from __future__ import annotations

import bisect
import random
from types import SimpleNamespace
from typing import Iterator

from prewarm.providers.sglang.common import read_spec
from traffic import Call, cycle
from traffic.sglang_layer import TRACK_INTERVAL, _Server, _Traffic


def calls(spec: dict, seed: int, n: int, device: str, graphs: bool = False) -> Iterator[Call]:
    """``n`` seeded batches within ``spec``'s envelope, tensors on ``device``; ``graphs``: capture and replay real
    CUDA graphs (a GPU)."""
    traffic = _GraphTraffic(read_spec(spec), capture_buckets(spec), random.Random(seed), device, graphs)
    for i in range(n):
        yield traffic.draw(i)


def capture_buckets(spec: dict) -> list[int]:
    """The batch sizes sglang captures graphs for: ``--cuda-graph-bs`` (the manifest's decode buckets) up to
    ``--max-running-requests``, which joins them when smaller than the largest (``get_batch_sizes_to_capture``)."""
    serving = spec.get("serving", {})
    buckets, most = list(serving.get("decode_batch_buckets", [])), serving.get("max_running_requests")
    if most and buckets and max(buckets) > most:
        buckets.append(most)
    return sorted({b for b in buckets if not most or b <= most})


class _GraphTraffic(_Traffic):
    def __init__(self, s, buckets: list[int], rng: random.Random, device: str, graphs: bool):
        super().__init__(s, rng, device)
        self.buckets, self.graphs = buckets, graphs
        self.graph_batches = {kind: cycle(rng, range(1, buckets[-1] + 1)) for kind in ("decode", "target_verify")} \
            if buckets else {}
        self.kinds = ["extend"] * ("extend" in s.paths) + ["graph_decode"] * bool(buckets)
        if s.draft_widths and "target_verify" in s.paths:
            self.kinds += ["graph_verify"] * bool(buckets) + ["target_verify"]

    def make_server(self, d: dict) -> "_GraphServer":
        return _GraphServer(self, d)

    def choose(self, kind: str) -> dict:
        s, rng = self.s, self.rng
        if kind in ("extend", "target_verify"):
            d = super().choose(kind)
        else:
            mode = {"graph_decode": "decode", "graph_verify": "target_verify"}[kind]
            d = self.roles(kind)
            d["batch"] = batch = next(self.graph_batches[mode])
            d["bucket"] = self.buckets[bisect.bisect_left(self.buckets, batch)]
            d["rows"] = rng.sample(range(1, s.max_batch + 1), batch)  # req_to_token rows
            d["slots"] = rng.sample(range(1, s.mamba_pool_slots), batch)
            d["tracked"] = [s.track_state and rng.random() < 0.3 for _ in range(batch)]
            if mode == "target_verify":
                d["width"] = width = next(self.widths)
                d["tree"] = s.eagle_tree and rng.random() < 0.4
                d["accepted"] = [rng.randint(1, width) for _ in range(batch)]
                d["seq_lens"] = [rng.randint(1, 100000) for _ in range(batch)]
        if "width" in d:
            # a chain's accept table is as wide as the draft; a tree's as deep as its steps + 1
            d["depth"] = rng.randint(2, d["width"]) if d["tree"] else d["width"]
            d["accepted"] = [min(n, d["depth"]) for n in d["accepted"]]
        if kind == "extend":  # per request: a fresh slot (cleared), a checkpoint hit (copied) or a continued chunk
            d["slot_ops"] = [rng.choice(["cow", "continue"]) if prefix else "clear" for prefix in d["prefix"]]
        return d


class _GraphServer(_Server):
    """A ``traffic.sglang_layer`` rank plus what the graph runner, the model runner's pool and the EAGLE worker keep:
    the request->slot mapping, the graph runner's static buffers, the captured buckets."""

    def __init__(self, traffic: _GraphTraffic, d: dict):
        super().__init__(traffic, d)
        from sglang.srt.mem_cache.mamba_slot_fused import build_conv_slot_descriptor, warmup_fused_copy_conv_slots

        torch, s, pool = self.torch, self.s, self.pool
        self.buckets, self.real_graphs = traffic.buckets, traffic.graphs
        self.width = d.get("width", 0)
        conv = pool.mamba_pool.mamba_cache.conv
        # HybridReqToTokenPool: the static pool's mapping (int32 per request row), physical ids (no v2p table)
        pool.req_index_to_mamba_index_mapping = self.zeros(s.max_batch + 1, dtype=torch.int32)
        pool.mamba_v2p_table = None
        pool.get_mamba_indices = lambda rows: pool.req_index_to_mamba_index_mapping[rows]
        pool.mamba_pool.size, pool.mamba_pool.enable_linear_replayssm = s.mamba_pool_slots - 1, False
        # MambaPool: the fused slot ops for a bf16 conv pool (_conv_fuse_ok), warmed at construction
        self.slot_desc = None
        if conv[0].dtype == torch.bfloat16:
            self.slot_desc = build_conv_slot_descriptor([_Addressed(t) if self.fake else t for t in conv])
            warmup_fused_copy_conv_slots(self.slot_desc)
        # MambaAttnBackendBase.__init__'s graph state (the CUDA static pool: the fused replay path)
        self.backend.__dict__.update(
            _fused_state_indices_ok=True, state_indices_list=[], mamba_track_indices_buf=None,
            replayssm_write_pos_list=None, replayssm_force_flush_list=None, query_start_loc_list=[],
            retrieve_next_token_list=[], retrieve_next_sibling_list=[], retrieve_parent_token_list=[],
            cached_cuda_graph_decode_query_start_loc=None, cached_cuda_graph_verify_query_start_loc=None,
            _graph_seq_len_fill_value=1)
        full = self.hybrid.full_attn_backend  # not KDA's: its graph state and metadata are no concern here
        full.init_cuda_graph_state = full.init_forward_metadata_out_graph = lambda *a, **k: None
        self.graph_state = None  # the graph runner's buffers, made at the first graph batch
        self.graphs: dict[tuple, tuple] = {}  # (bucket, layout) -> (CUDAGraph or None, the captured forward)

    @property
    def fake(self) -> bool:
        from torch._subclasses.fake_tensor import is_fake

        return is_fake(self.pool.mamba_pool.mamba_cache.conv[0])

    # --- the model runner around an extend ---------------------------------------------------------------------

    def extend(self, d: dict):
        from sglang.kernels.ops.attention.position import compute_position_triton
        from sglang.srt.mem_cache.mamba_slot_fused import fused_clear_conv_slots, fused_copy_conv_slots

        torch = self.torch
        long = lambda values: self.index(values, torch.int64)  # noqa: E731  (mamba_pool_idx tensors, cat'ed)
        ops, slots = d["slot_ops"], d["slots"]
        clear = [slot for slot, op in zip(slots, ops) if op == "clear"]
        cow = [j for j, op in enumerate(ops) if op == "cow"]
        if self.slot_desc is not None:
            if clear:  # clear_slots: conv by the fused kernel, temporal by index_fill_
                fused_clear_conv_slots(self.slot_desc, long(clear))
            if cow:  # copy_mamba_state -> copy_from: a radix checkpoint slot into the request's fresh slot
                fused_copy_conv_slots(self.slot_desc, long([self.free_slot(d, j) for j in range(len(cow))]),
                                      long([slots[j] for j in cow]))
        compute_position_triton(self.index(d["prefix"]), self.index(d["lengths"]), sum(d["lengths"]))
        return super().extend(d)

    # --- CUDA graphs -------------------------------------------------------------------------------------------

    def buffers(self):
        """The graph runner's static input buffers (max_bs rows) after ``init_cuda_graph_state``."""
        if self.graph_state is None:
            torch, most = self.torch, self.buckets[-1]
            self.hybrid.init_cuda_graph_state(most, most * max(self.width, 1))
            self.graph_state = SimpleNamespace(
                req_pool_indices=self.zeros(most, dtype=torch.int64),
                mamba_track_indices=self.zeros(most, dtype=torch.int64) if self.s.track_state else None,
                mamba_track_mask=self.zeros(most, dtype=torch.bool) if self.s.track_state else None)
        return self.graph_state

    def zero_index_buffers(self, rows: slice):
        """Zero ``rows`` of the runner's index-semantic buffers (``input_buffers.INDEX_SEMANTIC_BUFFERS``: request
        rows, track destinations, track mask), as ``reset_index_buffers`` (before a capture) and ``fill_from``'s
        padding reset (the padded tail before a replay) do."""
        for buffer in vars(self.buffers()).values():
            if buffer is not None:
                buffer[rows].zero_()

    def view(self, mode, bs: int, padding: int, spec=None):
        """build_replay_fb_view's fields that the mamba backend reads."""
        b = self.buffers()
        return SimpleNamespace(batch_size=bs, forward_mode=mode, req_pool_indices=b.req_pool_indices[:bs],
                               seq_lens_cpu=None, num_padding=padding, spec_info=spec,
                               mamba_track_indices=None if b.mamba_track_indices is None
                               else b.mamba_track_indices[:bs])

    def graph(self, d: dict, mode, spec_for, forward):
        """Capture the bucket once (its metadata, then the forward), then replay this batch padded to it."""
        torch = self.torch
        bucket, batch = d["bucket"], d["batch"]
        b = self.buffers()
        key = (bucket, d["beta_row"], d["beta"], d["gate"])  # a deployment's layout: its own captures
        if key not in self.graphs:
            # _capture's reset_index_buffers: a capture runs real forwards, so a recapture mid-serving (here each
            # bucket is captured at its first batch) would index through the previous batch's live rows
            self.zero_index_buffers(slice(None))
            self.hybrid.init_forward_metadata_out_graph(self.view(mode, bucket, 0, spec_for(None)), in_capture=True)
            run = forward(bucket)
            graph = None
            if self.real_graphs:  # the runner's warm-up run, then the capture
                run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            else:
                run()
            self.graphs[key] = (graph, run)
        # ScheduleBatch -> buffers (fill_from): the padded rows reset (the index slots' ZERO padding policy: a padded
        # row's state slot is -1, which the captured track-save would read through a stale track mask), then the
        # live rows, their slots in the mapping, the track rows
        self.zero_index_buffers(slice(batch, bucket))
        mapping = self.pool.req_index_to_mamba_index_mapping
        rows = self.index(d["rows"], torch.int64)
        mapping[rows] = self.index(d["slots"])
        b.req_pool_indices[:batch].copy_(rows)
        if b.mamba_track_indices is not None:
            b.mamba_track_indices[:batch].copy_(self.index([self.free_slot(d, j) for j in range(batch)],
                                                           torch.int64))
            b.mamba_track_mask[:batch].copy_(torch.tensor(d["tracked"], device=self.device))
        self.hybrid.init_forward_metadata_out_graph(self.view(mode, bucket, bucket - batch, spec_for(d)))
        graph = self.graphs[key][0]
        if graph is not None:
            graph.replay()

    def graph_decode(self, d: dict):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        def forward(bs: int):
            mixed, beta, f, g = self.projections(d, bs)
            mask = self.buffers().mamba_track_mask
            batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs, extend_prefix_lens=None,
                                    spec_info=None, mamba_track_mask=None if mask is None else mask[:bs])
            return lambda: self.finish(self.backend.forward_decode(self.layer, batch, mixed, f, beta.unsqueeze(0)), g)

        self.graph(d, ForwardMode.DECODE, lambda _: None, forward)

    def graph_verify(self, d: dict):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        width = d["width"]

        def spec_for(drawn):
            """get_spec_info at capture (no retrieve tables); the live EagleVerifyInput at replay (int64 tables)."""
            spec = SimpleNamespace(draft_token_num=width, ragged_verify_layout=None, retrieve_next_token=None,
                                   retrieve_next_sibling=None)
            if drawn is not None and d["tree"]:
                spec.retrieve_next_token, spec.retrieve_next_sibling = self.retrieve_tables(len(drawn["slots"]), width)
            return spec

        def forward(bs: int):
            mixed, beta, f, g = self.projections(d, bs * width)
            batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, spec_info=spec_for(None),
                                    req_pool_indices=self.buffers().req_pool_indices[:bs], mamba_track_mask=None)
            return lambda: self.finish(self.backend.forward_extend(self.layer, batch, mixed, f, beta.unsqueeze(0)), g)

        self.graph(d, ForwardMode.TARGET_VERIFY, spec_for, forward)
        self.commit(d)

    # --- the EAGLE worker after a verify ------------------------------------------------------------------------

    def commit(self, d: dict):
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_commit_track_indices
        from sglang.kernels.ops.speculative.eagle import prepare_verify_commit_outputs

        torch = self.torch
        width, depth, bs = d["width"], d["depth"], len(d["slots"])
        predict = self.zeros(sum(d.get("lens", [width] * bs)), dtype=torch.int32)  # one per verified token
        accept_index = self.index([[i * width + j if j < n else -1 for j in range(depth)]
                                   for i, n in enumerate(d["accepted"])])
        accept_lens, seq_lens = self.index(d["accepted"]), self.index(d["seq_lens"], torch.int64)
        track = any(d["tracked"])
        interval = TRACK_INTERVAL if track else 0  # mamba_track_grid at page size 1
        if not d["tree"]:
            _, _, (last, to_track), _ = prepare_verify_commit_outputs(
                predict, accept_index, accept_lens, seq_lens, num_draft_tokens=width, mamba_track_interval=interval)
        else:
            prepare_verify_commit_outputs(predict, accept_index, accept_lens, seq_lens)
            last, to_track = fused_commit_track_indices(accept_index, accept_lens, seq_lens if track else None, width,
                                                        interval)
        self.hybrid.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last, mamba_steps_to_track=to_track, model=None,
            mamba_track_indices=self.index([self.free_slot(d, j) for j in range(bs)], torch.int64) if track else None,
            req_pool_indices=self.index(d.get("rows", range(bs)), torch.int64))


class _Addressed:
    """A fake pool tensor for ``build_conv_slot_descriptor``, which reads ``data_ptr()`` (a fake tensor has none):
    an aligned address, everything else the tensor's own. The kernels take the descriptor's int64 tables, whose
    layout does not depend on the address."""

    def __init__(self, tensor):
        self._tensor = tensor

    def data_ptr(self) -> int:
        return 1 << 20

    def __getattr__(self, name):
        return getattr(self._tensor, name)

    def __getitem__(self, key):
        return self._tensor[key]
