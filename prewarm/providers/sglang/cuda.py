"""sglang's own KDA kernels as its CUDA KDA backend calls them: ``provider = "prewarm.providers.sglang.cuda"``.

sglang (0.5.23) serves Kimi's KDA layers with its own copy of the kernels (``sglang/kernels/ops/attention/fla/`` and
``.../linear/``), called through ``TritonKDAKernel`` (``sglang/srt/layers/attention/linear/kernels/kda_triton.py``)
by ``KDAAttnBackend`` (``.../linear/kda_backend.py``); Ascend's backend is :mod:`.ascend`. :func:`launches`
makes those calls with tensors laid out as the backend and the model hand them over (q/k/v as views of the conv
output, beta as a view of the fused projection, the state pool ``[slots, H, V, K]`` by index, int32
``query_start_loc``), on fake tensors of the target's device type (``prewarm.providers.sglang.common``), every
``kernel[grid](...)`` captured and none launched. The build expands each into every autotune config.

The envelope (``[spec]``: the KDA serving spec, ``prewarm_kernels.spec.read_kda``, plus ``[spec.sglang]``, see
:func:`prewarm.providers.sglang.common.read_spec`), and what it plans:

- Paths (``spec.sglang.paths``): ``extend`` (``chunk_kda``), ``packed_decode`` (the decode sglang takes without a
  gate lower bound; bf16 batches of 8 or more with int32 indices and fp32 parameters leave Triton for sglang's CUDA
  JIT module ``kda_packed_decode``: planned as a JIT request, built by sglang's own ``load_jit``), ``decode`` (``fused_sigmoid_gating_delta_rule_update``: the decode with
  a lower bound) and ``target_verify`` (the same kernel over draft tokens).
- Decode batch sizes 1..max(largest bucket, ``max_running_requests``) (sglang runs eager batches of any size):
  what they change is the verify kernel's ``NP2_T`` (next power of two of the tokens; ``B`` is 1: sglang packs
  tokens) and, at one row, a view's strides (constexprs of the packed decode). :func:`prewarm.providers.capture.batch_sizes` stands
  for every size (``tests/test_sglang.py`` sweeps each one against the plan). Verify: each with every draft width, dense and
  ragged (one token per request), chain and, with ``spec.sglang.eagle_tree``, tree (``retrieve_parent_token``: its
  strides are constexprs); the scratch pitch (``cache_steps``, an int class) at the draft width and at the largest
  one (adaptive speculation keeps the allocated pitch).
- Prefill (``extend``) at a packed layout for each (small grid, ``NT_BUCKET``) pair the token budget reaches:
  ``chunk_kda_fwd`` fuses the diagonal and recompute kernels when ``chunks * heads <= 256`` and
  ``chunk_gated_delta_rule_fwd_h`` takes ``NT_BUCKET`` = 0 / 1 / 2 for <= 32 / <= 128 / more chunks; raw beta
  (``beta_is_raw``, sglang's call: its strides are constexprs, at each ``spec.sglang.beta_row_strides``) and
  sigmoided beta; the gate activated in-kernel with and without ``dt_bias``, and pre-activated (``A_log=None``);
  with and without the prefix-cache track snapshot (``track_state``); the model's ``gate_lower_bound``.
- ``spec.sglang.sampling_backend`` (``--sampling-backend``, default flashinfer): FlashInfer's sampling module.
- Dtypes per role (``[spec.dtypes]``): activation (q, k, v, the conv output), gate (a), beta (b), gate_params
  (A_log and dt_bias), state (the pool and the verify scratch), index (query_start_loc, cache and scratch indices,
  the track rows; one dtype per call, as a server builds them); the cross product is planned.

The layer around those calls (:class:`_Layer`): ``KDAAttnBackend`` itself, driven as the server drives it, with the
causal conv (prefill and decode/verify, its pool's slot count ``spec.sglang.mamba_pool_slots`` a constexpr), the
radix cache's state tracking, the commit after a verify and the model's o_norm; :func:`geometry` says which pool
dimensions reach the kernels and where a live server shows them. The layer's inputs are Kimi-Linear's (q/k/v and beta
as column views of its fused projection, row pitch ``spec.sglang.beta_row_strides``, or separate projections) in
every path, verify included. CUDA graphs (``spec.serving.decode_batch_buckets``: ``--cuda-graph-bs``): the decode and
the target-verify graph runners (chain and tree, each draft width) through the hybrid backend's
``init_cuda_graph_state`` and ``init_forward_metadata_out_graph``, the layer captured at each bucket, then every
replay's metadata, padded as the runner pads a smaller batch (:func:`replay_sizes`;
``sglang.kernels.ops.mamba.mamba_state_indices_triton``). Around the layer, the server's own kernels for the same
batches, each through the sglang function that launches it (the plan's labels name it): the model runner's extend
positions (``runner.extend_positions``: ``sglang.kernels.ops.attention.position``), the mamba pool's fused slot
clear / copy-on-write and its init warmup (``runner.mamba_slot_*``: ``sglang.srt.mem_cache.mamba_slot_fused``, as
``MambaPool.clear_slots`` / ``copy_from`` call it) and the EAGLE worker's commit outputs (``eagle.verify_commit``:
``sglang.kernels.ops.speculative.eagle.prepare_verify_commit_outputs``).

Not planned (:data:`NOT_PLANNED`: sglang options that need a deployment's value or another kernel library, each
refused by ``prewarm manifest`` where the launch line asks for it): ReplaySSM, the prefill CUDA graph, the
non-Triton linear-attention backends, the fused chain verify, the fused K3 decode.
:func:`options` lists each of them; ``prewarm plan`` prints them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from ..capture import TensorCache, batch_sizes, index_tensor, launches_of
from .common import Batch, MambaPoolView, SglangSpec, fake_device, hybrid_backend, published_parallel, read_spec
from . import model

CHUNK = 64  # chunk_kda_fwd's chunk size (tokens)
SMALL_GRID_CTAS = 256  # chunk_kda_fwd fuses diagonal + recompute when batch * chunks * heads <= this
NT_BUCKETS = (32, 128)  # chunk_gated_delta_rule_fwd_h: NT_BUCKET 0 up to 32 chunks, 1 up to 128, 2 above
# the backend's forward paths (:class:`_Layer`), each planned where spec.sglang.paths names a kernel path it reaches
LAYER_PATHS = {"extend": ("extend",), "decode": ("packed_decode", "decode"), "target_verify": ("target_verify",),
               "decode_graph": ("packed_decode", "decode"), "verify_graph": ("target_verify",),
               "runner": ("extend",), "verify_commit": ("target_verify",)}
TRACK_INTERVAL = 256  # --mamba-track-interval's default: the verify commit's track grid (an int, not a constexpr)


def launches(spec: dict) -> list:
    """Every kernel launch sglang's KDA backend makes within ``spec``'s envelope, on fake tensors (nothing runs),
    then the modules past Triton the server builds at first use (:class:`prewarm.jit.JitRequest`): each sglang JIT
    module those calls reached (sglang's ``load_jit`` resolved it) and FlashInfer's sampling module where sglang
    samples with FlashInfer (:func:`sampling_modules`)."""
    s = read_spec(spec)
    _import_sglang()
    out = []
    with published_parallel(s), fake_device(s.device) as device:
        for label, call in _calls(s, s.device):
            for launch in launches_of(call):
                launch.label = f"{label}/{_kernel_name(launch)}"
                out.append(launch)
    return model.launches(spec, s, out) + list(dict.fromkeys(device.jit)) + sampling_modules(s)


def coverage(spec: dict) -> list[dict]:
    """The provider's coverage hook (:mod:`prewarm.providers.contract`): the model's components
    (:func:`prewarm.providers.sglang.model.coverage`), the KDA layer's options not planned among them."""
    return model.coverage(spec, NOT_PLANNED)


def sampling_modules(s: SglangSpec) -> list:
    """FlashInfer's sampling module where ``--sampling-backend`` is flashinfer (sglang's default where FlashInfer is
    installed): sglang's sampler calls it for every batch with temperature > 0, and FlashInfer JIT-builds it at the
    first such request (sglang's own warmup request is greedy: after the server says ready)."""
    if s.sampling_backend != "flashinfer":
        return []
    from ..flashinfer.jit import module_request

    return [module_request("flashinfer.jit.sampling:gen_sampling_module",
                           origin="sglang's sampler (--sampling-backend flashinfer): top-k/top-p/min-p sampling")]


def prefill_layouts(heads: int, max_tokens: int, max_seqs: int) -> list[tuple[str, list[int]]]:
    """(name, sequence lengths) of one packed prefill per (small grid, NT_BUCKET) pair reachable with at most
    ``max_tokens`` tokens in at most ``max_seqs`` sequences: the only values ``chunk_kda`` derives from the lengths
    (its T and N are never specialized). A sequence of n tokens is cdiv(n, 64) chunks."""
    seqs = max(1, min(max_seqs, max_tokens))
    most = seqs + (max_tokens - seqs) // CHUNK  # one-token sequences, then 64-token chunks of the rest
    small = SMALL_GRID_CTAS // heads
    out: dict[tuple[bool, int], tuple[str, list[int]]] = {}
    for chunks in sorted({1, small, small + 1, *NT_BUCKETS, *(b + 1 for b in NT_BUCKETS), most}):
        if not 1 <= chunks <= most:
            continue
        long = min(chunks, max(0, (max_tokens - chunks) // (CHUNK - 1)))  # chunks of one long sequence
        lengths = ([CHUNK * long] if long else []) + [1] * (chunks - long)
        if len(lengths) > max_seqs:  # fewer, longer sequences: the most chunks the budget allows per sequence
            lengths = _spread(chunks, max_seqs)
        key = (chunks <= small, sum(chunks > b for b in NT_BUCKETS))
        out.setdefault(key, (f"chunks={chunks},small_grid={key[0]},NT_BUCKET={key[1]}", lengths))
    return list(out.values())


def conv_layouts(max_tokens: int) -> list[tuple[str, list[int]]]:
    """(name, sequence lengths) of prefills whose token count is in each class Triton specializes an int on (1, a
    multiple of 16, other) that :func:`prefill_layouts` may not reach: ``causal_conv1d_fn`` passes the packed token
    count as the kernel's ``seqlen``."""
    return [(f"T={tokens}", [tokens]) for tokens in (1, CHUNK, CHUNK + 3) if tokens <= max_tokens]


def _spread(chunks: int, seqs: int) -> list[int]:
    """``seqs`` sequences of ``chunks`` chunks in all, each one token past a multiple of 64 (the fewest tokens)."""
    each, extra = divmod(chunks, seqs)
    return [CHUNK * (each + (i < extra) - 1) + 1 for i in range(seqs)]


def replay_sizes(buckets: tuple) -> Iterator[tuple[int, list[int]]]:
    """(bucket, request counts) of the CUDA-graph replays that stand for all: a batch of n requests replays the
    smallest bucket >= n, padded; of the counts each bucket serves, one of each class Triton specializes the replay
    kernel's ``valid_bs`` on (1, a multiple of 16, other)."""
    previous = 0
    for bucket in buckets:
        classes: dict[int, int] = {}
        for n in range(previous + 1, bucket + 1):
            classes.setdefault(1 if n == 1 else 16 if n % 16 == 0 else 0, n)
        yield bucket, sorted(classes.values())
        previous = bucket


def verify_token_counts(max_batch: int, width: int) -> Iterator[tuple[int, int]]:
    """(requests, tokens) of the verify batches that stand for all: dense (``width`` tokens each) and ragged (one
    token each, the fewest), at each of :func:`batch_sizes`."""
    for batch in batch_sizes(max_batch):
        yield batch, batch * width
        yield batch, batch


def options(spec: dict) -> list[dict]:
    """Each axis of sglang's KDA API this provider plans: its spec key, the values planned, every value sglang
    accepts (None: any), whether the manifest set it; ``prewarm plan`` prints the narrowed ones. Then what is not
    planned, with why (:data:`NOT_PLANNED`; ``prewarm manifest`` refuses the launch options that reach it), and the
    pool geometry the plan derives from the spec that reaches a constexpr, with where a live server shows it
    (``derived``: ``prewarm plan`` prints each)."""
    from prewarm_kernels.spec import DTYPES, INDEX_DTYPES

    from .common import PATHS, ROLES

    s = read_spec(spec)
    given = {table: set(spec.get(table) or ()) if isinstance(spec.get(table), dict) else set()
             for table in ("dtypes", "sglang")}
    rows = [(f"dtypes.{role}", s.dtypes[role], list(INDEX_DTYPES if role == "index" else DTYPES)) for role in ROLES]
    rows += [("sglang.paths", list(s.paths), list(PATHS["cuda"])),
             ("sglang.beta_row_strides", list(s.beta_row_strides), None),
             ("sglang.eagle_tree", [False, True] if s.eagle_tree else [False], [False, True]),
             ("sglang.track_state", [False, True] if s.track_state else [False], [False, True])]
    out = [{"key": f"spec.{key}", "planned": planned, "accepted": accepted,
            "given": key.split(".")[1] in given.get(key.split(".")[0], set()),
            "narrowed": accepted is not None and planned != accepted} for key, planned, accepted in rows]
    out += [{"key": f"spec.sglang.{key}", "planned": [False], "accepted": [False, True], "given": False,
             "narrowed": True, "why": why} for key, why in NOT_PLANNED.items()]
    return out + [{"key": key, "planned": value, "accepted": None, "given": key.removeprefix("spec.sglang.") in
                   given["sglang"], "narrowed": False, "derived": check} for key, value, check in geometry(s)]


# sglang 0.5.23 CUDA options that change which kernels the KDA layer runs, not planned (prewarm manifest refuses each
# launch option by name, exit 3)
NOT_PLANNED = {
    "replayssm": "--enable-linear-replayssm / --enable-linear-replayssm-spec: the ReplaySSM ring caches (their "
                 "length, --linear-replayssm-cache-len, is a constexpr) and the replay/fold kernels",
    "prefill_graph": "prefill CUDA graphs: sglang 0.5.23 turns the breakable one off for KDA models (cuda_graph_hook: "
                     "'Breakable CUDA graph is incompatible with KDA hybrid linear attention'); "
                     "--cuda-graph-backend-prefill full (kda_prefill_graph's padded tables) is not planned",
    "linear_attn_backends": "--linear-attn-backend / --linear-attn-{decode,prefill,verify}-backend other than "
                            "triton (FlashInfer, Helion, CuTe DSL, FlashKDA, NVIDIA/PTX KDA: other kernel libraries)",
    "fused_chain_verify": "SGLANG_OPT_FUSED_KDA_VERIFY=1 (off by default): fused_kda_conv_gating_verify replaces "
                          "the verify's conv + recurrence",
    "fused_decode": "kda_fused_decode (sglang's second KDA JIT module): reached only by layers that hand the backend "
                    "their o_norm weights (Kimi K3's _k3_fused_decode_args); Kimi-Linear's layer never does",
}


def geometry(s: SglangSpec) -> list[tuple[str, object, str]]:
    """(name, value, where a live server shows it) of each pool dimension or stride the plan derives from the spec
    and the kernels take as a constexpr (or as an int they specialize on)."""
    h, K, V = s.heads, s.head_k_dim, s.head_v_dim
    channels, window = 2 * h * K + h * V, s.conv_kernel - 1
    pool = "model_runner.req_to_token_pool.mamba_pool.mamba_cache"
    rows = [("spec.sglang.mamba_pool_slots", s.mamba_pool_slots,
             f"{pool}.conv[0].shape[1] (--max-mamba-cache-size + 1; the log line 'Mamba Cache is allocated. "
             f"max_mamba_cache_size: N' says N): the conv kernels' num_cache_lines"),
            ("conv pool slot stride", window * channels,
             f"{pool}.conv[0][layer].stride(0) ((kernel - 1) x 2hK + hV; KDA keeps the window first): "
             f"stride_istate_seq / stride_conv_state_seq"),
            ("state pool slot stride", h * V * K, f"{pool}.temporal[layer].stride(0): the KDA kernels' state stride")]
    rows += [(f"verify conv window slot stride, draft {d}", d * window * channels,
              f"{pool}.intermediate_conv_window[0][layer].stride(0) with --speculative-num-draft-tokens {d}, chain "
              f"or tree (KDA keeps a dense [kernel - 1, channels] window per draft step: {window * channels}, the "
              f"conv update's stride_inter_step): the conv update's stride_inter_seq") for d in s.draft_widths]
    return rows


def run(spec: dict, device: str = "cuda") -> None:
    """The same calls on real tensors on ``device`` (a ``--mode device`` build): compiles and autotunes what the
    server would; sglang's CUDA JIT packed decode is skipped (prewarm cannot keep it)."""
    import torch

    from .common import jit_skipped

    s = read_spec(spec)
    _import_sglang()
    with published_parallel(s), jit_skipped():
        for _, call in _calls(s, device):
            call()
    getattr(torch, s.device).synchronize()


def _import_sglang():
    try:
        from sglang.srt.layers.attention.linear.kernels import kda_triton  # noqa: F401
    except ImportError as e:
        raise ValueError(f"sglang's KDA kernels are not importable ({e}): install sglang (the same version as the "
                         f"nodes run)") from e


def _calls(s: SglangSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) for every call of the envelope, tensors on ``device`` (fake inside ``fake_device``): the
    kernel class's calls (:class:`_Builder`), then the backend's own forward paths around them (:class:`_Layer`)."""
    for combo in s.dtype_combos():
        builder = _Builder(s, device, combo)
        for path in s.paths:
            yield from getattr(builder, path)()
    for combo in s.dtype_combos():
        for tree in (False, True) if s.eagle_tree and s.draft_widths else (False,):
            for draft in s.draft_widths or (0,):
                layer = _Layer(s, device, combo, draft, tree)
                for path, reaches in LAYER_PATHS.items():
                    if set(reaches) & set(s.paths):
                        yield from getattr(layer, path)()


class _Builder(TensorCache):
    """The tensors of one dtype combination, laid out as sglang's backend and model hand them over (each made once:
    a fake op costs about a millisecond), and the calls over them."""

    def __init__(self, s: SglangSpec, device: str, combo: dict):
        import torch

        self.s, self.device, self.combo = s, device, combo
        self.tag = ",".join(f"{role}={name}" for role, name in combo.items())
        self.dt = {role: getattr(torch, name) for role, name in combo.items()}
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        self.slots = s.max_batch + 1  # sglang's pool: one slot per running request + the padding slot
        self.pool = self.zeros(self.slots, h, V, K, dtype=self.dt["state"])
        self.A_log = self.zeros(1, 1, h, 1, dtype=self.dt["gate_params"])  # the layer's parameter, as the model has it
        self.dt_bias = self.zeros(h * K, dtype=self.dt["gate_params"])
        self.kernel = _kernel()

    def index(self, values: tuple):
        return self.once(("index", values), lambda: index_tensor(list(values), self.dt["index"], self.device))

    def conv_output(self, tokens: int):
        """The causal conv's output ``[T, 2hK + hV]`` (contiguous) and q, k, v ``[1, T, h, d]`` as the backend
        views it."""
        def make():
            h, K, V = self.s.heads, self.s.head_k_dim, self.s.head_v_dim
            qkv = self.zeros(tokens, 2 * h * K + h * V, dtype=self.dt["activation"])
            q, k, v = qkv.split([h * K, h * K, h * V], dim=-1)
            return qkv, *(t.unflatten(-1, (h, -1)).unsqueeze(0) for t in (q, k, v))

        return self.once(("qkv", tokens), make)

    def gate(self, tokens: int, per_head: bool = False):
        """The forget gate ``[T, hK]`` as the model hands it over (a contiguous slice of its batched projection);
        ``per_head``: ``[1, T, h, K]``, as forward_extend views it."""
        def make():
            g = self.zeros(tokens, self.s.heads * self.s.head_k_dim, dtype=self.dt["gate"])
            return g.unflatten(-1, (self.s.heads, -1)).unsqueeze(0) if per_head else g

        return self.once(("gate", tokens, per_head), make)

    def beta(self, tokens: int, row: int):
        """Raw beta ``[1, T, h]``: row ``h`` is its own tensor, a wider row a (16-byte aligned, as sglang's are) view
        of a fused projection."""
        return self.once(("beta", tokens, row), lambda: self.zeros(tokens, row, dtype=self.dt["beta"])
                         .narrow(1, 0, self.s.heads).unsqueeze(0))

    # --- the paths --------------------------------------------------------------------------------------------

    def extend(self):
        s = self.s
        h, K = s.heads, s.head_k_dim
        for layout_name, lengths in prefill_layouts(h, s.max_prefill_tokens, s.max_batch):
            T, seqs = sum(lengths), len(lengths)
            cu = tuple(itertools.accumulate(lengths, initial=0))
            for beta_name, beta_args in self._extend_betas(T):
                for gate_name, gate_args in self._extend_gates(T):
                    for track in (False, True) if s.track_state else (False,):
                        def call(seqs=seqs, cu=cu, T=T, beta_args=beta_args, gate_args=gate_args, track=track):
                            _, q, k, v = self.conv_output(T)
                            extra = {}
                            if track:  # kda_backend: an fp32 snapshot row per tracked sequence, its chunk index
                                extra = dict(track_state=self.once(("track", seqs), lambda: self.zeros(
                                    seqs, h, s.head_v_dim, K, dtype=_fp32())), track_chunk_idx=self.index((0,) * seqs))
                            return self.kernel.extend(
                                q, k, v, ssm_states=self.pool, cache_indices=self.index(tuple(range(1, seqs + 1))),
                                query_start_loc=self.index(cu), lower_bound=s.lower_bound,
                                return_intermediate_states=track, **gate_args(), **beta_args(), **extra)

                        yield (f"extend[{self.tag},{layout_name},beta_as={beta_name},gate_as={gate_name},"
                               f"track={track}]", call)

    def _extend_betas(self, T: int):
        """(name, kwargs thunk): raw beta at each row stride (sglang's call), and beta the caller sigmoided."""
        for row in self.s.beta_row_strides:
            yield f"raw/row{row}", lambda row=row: dict(beta=self.beta(T, row), beta_is_raw=True)
        yield "sigmoid", lambda: dict(beta=self.beta(T, self.s.heads), beta_is_raw=False)

    def _extend_gates(self, T: int):
        """(name, kwargs thunk): the raw gate with A_log and dt_bias (sglang's call), without dt_bias, and a gate the
        caller activated (``A_log=None``: chunk_kda only takes its chunk-local cumsum)."""
        g = lambda: self.gate(T, per_head=True)  # noqa: E731
        yield "raw", lambda: dict(g=g(), A_log=self.A_log, dt_bias=self.dt_bias)
        yield "raw-nobias", lambda: dict(g=g(), A_log=self.A_log, dt_bias=None)
        yield "activated", lambda: dict(g=g(), A_log=None, dt_bias=None)

    def packed_decode(self):
        s = self.s
        for row in s.beta_row_strides:
            for batch in batch_sizes(s.max_batch):
                def call(batch=batch, row=row):
                    return self.kernel.packed_decode(
                        self.conv_output(batch)[0], self.gate(batch), self.beta(batch, row), A_log=self.A_log,
                        dt_bias=self.dt_bias, scale=s.head_k_dim ** -0.5, ssm_states=self.pool,
                        cache_indices=self.index((1,) * batch), num_v_heads=s.heads, head_v_dim=s.head_v_dim,
                        lower_bound=s.lower_bound)

                yield f"packed_decode[{self.tag},beta_row={row},B={batch}]", call

    def decode(self):
        s = self.s
        for row in s.beta_row_strides:
            for batch in batch_sizes(s.max_batch):
                def call(batch=batch, row=row):
                    _, q, k, v = self.conv_output(batch)
                    return self.kernel.decode(
                        q, k, v, self.gate(batch), self.beta(batch, row), A_log=self.A_log, dt_bias=self.dt_bias,
                        ssm_states=self.pool, cache_indices=self.index((1,) * batch),
                        query_start_loc=self.index(tuple(range(batch + 1))), lower_bound=s.lower_bound)

                yield f"decode[{self.tag},beta_row={row},B={batch}]", call

    def target_verify(self):
        s = self.s
        for width in s.draft_widths:
            for tree in (False, True) if s.eagle_tree else (False,):
                for row in s.beta_row_strides:
                    for batch, tokens in verify_token_counts(s.max_batch, width):
                        yield (f"target_verify[{self.tag},draft={width},tree={tree},beta_row={row},B={batch},"
                               f"T={tokens}]", lambda b=batch, t=tokens, w=width, tr=tree, r=row:
                               self._verify(b, t, w, w, tr, r))
                # adaptive speculation: the scratch keeps the largest width's pitch (cache_steps: an int class)
                if width != s.draft_widths[-1]:
                    yield (f"target_verify[{self.tag},draft={width},pitch={s.draft_widths[-1]},tree={tree}]",
                           lambda w=width, tr=tree: self._verify(1, w, w, s.draft_widths[-1], tr, s.heads))

    def _verify(self, batch: int, tokens: int, width: int, pitch: int, tree: bool, row: int):
        """kda_backend._forward_target_verify's call: dense (tokens = batch x width, query_start_loc in steps of the
        width) or ragged (one token per request here); the speculative scratch ``[slots + 1, pitch, h, V, K]``."""
        import torch

        s = self.s
        _, q, k, v = self.conv_output(tokens)
        cu = tuple(range(0, tokens + 1, width)) if tokens == batch * width else (*range(batch), tokens)
        scratch = self.once(("scratch", pitch), lambda: self.zeros(self.slots + 1, pitch, s.heads, s.head_v_dim,
                                                                   s.head_k_dim, dtype=self.dt["state"]))
        parent = self.once(("parent", batch, width), lambda: torch.zeros(batch, width, dtype=torch.int64,
                                                                         device=self.device)) if tree else None
        return self.kernel.target_verify(
            self.A_log, self.dt_bias, q, k, v, self.gate(tokens), self.beta(tokens, row), ssm_states=self.pool,
            cache_indices=self.index((1,) * batch), query_start_loc=self.index(cu), intermediate_states_buffer=scratch,
            intermediate_state_indices=self.index(tuple(range(batch))), cache_steps=width,
            retrieve_parent_token=parent, lower_bound=s.lower_bound)


class _Layer(TensorCache):
    """One rank's last KDA layer as sglang 0.5.23 serves it on CUDA, for one dtype combination, one draft width and
    one verify shape (chain or tree: the backend's topk and retrieve tables): ``KDAAttnBackend``
    (``kda_backend.py``) made without its constructor (which reads the server's published configuration) and given
    the attributes the constructors of ``MambaAttnBackendBase`` and ``KDAAttnBackend`` set with the Triton kernels
    (``--linear-attn-backend triton``), the hybrid backend around it (the state commit after a verify), the mamba pool
    as ``MambaPool`` lays it out on CUDA (:class:`_Pool`), the layer object (``RadixLinearAttention``) and the
    layer's ``o_norm`` (``FusedRMSNormGated``, Kimi-Linear's ``KimiDeltaAttention``). Each forward gets the
    ``ForwardMetadata`` the hybrid backend's ``_forward_metadata`` builds for the batch and the inputs Kimi-Linear's
    projections hand over (:meth:`inputs`)."""

    def __init__(self, s: SglangSpec, device: str, combo: dict, draft: int, tree: bool):
        import torch

        from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

        self.s, self.device, self.draft, self.tree = s, device, draft, tree
        self.tag = ",".join([f"{role}={name}" for role, name in combo.items()] + [f"draft={draft}", f"tree={tree}"])
        self.dt = {role: getattr(torch, name) for role, name in combo.items()}
        h, K, V = s.heads, s.head_k_dim, s.head_v_dim
        self.channels = 2 * h * K + h * V  # the conv's q | k | v
        self.pool = _Pool.allocate(self, draft)
        self.layer = RadixLinearAttention(
            layer_id=s.layers - 1, num_q_heads=h, num_k_heads=h, num_v_heads=h, head_q_dim=K, head_k_dim=K,
            head_v_dim=V, conv_weights=self.zeros(self.channels, s.conv_kernel, dtype=torch.float32), bias=None,
            A_log=self.zeros(1, 1, h, 1, dtype=self.dt["gate_params"]),
            dt_bias=self.zeros(h * K, dtype=self.dt["gate_params"]), lower_bound=s.lower_bound)
        self.o_norm = FusedRMSNormGated(V, eps=1e-5, activation="sigmoid", device=device,
                                        dtype=self.dt["activation"])
        self.backend = _backend(self.pool, device, topk=2 if tree else 1)
        self.first = draft == (s.draft_widths or (0,))[0] and not tree  # extend and decode: one pool stands for all

    def index(self, values, dtype=None):
        return index_tensor(list(values), dtype or self.dt["index"], self.device)

    def inputs(self, tokens: int, per_head_gate: bool):
        """(beta row, mixed_qkv, a, b) as Kimi-Linear's ``forward`` hands them to the backend, for each beta row
        stride: beta as its own projection's output (row = heads) or a column slice of the fused
        ``q | k | v | beta | f_a | g_a`` projection, mixed_qkv then the slice before it (its rows strided alike);
        the forget gate out of the batched f_b/g_b matmul (``[T, hK]``; ``[1, T, h, K]`` in extend)."""
        s = self.s
        h, K = s.heads, s.head_k_dim
        qkv_width = self.channels
        a = self.zeros(2, tokens, h * K, dtype=self.dt["gate"])[0]
        if per_head_gate:
            a = a.unflatten(-1, (h, K)).unsqueeze(0)
        for row in s.beta_row_strides:
            if row >= qkv_width + h:  # the fused projection: q/k/v and beta are column slices of one row
                mixed = self.zeros(tokens, row, dtype=self.dt["activation"]).narrow(1, 0, qkv_width)
                b = self.zeros(tokens, row, dtype=self.dt["beta"]).narrow(1, qkv_width, h)
            else:
                mixed = self.zeros(tokens, qkv_width, dtype=self.dt["activation"])
                b = self.zeros(tokens, row, dtype=self.dt["beta"]).narrow(1, 0, h)
            yield row, mixed, a, b.unsqueeze(0)

    def output(self, core, tokens: int):
        """The layer's ``o_norm(core_attn_out, g_proj_states.unflatten(-1, (-1, head_dim)))``: the gate out of the
        batched f_b/g_b matmul."""
        import torch

        g = self.zeros(2, tokens, self.s.heads * self.s.head_v_dim, dtype=self.dt["activation"])[1]
        with torch.no_grad():  # the server runs the model under inference mode
            self.o_norm(core, g.unflatten(-1, (-1, self.s.head_v_dim)))

    def metadata(self, lengths: list[int], **fields):
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        fields.setdefault("query_start_loc", self.index(itertools.accumulate(lengths, initial=0)))
        return ForwardMetadata(mamba_cache_indices=self.index(range(1, len(lengths) + 1)), **fields)

    # --- the paths --------------------------------------------------------------------------------------------

    def extend(self):
        """forward_extend (the conv over the packed prefill, chunk_kda, the prefix-cache snapshots) and o_norm, at
        each prefill layout, with and without prefix state (``has_initial_state``), with and without the radix
        cache's state tracking."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        if not self.first:
            return
        for layout_name, lengths in prefill_layouts(s.heads, s.max_prefill_tokens, s.max_batch) + \
                conv_layouts(s.max_prefill_tokens):
            for prefix in (False, True):
                for tracked in (False, True) if s.track_state else (False,):
                    def call(lengths=lengths, prefix=prefix, tracked=tracked):
                        T, n = sum(lengths), len(lengths)
                        for _, mixed, a, b in self.inputs(T, per_head_gate=True):
                            batch = _Batch(ForwardMode.EXTEND, n, extend_seq_lens_cpu=list(lengths),
                                           extend_prefix_lens=self.index([int(prefix)] * n),
                                           mamba_track_mask=self._mask(n) if tracked else None)
                            self.backend.forward_metadata = self.metadata(
                                lengths, logical_num_tokens=T, **(self._extend_track(lengths) if tracked else {}))
                            self.output(self.backend.forward_extend(self.layer, batch, mixed, a, b), T)

                    yield (f"layer.extend[{self.tag},{layout_name},prefix={prefix},track={tracked}]", call)

    def _extend_track(self, lengths: list[int]) -> dict:
        """The track fields ``_forward_metadata`` fills for an extend whose every sequence is tracked at an
        unaligned chunk boundary (``_init_track_conv_indices``, ``_init_track_ssm_indices``): the conv window rows,
        the chunk of each snapshot (int32), the int64 source and destination rows."""
        import torch

        n, window = len(lengths), self.s.conv_kernel - 1
        rows = lambda values: self.index(values, torch.int64)  # noqa: E731
        return dict(has_mamba_track_mask=True, mamba_track_indices=rows(range(n)),
                    mamba_track_mask_indices=rows(range(n)), conv_states_mask_indices=rows(range(n)),
                    track_conv_indices=self.zeros(n, window, dtype=torch.int64),
                    track_chunk_idx=self.index([(length - 1) // CHUNK for length in lengths], torch.int32),
                    track_ssm_h_src=rows(range(n)), track_ssm_h_dst=rows(range(n)),
                    track_ssm_h_batch_src=rows(range(n)), track_ssm_final_src=rows([]),
                    track_ssm_final_dst=rows([]))

    def decode(self):
        """forward_decode (the conv update, then packed decode without a gate lower bound or the recurrent decode
        with one), the radix cache's decode tracking (one all-layers launch at the last KDA layer) and o_norm."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        if not self.first:
            return
        for batch_size in batch_sizes(s.max_batch):
            for tracked in (False, True) if s.track_state else (False,):
                def call(batch_size=batch_size, tracked=tracked):
                    for _, mixed, a, b in self.inputs(batch_size, per_head_gate=False):
                        batch = _Batch(ForwardMode.DECODE, batch_size,
                                       mamba_track_mask=self._mask(batch_size) if tracked else None)
                        self.backend.forward_metadata = self.metadata(
                            [1] * batch_size, **(self._decode_track(batch_size) if tracked else {}))
                        self.output(self.backend.forward_decode(self.layer, batch, mixed, a, b), batch_size)

                yield f"layer.decode[{self.tag},B={batch_size},track={tracked}]", call

    def _decode_track(self, batch_size: int) -> dict:
        import torch

        return dict(mamba_track_indices=self.index(range(batch_size), torch.int64))

    def target_verify(self):
        """_forward_target_verify through forward_extend (the conv update with its per-step window scratch, the
        verify kernel; ragged layouts scattered to the dense one), o_norm, then the commit after the verify:
        ``fused_commit_track_indices`` (spec_utils) and the hybrid backend's ``update_mamba_state_after_mtp_verify``
        (the state and conv-window scatters), with and without the radix cache's tracking."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        if not self.draft:
            return
        width = self.draft
        hybrid = _hybrid(self.backend)
        for batch_size in batch_sizes(s.max_batch):
            for ragged in (False, True):
                def call(batch_size=batch_size, ragged=ragged):
                    import torch

                    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_commit_track_indices

                    lengths = [1 + i % width for i in range(batch_size)] if ragged else [width] * batch_size
                    tokens = sum(lengths)
                    cu = self.index(itertools.accumulate(lengths, initial=0))
                    layout = SimpleNamespace(qo_indptr_device=cu) if ragged else None
                    spec = SimpleNamespace(draft_token_num=width, ragged_verify_layout=layout)
                    extra = {}
                    if self.tree:  # EAGLE tree (topk > 1): the spec info's retrieve tables, and the parent table
                        # build_tree_kernel_efficient's: rows 1 and 2 of one int64 [3, bs, draft] buffer (row 1 is
                        # not 16-byte aligned where bs x draft is odd); the parent table its own (empty_like)
                        _, nxt, sibling = self.zeros(3, batch_size, width, dtype=torch.int64)
                        extra = dict(retrieve_next_token=nxt, retrieve_next_sibling=sibling,
                                     retrieve_parent_token=torch.empty_like(nxt))
                    for _, mixed, a, b in self.inputs(tokens, per_head_gate=False):
                        batch = _Batch(ForwardMode.TARGET_VERIFY, batch_size, spec_info=spec,
                                       req_pool_indices=self.index(range(batch_size), torch.int64))
                        self.backend.forward_metadata = self.metadata(
                            lengths, query_start_loc=cu, is_target_verify=True, draft_token_num=width, **extra)
                        self.output(self.backend.forward_extend(self.layer, batch, mixed, a, b), tokens)
                    accept_index = self.zeros(batch_size, width, dtype=torch.int32)
                    accept_lens = self.index(lengths, torch.int32)
                    for tracked in (False, True) if s.track_state else (False,):
                        seq_lens = self.zeros(batch_size, dtype=torch.int64) if tracked else None
                        steps, steps_to_track = fused_commit_track_indices(
                            accept_index, accept_lens, seq_lens, width, TRACK_INTERVAL if tracked else 0)
                        hybrid.update_mamba_state_after_mtp_verify(
                            last_correct_step_indices=steps, mamba_track_indices=self.index(
                                range(batch_size), torch.int64) if tracked else None,
                            mamba_steps_to_track=steps_to_track, model=None,
                            req_pool_indices=self.index(range(batch_size), torch.int64))

                yield f"layer.target_verify[{self.tag},B={batch_size},ragged={ragged}]", call

    def decode_graph(self):
        """The decode CUDA graph runner (``DecodeCudaGraphRunner``) at each ``--cuda-graph-bs`` bucket
        (:meth:`_graph`): forward_decode captured on the bucket's static metadata, then every replay's."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if self.first:
            yield from self._graph(ForwardMode.DECODE, 1, None)

    def verify_graph(self):
        """The target-verify CUDA graph runner (EAGLE's, ``--cuda-graph-bs`` buckets of ``draft`` tokens per request,
        chain or tree; :meth:`_graph`): the verify captured on the bucket's static metadata (the tree's retrieve
        tables are the backend's int32 per-bucket buffers), then every replay's."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if self.draft:
            spec = SimpleNamespace(draft_token_num=self.draft, ragged_verify_layout=None, retrieve_next_token=None)
            yield from self._graph(ForwardMode.TARGET_VERIFY, self.draft, spec)

    def _graph(self, mode, width: int, spec):
        """One graph runner over a backend of its own: the hybrid backend's ``init_cuda_graph_state(max_bs, max_bs *
        width)``, the runner's static int64 ``req_pool_indices`` / ``mamba_track_indices`` buffers, and per bucket
        (with and without the radix cache's tracking) the capture, ``init_forward_metadata_out_graph(in_capture=True)``
        and the layer's forward at the bucket's size, then ``init_forward_metadata_out_graph`` as each replay calls it
        (``build_replay_fb_view``: ``num_padding`` = bucket - requests, for :func:`replay_sizes`); the replay's
        ``_replay_metadata`` refreshes the captured slot table with ``fused_replay_state_indices``."""
        import torch

        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        if not s.graph_buckets:
            return
        backend = _backend(self.pool, self.device, topk=2 if self.tree else 1)
        hybrid, max_bs, state = _hybrid(backend), s.graph_buckets[-1], {}
        for bucket, requests in replay_sizes(s.graph_buckets):
            def call(bucket=bucket, requests=requests):
                if not state:  # the runner's buffers, made once
                    hybrid.init_cuda_graph_state(max_bs, max_bs * width)
                    state.update(rows=self.zeros(max_bs, dtype=torch.int64), track=self.zeros(max_bs,
                                                                                              dtype=torch.int64))
                for tracked in (False, True) if s.track_state else (False,):
                    view = SimpleNamespace(batch_size=bucket, forward_mode=mode, spec_info=spec, seq_lens_cpu=None,
                                           req_pool_indices=state["rows"][:bucket], num_padding=0,
                                           mamba_track_indices=state["track"][:bucket] if tracked else None)
                    hybrid.init_forward_metadata_out_graph(view, in_capture=True)
                    tokens = bucket * width
                    for _, mixed, a, b in self.inputs(tokens, per_head_gate=False):
                        if mode == ForwardMode.DECODE:
                            batch = _Batch(mode, bucket, mamba_track_mask=self._mask(bucket) if tracked else None)
                            core = backend.forward_decode(self.layer, batch, mixed, a, b)
                        else:
                            batch = _Batch(mode, bucket, spec_info=spec, req_pool_indices=view.req_pool_indices)
                            core = backend.forward_extend(self.layer, batch, mixed, a, b)
                        self.output(core, tokens)
                    for padded in sorted({bucket - r for r in requests}):
                        view.num_padding = padded
                        hybrid.init_forward_metadata_out_graph(view)

            yield f"layer.{mode.name.lower()}_graph[{self.tag},bucket={bucket}]", call

    def runner(self):
        """The model runner's own kernels for an extend batch around the layer: ``ForwardBatch.init_new``'s extend
        positions (``compute_position`` -> ``sglang.kernels.ops.attention.position.compute_position_triton``, int32
        prefix and extend lengths) and, before the layers read the pool, ``ModelRunner._maybe_execute_deferred_mamba_
        cow_and_clear``: ``MambaPool.clear_slots`` (fresh requests) and ``copy_from`` (a radix hit's copy-on-write)
        through ``sglang.srt.mem_cache.mamba_slot_fused`` on the pool's conv tensors (where sglang fuses them: a
        contiguous bf16 conv pool), with the copy ``MambaPool.__init__`` warms."""
        import torch

        from sglang.kernels.ops.attention.position import compute_position_triton
        from sglang.srt.mem_cache import mamba_slot_fused

        if not self.first:
            return
        lengths = [1, CHUNK + 3]

        def positions():
            compute_position_triton(self.index([0, CHUNK], torch.int32), self.index(lengths, torch.int32),
                                    sum(lengths))

        yield f"runner.extend_positions[{self.tag}]", positions
        conv = self.pool.mamba_pool.mamba_cache.conv
        if conv[0].dtype != torch.bfloat16:  # MambaPool._conv_fuse_ok: other conv dtypes take index_fill_ / copies
            return
        slots = lambda n, first: self.index(range(first, first + n), torch.int64)  # noqa: E731
        desc = lambda: mamba_slot_fused.build_conv_slot_descriptor(conv)  # noqa: E731
        yield (f"runner.mamba_slot_warmup[{self.tag}]",
               lambda: mamba_slot_fused.warmup_fused_copy_conv_slots(desc()))
        yield (f"runner.mamba_slot_clear[{self.tag}]",
               lambda: mamba_slot_fused.fused_clear_conv_slots(desc(), slots(2, 1)))
        yield (f"runner.mamba_slot_copy[{self.tag}]",
               lambda: mamba_slot_fused.fused_copy_conv_slots(desc(), slots(2, 1), slots(2, 3)))

    def verify_commit(self):
        """The EAGLE worker's commit outputs after a verify (``eagle_worker_common``: ``prepare_verify_commit_outputs``
        of ``sglang.kernels.ops.speculative.eagle`` over ``eagle_sample``'s int32 predict / accept index / accept
        lengths and the batch's int64 seq_lens): a chain (topk 1) at its draft width, with and without the radix
        cache's track interval; a tree (topk > 1) at each accept-index depth (``--speculative-num-steps`` + 1) up to
        the draft width."""
        import torch

        from sglang.kernels.ops.speculative.eagle import prepare_verify_commit_outputs

        if not self.draft:
            return
        width, batch = self.draft, self.s.max_batch
        seq_lens = lambda: self.zeros(batch, dtype=torch.int64)  # noqa: E731
        outputs = lambda depth: (self.zeros(batch * width, dtype=torch.int32),  # noqa: E731
                                 self.zeros(batch, depth, dtype=torch.int32), self.zeros(batch, dtype=torch.int32))
        if self.tree:
            for depth in range(2, width + 1):
                yield (f"eagle.verify_commit[{self.tag},depth={depth}]",
                       lambda depth=depth: prepare_verify_commit_outputs(*outputs(depth), seq_lens()))
            return
        for tracked in (False, True) if self.s.track_state else (False,):
            yield (f"eagle.verify_commit[{self.tag},track={tracked}]",
                   lambda tracked=tracked: prepare_verify_commit_outputs(
                       *outputs(width), seq_lens(), num_draft_tokens=width,
                       mamba_track_interval=TRACK_INTERVAL if tracked else 0))

    def _mask(self, batch_size: int):
        import torch

        return torch.ones(batch_size, dtype=torch.bool, device=self.device)


@dataclass
class _Batch(Batch):
    """:class:`~.common.Batch` and the request pool indices (read on CUDA)."""

    req_pool_indices: Any = None


@dataclass
class _Pool(MambaPoolView):
    """sglang's hybrid request pool as the KDA backend reads it, laid out as 0.5.23's ``MambaPool`` allocates it on
    CUDA (``mem_cache/memory_pool.py``): conv ``[layers, slots, kernel - 1, channels]`` (KDA keeps the window first)
    in the activation dtype, temporal ``[layers, slots, H, V, K]`` in the state dtype (``slots`` =
    ``spec.sglang.mamba_pool_slots``: the pool's size + its padding slot, which the conv kernels take as the
    constexpr ``num_cache_lines``), and with speculation the verify scratch ``[layers, requests + 1, draft, H, V,
    K]`` and the per-step conv windows, dense ``[layers, requests + 1, draft, kernel - 1, channels]`` for a linear
    draft chain and an EAGLE tree alike: ``MambaPool`` deduplicates the windows only where
    ``conv_window_dedup_enabled`` allows it, never for KDA (``KimiLinearCacheParams.is_kda``; its
    ``KimiLinearStateShape`` also sets ``disable_conv_window_dedup``), whose backend transposes the window before the
    conv ("the deduplicated overlapping layout cannot be transposed", ``kda_backend._forward_target_verify``)."""

    size: int  # requests (the scratch rows, the verify index table)
    conv: Any
    temporal: Any
    intermediate_ssm: Any = None
    intermediate_conv_window: Any = None
    mamba_map: dict = field(default_factory=dict)
    # the side pools the commit also rolls back (short-conv and n-gram models'): none in a KDA model
    short_conv_pool: Any = field(default_factory=lambda: SimpleNamespace(conv_state=None,
                                                                         intermediate_conv_state=None))
    ngram_pool: Any = field(default_factory=lambda: SimpleNamespace(context=None, intermediate_context=None))

    @classmethod
    def allocate(cls, layer: "_Layer", draft: int) -> "_Pool":
        import torch

        s, dt = layer.s, layer.dt
        h, K, V, L = s.heads, s.head_k_dim, s.head_v_dim, s.layers
        window = s.conv_kernel - 1
        requests = s.max_batch
        pool = cls(size=requests, mamba_map={i: i for i in range(L)},
                   mapping=layer.zeros(requests + 1, dtype=torch.int32),
                   conv=layer.zeros(L, s.mamba_pool_slots, window, layer.channels, dtype=dt["activation"]),
                   temporal=layer.zeros(L, s.mamba_pool_slots, h, V, K, dtype=dt["state"]))
        if draft:
            pool.intermediate_ssm = layer.zeros(L, requests + 1, draft, h, V, K, dtype=dt["state"])
            pool.intermediate_conv_window = layer.zeros(L, requests + 1, draft, window, layer.channels,
                                                        dtype=dt["activation"])
        return pool

    def _cache_extras(self, pick) -> dict:
        return {"intermediate_conv_window": [pick(self.intermediate_conv_window)]}

    def translate_mamba_indices(self, mamba_indices):
        """Virtual to physical slots: the identity, as for sglang's pool outside unified memory."""
        return mamba_indices

    # HybridReqToTokenPool's request -> mamba slot table (int32, one row per request slot) and its virtual ->
    # physical table (None: the static pool's slots are physical); the graph replay gathers through them
    mapping: Any = None
    mamba_v2p_table: Any = None

    @property
    def req_index_to_mamba_index_mapping(self):
        return self.mapping

    def get_mamba_indices(self, req_indices):
        return self.mapping[req_indices]


def _backend(pool: _Pool, device: str, topk: int):
    """``KDAAttnBackend`` with the attributes its constructors set for ``--linear-attn-backend triton`` (every
    mode's kernel ``TritonKDAKernel``; no fused-accept pool: that is FlashInfer verify's); the constructors read
    the server's published configuration (``runtime_context``), which exists only in a running server."""
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend, KDAKernelDispatcher
    from sglang.srt.layers.attention.linear.utils import (
        LinearAttnKernelBackend,
        build_verify_intermediate_state_indices,
    )

    backend = KDAAttnBackend.__new__(KDAAttnBackend)
    triton_backend = LinearAttnKernelBackend.TRITON
    backend.__dict__.update(
        pad_slot_id=-1, device=device, topk=topk, is_draft_worker=False, req_to_token_pool=pool,
        token_to_kv_pool=None, enable_unified_memory=False, forward_metadata=None, _mamba_chunk_size=None,
        kernel_dispatcher=KDAKernelDispatcher(triton_backend, triton_backend, triton_backend),
        verify_intermediate_state_indices=build_verify_intermediate_state_indices(pool.size, device),
        _fused_chain_verify_fn=None, accept_lens_pool=None, prefill_graph_metadata=None,
        # the CUDA-graph state MambaAttnBackendBase.__init__ starts empty (init_cuda_graph_state fills it); on CUDA
        # with the static HybridReqToTokenPool (identity translate) the replay takes fused_replay_state_indices
        state_indices_list=[], query_start_loc_list=[], retrieve_next_token_list=[], retrieve_next_sibling_list=[],
        retrieve_parent_token_list=[], mamba_track_indices_buf=None, replayssm_write_pos_list=None,
        replayssm_force_flush_list=None, cached_cuda_graph_decode_query_start_loc=None,
        cached_cuda_graph_verify_query_start_loc=None, _graph_seq_len_fill_value=1,
        _fused_state_indices_ok=device == "cuda")
    backend.conv_states_shape = pool.conv[0].transpose(-1, -2).shape  # KDAAttnBackend.__init__: [.., dim, window]
    return backend


def _hybrid(linear_backend):
    """``HybridLinearAttnBackend`` around ``linear_backend`` (its full-attention half is not KDA's)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    return hybrid_backend(HybridLinearAttnBackend, linear_backend)


def _kernel():
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

    return TritonKDAKernel()


def _fp32():
    import torch

    return torch.float32


def _kernel_name(launch) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(launch.kernel).fn.__name__

