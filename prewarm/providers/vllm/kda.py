"""vLLM's own KDA kernels as its Kimi-Linear layer calls them: ``provider = "prewarm.providers.vllm.kda"``.

vLLM (0.34.0) serves Kimi-Linear's KDA layers (``KimiGatedDeltaNetAttention``,
``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py``) with its own copy of the kernels
(``vllm/models/kimi_k3/nvidia/ops/third_party/kda/`` and the fla copy under
``vllm/third_party/flash_linear_attention``). That layer always takes the Triton prefill (it refuses any other
``kda_prefill_backend``; FlashKDA, the C++ prefill, is Kimi-K3's full-rank-gate layer only,
``vllm/models/kimi_k3/nvidia/kda.py``). Its three calls, planned here:

- ``prefill``: ``chunk_kda_with_fused_gate`` (raw gate and beta, ``A_log``, ``g_bias`` = dt_bias, the model's
  ``lower_bound``, q/k L2-normalised in-kernel, the gathered initial states, ``cu_seqlens`` = the non-spec
  ``query_start_loc``) over packed layouts standing for every token count class (T and N are int arguments where not
  ``do_not_specialize``; l2norm's row count M = T x heads is).
- ``decode``: ``fused_recurrent_kda_packed_decode`` (the conv output ``[B, 3hK]``, the state pool by slot index) at
  each batch size class of 1..max batch.
- ``spec_verify``: ``fused_recurrent_kda`` with ``ssm_state_indices`` ``[requests, 1 + num_spec]`` and
  ``num_accepted_tokens`` (the spec-decode path): its launch config follows heads x requests (<= 48 / 96 / 192), the
  index table's row stride (the verify width) is a constexpr.

Layouts as the layer hands them over: q/k/v views of the conv output (row stride 3hK), the gate ``[1, T, h, K]``,
raw beta a view of the fused projection (row ``3hK + h + K``, Kimi-Linear's q/k/v/beta/f_a row per rank) or, in a
batch that mixes spec and non-spec requests, an ``index_select`` copy (row ``h``); the recurrent state pool
``[slots, h, V, K]`` at its slot stride (a constexpr of both recurrent kernels: vLLM's hybrid page layout pads
a slot; ``spec.vllm.state_slot_strides``).

Index pointers (``cu_seqlens``, the state indices, ``num_accepted_tokens``) each take their own dtype: every
combination of ``spec.dtypes.index`` per pointer is planned (vLLM builds them int32; a caller may hand int64).

The layer itself is driven too (:mod:`prewarm.providers.vllm.layer`): ``KimiGatedDeltaNetAttention.forward`` with
its state pool bound and its metadata filled as vLLM's runner and builder do, so every kernel it launches around
these three is planned (the causal conv, prefill and update; the gathered and scattered states; the gated RMSNorm
``o_norm``) with the layouts the layer hands over. The entry points are also planned over the API's wider envelope
(each index dtype per pointer, the beta layouts) for callers other than the layer.

The model around the layer, one module per component, where ``[spec.vllm]`` gives its widths: ``moe``
(:mod:`prewarm.providers.vllm.moe`: the MoE's ``fused_moe_kernel`` at every config vLLM's lookup picks over the step's
token counts), ``runner`` (:mod:`prewarm.providers.vllm.runner`: the V2 model runner's input preparation, block tables
and slot mappings, the Gumbel sampler, the rejection sampler), ``staged`` (:mod:`.staged`: the runner's staged writes of
the request state and block tables), ``mamba`` (:mod:`.mamba`: the hybrid model state's accepted counts and, under
prefix caching, its state pre-copy, aligned indices and post-copy) and ``speculator`` (:mod:`.speculator`: the MTP
drafter's input preparation and greedy draft sampling), ``sampler_options`` (:mod:`.sampler_options`: the sampler on
requests' options: logit bias, bad words, logprobs, the Triton top-k / top-p). Each launch's label starts with its
component (``kda/``, ``moe/``, ``runner/``, ``sampler/``, ``rejection_sampler/``, ``staged/``, ``mamba/``,
``speculator/``, ``sampler_options/``); :func:`coverage`
says per component what is planned and what the model reaches that is not, with why.

Not planned (another kernel library): Kimi-K3's FlashKDA / FlashInfer / native fused decode, RecoverSSM.
:func:`options` lists what is narrowed and the server geometry planned with; ``prewarm plan`` prints both.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from prewarm_kernels.spec import INDEX_DTYPES, SpecError

from ..capture import TensorCache, batch_sizes, fake_tensors, index_tensor, launches_of
from ..kdaspec import read_server_kda

KDA = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
PATHS = ("prefill", "decode", "spec_verify")
ROLES = ("activation", "gate", "beta", "gate_params", "state")  # [spec.dtypes] roles crossed; index is per pointer
# the index pointers of each path's call, each planned over every index dtype independently
INDEX_POINTERS = {"prefill": ("cu_seqlens",), "decode": ("state_indices",),
                  "spec_verify": ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens")}
HEAD_SEQUENCE_BOUNDS = (48, 96, 192)  # fused_recurrent_kda_fwd's launch config switches at heads x requests
# The kernels the Kimi-Linear layer launches on the H200 (module:kernel), for the coverage hook
LAYER_KERNELS = [f"{KDA}.chunk:{k}" for k in ("chunk_gla_fwd_kernel_o", "kda_gate_chunk_cumsum_vector_kernel",
                                                "recompute_w_u_fwd_kernel")] + [
    f"{KDA}.chunk_intra:chunk_kda_fwd_kernel_inter_solve_fused",
    f"{KDA}.chunk_intra_token_parallel:chunk_kda_fwd_kernel_intra_token_parallel",
    f"{KDA}.fused_recurrent:fused_recurrent_kda_fwd_kernel",
    f"{KDA}.fused_recurrent:fused_recurrent_kda_packed_decode_kernel",
    f"{FLA_OPS}.chunk_delta_h:chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    f"{FLA_OPS}.kda:layer_norm_gated_fwd_kernel", f"{FLA_OPS}.l2norm:l2norm_fwd_kernel2",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d:_causal_conv1d_fwd_kernel",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d:_causal_conv1d_update_kernel",
    "vllm.model_executor.layers.mamba.ops.gather_initial_states:_gather_initial_states_kernel",
    "vllm.model_executor.layers.mamba.ops.scatter_states:_scatter_states_kernel"]
# Every parameter of the entry points vLLM's Kimi-Linear layer calls, and how the plan covers it (tests/test_vllm.py
# reads the installed vLLM's signatures and fails on a parameter this table does not account for)
LAYER_DEFAULT = "the default: the layer never passes it"
API = {
    "chunk_kda_with_fused_gate": {
        "q": "spec.dtypes.activation (l2norm makes a contiguous copy)", "k": "as q",
        "v": "spec.dtypes.activation (made contiguous)", "raw_g": "spec.dtypes.gate (made contiguous)",
        "raw_beta": "spec.dtypes.beta at each spec.vllm.beta_row_strides", "A_log": "spec.dtypes.gate_params",
        "g_bias": "spec.dtypes.gate_params (the layer's dt_bias, always given)", "scale": LAYER_DEFAULT,
        "initial_state": "spec.dtypes.state (the gathered states, contiguous)",
        "output_final_state": "true (the layer scatters the final states)",
        "lower_bound": "spec.model.gate_lower_bound", "use_qk_l2norm_in_kernel": "true (the layer's)",
        "cu_seqlens": "each index dtype; prefill_layouts' token counts", "out": LAYER_DEFAULT,
        "kwargs": "unused by vLLM"},
    "fused_recurrent_kda_packed_decode": {
        "mixed_qkv": "spec.dtypes.activation, the conv output [B, 3hK]", "raw_g": "spec.dtypes.gate",
        "raw_beta": "spec.dtypes.beta at each spec.vllm.beta_row_strides", "A_log": "spec.dtypes.gate_params",
        "dt_bias": "spec.dtypes.gate_params", "lower_bound": "spec.model.gate_lower_bound",
        "initial_state": "spec.dtypes.state at each spec.vllm.state_slot_strides",
        "state_indices": "each index dtype; batch_sizes()", "scale": LAYER_DEFAULT, "out": LAYER_DEFAULT},
    "fused_recurrent_kda": {
        "q": "spec.dtypes.activation, views of the conv output", "k": "as q", "v": "as q",
        "raw_g": "spec.dtypes.gate", "raw_beta": "spec.dtypes.beta at each spec.vllm.beta_row_strides",
        "A_log": "spec.dtypes.gate_params", "dt_bias": "spec.dtypes.gate_params",
        "lower_bound": "spec.model.gate_lower_bound",
        "initial_state": "spec.dtypes.state at each spec.vllm.state_slot_strides",
        "cu_seqlens": "each index dtype", "ssm_state_indices": "each index dtype, [requests, draft width]",
        "num_accepted_tokens": "each index dtype", "out": "None or a contiguous slice (the same layout)",
        "fuse_gate": LAYER_DEFAULT + " (the gate fused into the recurrent kernel)"},
}
MAX_PREFILL_TOKENS = 8192  # vLLM's max_num_batched_tokens when the spec gives none
VLLM_KEYS = ("paths", "beta_row_strides", "state_slot_strides")
# the model's other components' keys (prewarm.providers.vllm.moe, .runner): absent, the component is not planned
# (and .mamba: the attention block, the KDA layers' KV-cache groups; .speculator: the MTP drafter's width; .runner's
# optional max_logprobs: --max-logprobs, read by .sampler_options)
MODEL_KEYS = ("moe_experts", "moe_top_k", "moe_hidden_size", "moe_intermediate_size", "max_model_len", "vocab_size",
              "block_size", "mamba_groups", "draft_hidden_size", "max_logprobs")


@dataclass(frozen=True)
class VllmSpec:
    """The envelope of one vLLM Kimi-Linear deployment (one attention rank), as the provider reads it."""

    heads: int
    head_k_dim: int
    head_v_dim: int
    lower_bound: float | None
    dtypes: dict  # role (ROLES + "index") -> dtype names
    paths: tuple
    max_batch: int  # the largest decode batch (requests)
    draft_widths: tuple  # 1 + num_speculative_tokens
    max_prefill_tokens: int
    beta_row_strides: tuple
    state_slot_strides: tuple

    def dtype_combos(self) -> list[dict]:
        return [dict(zip(ROLES, combo)) for combo in itertools.product(*(self.dtypes[r] for r in ROLES))]

    def index_combos(self, path: str) -> list[dict]:
        """One dtype per index pointer of ``path``: every combination."""
        pointers = INDEX_POINTERS[path]
        return [dict(zip(pointers, c)) for c in itertools.product(self.dtypes["index"], repeat=len(pointers))]


def read_spec(spec: dict) -> VllmSpec:
    """The KDA serving spec (``read_kda``) plus ``[spec.vllm]``:

        paths = every path the layer reaches (PATHS)
        beta_row_strides = [heads, 3*heads*head_k_dim + heads + head_k_dim] (per rank)
        state_slot_strides = [heads*head_v_dim*head_k_dim]: the state pool's per-slot stride (elements; a dense
                             pool: vLLM's page holds the conv state too and is padded to the attention page, so
                             a deployment lists its own)

    The layer's geometry keys (:data:`prewarm.providers.vllm.layer.LAYER_KEYS`) are read by
    :func:`prewarm.providers.vllm.layer.geometries`. A bad value is a SpecError naming ``spec.<key>``."""
    from .layer import LAYER_KEYS

    read, table = read_server_kda(
        spec, "vllm", "vLLM", (None, "cuda"), "cuda ([target] backend): vLLM's KDA kernels for NVIDIA GPUs",
        {"qk_l2norm": "vLLM's Kimi-Linear layer always L2-normalises q and k in-kernel",
         "fused_gate": "vLLM's Kimi-Linear layer always hands the raw gate with A_log and dt_bias"})
    extra = {k: v for k, v in table.items() if k not in LAYER_KEYS + MODEL_KEYS}
    unknown = sorted(set(extra) - set(VLLM_KEYS))
    if unknown:
        raise SpecError(f"vllm.{unknown[0]}", extra[unknown[0]],
                        f"no such key (known: {', '.join(VLLM_KEYS + LAYER_KEYS + MODEL_KEYS)})")
    h, K, V = read["heads"], read["head_k_dim"], read["head_v_dim"]
    paths = extra.get("paths", [p for p in PATHS if p != "prefill" or read["prefill"]])
    if not isinstance(paths, list) or not paths or len(set(paths)) != len(paths) or any(p not in PATHS for p in paths):
        raise SpecError("vllm.paths", paths, f"a non-empty list of distinct paths out of {list(PATHS)}")
    lists = {}
    for key, default, least, why in (
            ("beta_row_strides", [h, 3 * h * K + h + K], h, "raw beta's per-token stride in each layout the layer "
             f"hands it over, each >= the heads per rank ({h})"),
            ("state_slot_strides", [h * V * K], h * V * K, "the recurrent state pool's per-slot stride in elements, "
             f"each >= heads x head_v_dim x head_k_dim ({h * V * K})")):
        value = extra.get(key, default)
        if not isinstance(value, list) or not value or len(set(value)) != len(value) or \
                any(not isinstance(r, int) or isinstance(r, bool) or r < least for r in value):
            raise SpecError(f"vllm.{key}", value, f"a non-empty list of distinct integers: {why}")
        lists[key] = tuple(value)
    max_batch = max([*read["decode_batch_buckets"], read["max_running_requests"] or 0])
    if any(p in paths for p in ("decode", "spec_verify")) and not max_batch:
        raise SpecError("serving.decode_batch_buckets", ..., "the decode batch sizes (or max_running_requests): "
                        "the decode and verify paths plan batches up to the largest")
    widths = tuple(sorted(d for d in read["draft_widths"] if d > 1))
    if "spec_verify" in paths and not widths:
        paths = [p for p in paths if p != "spec_verify"]  # no speculative decoding: the layer never verifies
    return VllmSpec(heads=h, head_k_dim=K, head_v_dim=V, lower_bound=read["gate_lower_bound"],
                    dtypes={r: read["dtypes"][r] for r in (*ROLES, "index")}, paths=tuple(paths),
                    max_batch=max(max_batch, 1), draft_widths=widths,
                    max_prefill_tokens=read["max_prefill_tokens"] or MAX_PREFILL_TOKENS, **lists)


def launches(spec: dict) -> list:
    """Every kernel launch vLLM's Kimi-Linear layer makes within ``spec``'s envelope, then (where ``[spec.vllm]``
    names them) the model's MoE and the model runner's kernels, on fake tensors (nothing runs). Each launch's label
    starts with its component (``kda/``, ``moe/``, ``runner/``, ``sampler/``, ``rejection_sampler/``)."""
    from . import runner

    s = read_spec(spec)
    _import_vllm()
    out = []
    with fake_cuda():
        for label, call in _component_calls(spec, s, "cuda"):
            for launch in launches_of(call):  # a view's unaligned pointer is kept (the plan encodes it)
                where = label  # the runner's step holds its sampler's and rejection sampler's launches too
                if label.startswith("runner/"):
                    where = f"{runner.component(_kernel_module(launch))}/{label.removeprefix('runner/')}"
                launch.label = f"{where}/{_kernel_name(launch)}"
                out.append(launch)
    return out


def run(spec: dict, device: str = "cuda") -> None:
    """The same calls on real tensors on ``device`` (a ``--mode device`` build): compiles and autotunes what the
    server would."""
    import torch

    s = read_spec(spec)
    _import_vllm()
    for _, call in _component_calls(spec, s, device):
        call()
    torch.cuda.synchronize()


def options(spec: dict) -> list[dict]:
    """Each axis of vLLM's KDA API this provider plans: its spec key, the values planned, every value vLLM accepts
    (None: any), whether the manifest set it; ``prewarm plan`` prints the narrowed ones."""
    from prewarm_kernels.spec import DTYPES

    s = read_spec(spec)
    given = {table: set(spec.get(table) or ()) if isinstance(spec.get(table), dict) else set()
             for table in ("dtypes", "vllm")}
    rows = [(f"dtypes.{role}", s.dtypes[role], list(INDEX_DTYPES if role == "index" else DTYPES))
            for role in (*ROLES, "index")]
    rows += [("vllm.paths", list(s.paths), list(PATHS)),
             ("vllm.beta_row_strides", list(s.beta_row_strides), None),
             ("vllm.state_slot_strides", list(s.state_slot_strides), None),
             ("vllm.recoverssm", [False], [False, True])]  # --use-kda-recoverssm: other kernels (not planned)
    from .layer import derived

    return [{"key": f"spec.{key}", "planned": planned, "accepted": accepted,
             "given": key.split(".")[1] in given.get(key.split(".")[0], set()),
             "narrowed": accepted is not None and planned != accepted} for key, planned, accepted in rows] + \
        derived(spec)


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Within the block tensors made on ``cuda`` are fake (a device profile answers the device's queries), and
    vLLM's chunk counting (``prepare_chunk_indices``, which reads ``cu_seqlens`` on the host) answers from
    :func:`prewarm.providers.capture.index_tensor` values with vLLM's own function on the CPU
    (:func:`prewarm.providers.capture.fake_tensors`)."""
    _import_vllm()
    with fake_tensors({"vllm.models.kimi_k3": f"{FLA_OPS}.index", FLA_OPS: f"{FLA_OPS}.index"}):
        yield


def prefill_layouts(max_tokens: int, max_seqs: int) -> list[tuple[str, list[int]]]:
    """(name, sequence lengths) of the packed prefills that stand for all: one token, an odd length, a multiple of
    16 (l2norm's row count M = T x heads is an int Triton specializes on 1 and divisibility by 16), several
    sequences, and the token budget whole."""
    layouts = [("T=1", [1]), ("T=17", [17]), ("T=64", [64]), ("N=3", [1, 16, 33])]
    layouts.append((f"T={max_tokens}", [max_tokens]))
    return [(n, lengths) for n, lengths in layouts if sum(lengths) <= max_tokens and len(lengths) <= max_seqs]


def verify_request_counts(heads: int, max_batch: int) -> list[int]:
    """Request counts that reach each of fused_recurrent_kda_fwd's launch configs (heads x requests <= 48, <= 96,
    <= 192, above), within 1..``max_batch``."""
    counts = {1, max_batch, *(b // heads for b in HEAD_SEQUENCE_BOUNDS), *(b // heads + 1 for b in
                                                                          HEAD_SEQUENCE_BOUNDS)}
    return sorted(c for c in counts if 1 <= c <= max_batch)


def _import_vllm():
    """Import vLLM's KDA package; vLLM decides at import whether Triton is there (an active GPU driver), so a
    first import outside the target's device profile leaves its placeholder, which cannot be planned with."""
    import importlib

    try:
        importlib.import_module(KDA)
    except ImportError as e:
        raise ValueError(f"vLLM's KDA kernels are not importable ({e}): install vLLM (the same version as the nodes "
                         f"run)") from e
    if not sys.modules["vllm.triton_utils"].HAS_TRITON:
        raise ValueError("vLLM was imported in this process where Triton had no active GPU driver (its triton is a "
                         "placeholder): plan in a fresh process, which imports vLLM under the target's device profile")


def model_components(spec: dict, s: VllmSpec):
    """(the MoE's spec or None, the runner's spec or None) from ``[spec.vllm]``'s model keys (:data:`MODEL_KEYS`)."""
    from . import moe, runner

    table = spec.get("vllm") or {}
    tp = (spec.get("parallel") or {}).get("tensor_parallel", 1)
    m = moe.read_spec(table, tp, s.dtypes["activation"][0], s.max_prefill_tokens)
    r = runner.read_spec(table, s.max_batch, s.max_prefill_tokens, max(s.draft_widths, default=1) - 1)
    return m, r


def _component_calls(spec: dict, s: VllmSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """Every component's calls, each label prefixed with its component."""
    from . import layer, moe, runner

    for label, call in _all_calls(spec, s, device):
        yield f"kda/{label}", call
    m, r = model_components(spec, s)
    if m is not None:
        for label, call in moe.calls(m, device):
            yield f"moe/{label}", call
    if r is not None:
        for label, call in runner.calls(r, device):
            yield f"runner/{label}", call
        # the hybrid's uniform page (the KDA state's, padded to the attention page): what the KV-block zeroer clears
        pages = sorted({g.page_bytes for g in layer.geometries(spec)[0]})
        for label, call in runner.zero_calls(pages, device):
            yield f"runner/{label}", call
        yield from _step_calls(spec, s, r, device)


def _step_calls(spec: dict, s: VllmSpec, r, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """The runner's staged writes and the hybrid model state's mamba bookkeeping (where ``[spec.vllm]`` gives the
    KV-cache groups), each label prefixed with its component."""
    from . import layer, mamba, speculator, staged

    mm = mamba.read_spec(spec.get("vllm") or {})
    # the KV-cache groups: the MLA group and the KDA groups (at least one: a hybrid model's fused writer)
    for label, call in staged.calls(r, 1 + (mm.groups if mm else 1), device):
        yield f"staged/{label}", call
    from . import sampler_options

    for label, call in sampler_options.calls(r, device):  # requests' sampling options (logit bias, logprobs ...)
        yield f"sampler_options/{label}", call
    if mm is not None:
        for g in layer.geometries(spec)[0]:
            for label, call in mamba.calls(mm, r, g, device):
                yield f"mamba/{label}", call
    d = speculator.read_spec(spec.get("vllm") or {}, s.dtypes["activation"][0])
    if d is not None and r.num_spec:
        for label, call in speculator.calls(d, r, device):
            yield f"speculator/{label}", call


def coverage(spec: dict) -> list[dict]:
    """Per model component, what this provider plans and what Kimi-Linear's model on vLLM reaches that it does not
    plan, with why (the per-component coverage hook)."""
    from . import mamba, moe, runner, sampler_options, speculator, staged

    s = read_spec(spec)
    m, r = model_components(spec, s)
    mm = mamba.read_spec(spec.get("vllm") or {})
    d = speculator.read_spec(spec.get("vllm") or {}, s.dtypes["activation"][0])
    kda = {"component": "kda", "planned": LAYER_KERNELS,
           "not_planned": [{"what": "Kimi-K3's FlashKDA / FlashInfer / native fused decode, RecoverSSM",
                            "why": "another kernel library or --use-kda-recoverssm: not Kimi-Linear's default path"}]}
    def absent(keys, what):
        return [{"what": what, "why": f"[spec.vllm] {'/'.join(keys)} absent: not planned"}]

    rows = [kda,
            {"component": "moe", "planned": moe.PLANNED if m else [],
             "not_planned": moe.NOT_PLANNED if m else absent(moe.KEYS, moe.PLANNED[0])},
            *({"component": name, "planned": runner.PLANNED[name] if r else [],
               "not_planned": runner.NOT_PLANNED[name] if r else absent(runner.KEYS, ", ".join(runner.PLANNED[name]))}
              for name in runner.PLANNED),
            {"component": "sampler_options", "planned": sampler_options.PLANNED if r else [],
             "not_planned": sampler_options.not_planned(r) if r else absent(runner.KEYS,
                                                                        ", ".join(sampler_options.PLANNED))},
            {"component": "staged", "planned": staged.PLANNED if r else [],
             "not_planned": staged.NOT_PLANNED if r else absent(runner.KEYS, staged.PLANNED[0])},
            {"component": "mamba", "planned": mamba.planned(mm) if r and mm else [],
             "not_planned": mamba.NOT_PLANNED if r and mm else absent(
                 (*runner.KEYS, *mamba.KEYS), ", ".join(mamba.PLANNED + mamba.ALIGN_PLANNED))},
            {"component": "speculator", "planned": speculator.PLANNED if r and d and r.num_spec else [],
             "not_planned": speculator.NOT_PLANNED if r and d and r.num_spec else absent(
                 (*runner.KEYS, "draft_hidden_size"), ", ".join(speculator.PLANNED))},
            {"component": "mla", "planned": [],
             "not_planned": [{"what": "the MLA layers (vllm.models.kimi_k3.nvidia.mla): attention, KV-cache writes, "
                                      "their metadata",
                              "why": "no Triton on this path: on SM90 vLLM ranks FLASH_ATTN_MLA first for MLA (FA3 "
                                     "decode, FlashAttention prefill), the key concat and cache insert are its fused "
                                     "CUDA epilogues, a long prefix's gather and merge_attn_states are CUDA ops for "
                                     "bf16 and a v_head_dim multiple of 8; Triton only off this path: "
                                     "fused_q_kv_rmsnorm (q_lora_rank set: Kimi-Linear's is null), the Triton merge "
                                     "(fp8 output or other head dims), ShardQ (sparse MLA), TRITON_MLA (no FA3)"}]},
            {"component": "dense_mlp", "planned": [],
             "not_planned": [{"what": "RMSNorm, silu_and_mul, the linear layers, the logits matmul",
                              "why": "vLLM's CUDA C ops and cuBLAS: no Triton compile"}]}]
    return rows


def _all_calls(spec: dict, s: VllmSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """The layer's forwards (every kernel it launches, as the server runs it), then the entry points called
    directly over the API's wider envelope (index dtypes, beta layouts a caller may hand over)."""
    from . import layer

    geometries, _ = layer.geometries(spec)
    yield from layer.layer_calls(geometries, s.paths, s.max_batch, s.max_prefill_tokens, device)
    yield from _calls(s, device)


def _calls(s: VllmSpec, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    for combo in s.dtype_combos():
        builder = _Builder(s, device, combo)
        for path in s.paths:
            for index in s.index_combos(path):
                yield from getattr(builder, path)(index)


class _Builder(TensorCache):
    """The tensors of one dtype combination, laid out as vLLM's Kimi-Linear layer hands them over, and its calls."""

    def __init__(self, s: VllmSpec, device: str, combo: dict):
        import torch

        self.s, self.device = s, device
        self.tag = ",".join(f"{role}={name}" for role, name in combo.items())
        self.dt = {role: getattr(torch, name) for role, name in combo.items()}
        h, K = s.heads, s.head_k_dim
        self.A_log = self.zeros(h, dtype=self.dt["gate_params"])
        self.dt_bias = self.zeros(h * K, dtype=self.dt["gate_params"])
        self.kda = sys.modules[KDA]

    def index(self, values: tuple, dtype: str):
        import torch

        return self.once(("index", values, dtype),
                         lambda: index_tensor(list(values), getattr(torch, dtype), self.device))

    def pool(self, slot_stride: int):
        """The recurrent state pool ``[slots, h, V, K]`` at ``slot_stride`` elements per slot."""
        s = self.s
        slots = s.max_batch + 1  # slot 0 is vLLM's null block

        def make():
            flat = self.zeros(slots * slot_stride, dtype=self.dt["state"])
            return flat.as_strided((slots, s.heads, s.head_v_dim, s.head_k_dim),
                                   (slot_stride, s.head_v_dim * s.head_k_dim, s.head_k_dim, 1))

        return self.once(("pool", slot_stride), make)

    def conv_output(self, tokens: int):
        """The conv output ``[T, 3hK]`` and q, k, v ``[1, T, h, K]`` views of it."""
        def make():
            h, K = self.s.heads, self.s.head_k_dim
            qkv = self.zeros(tokens, 3 * h * K, dtype=self.dt["activation"])
            return qkv, *(t.unflatten(-1, (h, K)).unsqueeze(0) for t in qkv.split(h * K, dim=-1))

        return self.once(("qkv", tokens), make)

    def gate(self, tokens: int):
        """g1: f_b_proj's output ``[T, hK]`` viewed ``[1, T, h, K]``."""
        return self.once(("gate", tokens), lambda: self.zeros(tokens, self.s.heads * self.s.head_k_dim,
                                                              dtype=self.dt["gate"])
                         .unflatten(-1, (self.s.heads, -1)).unsqueeze(0))

    def beta(self, tokens: int, row: int):
        """Raw beta ``[1, T, h]``: row ``h`` a copy of its own, a wider row a view of the fused projection."""
        return self.once(("beta", tokens, row), lambda: self.zeros(tokens, row, dtype=self.dt["beta"])
                         .narrow(1, 0, self.s.heads).unsqueeze(0))

    def prefill(self, index: dict):
        s = self.s
        for name, lengths in prefill_layouts(s.max_prefill_tokens, s.max_batch):
            T, seqs = sum(lengths), len(lengths)
            cu = tuple(itertools.accumulate(lengths, initial=0))
            for row in s.beta_row_strides:
                def call(T=T, seqs=seqs, cu=cu, row=row):
                    _, q, k, v = self.conv_output(T)
                    initial = self.once(("initial", seqs), lambda: self.zeros(
                        seqs, s.heads, s.head_v_dim, s.head_k_dim, dtype=self.dt["state"]))
                    return self.kda.chunk_kda_with_fused_gate(
                        q=q, k=k, v=v, raw_g=self.gate(T), raw_beta=self.beta(T, row), A_log=self.A_log,
                        g_bias=self.dt_bias, lower_bound=s.lower_bound, initial_state=initial,
                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=self.index(cu, index["cu_seqlens"]))

                yield f"prefill[{self.tag},{_tag(index)},{name},beta_row={row}]", call

    def decode(self, index: dict):
        s = self.s
        for slot in s.state_slot_strides:
            for row in s.beta_row_strides:
                for batch in batch_sizes(s.max_batch):
                    def call(batch=batch, row=row, slot=slot):
                        return self.kda.fused_recurrent_kda_packed_decode(
                            mixed_qkv=self.conv_output(batch)[0], raw_g=self.gate(batch),
                            raw_beta=self.beta(batch, row), A_log=self.A_log, dt_bias=self.dt_bias,
                            lower_bound=s.lower_bound, initial_state=self.pool(slot),
                            state_indices=self.index((1,) * batch, index["state_indices"]))

                    yield f"decode[{self.tag},{_tag(index)},slot={slot},beta_row={row},B={batch}]", call

    def spec_verify(self, index: dict):
        import torch

        s = self.s
        for width in s.draft_widths:
            for slot in s.state_slot_strides:
                for row in s.beta_row_strides:
                    for requests in verify_request_counts(s.heads, s.max_batch):
                        def call(width=width, slot=slot, row=row, n=requests):
                            T = n * width
                            _, q, k, v = self.conv_output(T)
                            dtype = getattr(torch, index["ssm_state_indices"])
                            indices = self.once(("spec_indices", n, width, dtype),
                                                lambda: self.zeros(n, width, dtype=dtype))
                            return self.kda.fused_recurrent_kda(
                                q=q, k=k, v=v, raw_g=self.gate(T), raw_beta=self.beta(T, row), A_log=self.A_log,
                                dt_bias=self.dt_bias, lower_bound=s.lower_bound, initial_state=self.pool(slot),
                                cu_seqlens=self.index(tuple(range(0, T + 1, width)), index["cu_seqlens"]),
                                ssm_state_indices=indices,
                                num_accepted_tokens=self.index((1,) * n, index["num_accepted_tokens"]))

                        yield (f"spec_verify[{self.tag},{_tag(index)},width={width},slot={slot},beta_row={row},"
                               f"requests={requests}]", call)


def _tag(index: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in index.items())


def _kernel_name(launch) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(launch.kernel).fn.__name__


def _kernel_module(launch) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(launch.kernel).fn.__module__
