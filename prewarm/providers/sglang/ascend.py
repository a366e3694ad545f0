"""Kimi K3's step on sglang's Ascend path as an A3 rank runs it: ``provider = "prewarm.providers.sglang.ascend"``.

One module per model component beside this one, each driving the sglang (or sgl-kernel-npu) code that launches its
Triton kernels with the arguments the model passes at one rank's shapes (TP / DP attention / DeepEP from
``[spec.parallel]``; the widths from ``[spec.sglang.model]``, :mod:`.ascend_model`), on fake npu tensors
(:func:`prewarm.providers.sglang.common.fake_device`: torch_npu's ``transfer_to_npu`` makes ``is_cuda`` true there,
so sglang's ``if x.is_cuda:`` Triton paths are the node's), every ``kernel[grid](...)`` captured, none run:

- ``kda`` (:mod:`.ascend_kda`): ``AscendKDAAttnBackend`` whole (extend with and without prefix, decode, DSPARK
  verify and the state updates after it, both prefill layouts, the layer's o_norm);
- ``attn_residual`` (:mod:`.ascend_attn_residual`): the attention-residual bank's mix before every attention and
  FFN read and at the stack's output;
- ``mlp`` (:mod:`.ascend_mlp`): the dense MLP's and the shared experts' SiTU (autotuned: pinned by the manifest's
  table);
- ``moe`` (:mod:`.ascend_moe`): the routed experts' SiTU with the W4A8 int8 requant;
- ``allocator`` (:mod:`.ascend_allocator`): the NPU KV page allocator over the deployment's batch and token range;
- ``runner`` (:mod:`.ascend_runner`): extend positions, the req_to_token writes (prefill, DSPARK decode), DP
  attention's gather/scatter;
- ``logits`` (:mod:`.ascend_logits`): the logits' fp32 cast into the graph's output buffer;
- ``spec_worker`` (:mod:`.ascend_spec_worker`): DSPARK's verify accept, greedy, sampled (rejection sampling) and
  mixed, and the draft's Markov sampling per draft position.

:func:`launches` concatenates them (labels ``component/call/kernel``), :func:`coverage` says per component what it
plans and what the model reaches that it does not (``prewarm plan`` prints it), :func:`options` which API axes are
planned narrower than sglang accepts. Without ``[spec.sglang.model]`` only ``kda`` is planned; coverage says so.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..capture import launches_of
from . import (
    ascend_allocator,
    ascend_attn_residual,
    ascend_kda,
    ascend_logits,
    ascend_mlp,
    ascend_moe,
    ascend_runner,
    ascend_spec_worker,
)
from .ascend_kda import ReportEraExtendKernel, cann_ops, prefill_lengths  # noqa: F401  (what tests import here)
from .ascend_model import read_model
from .common import fake_device, published_parallel, read_spec

COMPONENTS = (ascend_kda, ascend_attn_residual, ascend_mlp, ascend_moe, ascend_allocator, ascend_runner,
              ascend_logits, ascend_spec_worker)
# what the model step reaches that no component module plans (component, what, why): from a read of sglang
# 0.5.23's wheel and the vendored sgl-kernel-npu for the report's launch line
NOT_PLANNED = (
    ("mla", "the MLA layers' attention on NPU (ascend_backend: torch_npu fused attention, npu_mla_prolog, KV writes)",
     "CANN operators, not Triton; sgl-kernel-npu's fused_split_qk_norm is off for K3 (kimi_k3.py sets "
     "_disable_npu_fused_split_qk_norm)"),
    ("mla", "sgl_kernel_npu.norm.fused_rope_qk_mqa (rotary_embedding/base.py forward_npu, when the rotary embedding "
            "has a sin_cos_cache)", "the MLA layers are not driven: whether K3's MLA (mla_use_nope) reaches it is "
                                    "not established"),
    ("sampler", "the sampler of a non-speculative step (srt/layers/sampler.py, --sampling-backend pytorch: sglang's "
                "default without FlashInfer)", "not driven: as read, its NPU path is torch (sampler_softmax falls back "
                                             "to torch.softmax, top-k / top-p in torch), no Triton kernel found"),
)


def launches(spec: dict) -> list:
    """Every kernel launch of the model step within ``spec``'s envelope, on fake npu tensors, labelled
    ``component/call/kernel``."""
    s = read_spec(spec)
    if s.backend != "npu":
        raise ValueError(f"prewarm.providers.sglang.ascend plans sglang's Ascend backend: [target] backend = "
                         f"\"npu\", not {s.backend!r} (prewarm.providers.sglang.cuda plans the CUDA one)")
    model = read_model(spec)
    components = _planned(model)
    for module in components:
        module.import_modules()
    out = []
    with published_parallel(s), fake_device("npu"), cann_ops(), transfer_to_npu():
        for module in components:
            for label, call in module.calls(s, model):
                for launch in launches_of(call):  # a view's pointer not 16-byte aligned: the plan encodes it
                    launch.label = f"{module.COMPONENT}/{label}/{_kernel_name(launch)}"
                    out.append(launch)
    return out


def coverage(spec: dict) -> list[dict]:
    """Per component (:mod:`prewarm.providers.contract`): the kernels it plans and what the model reaches that it
    does not, with why."""
    s, model = read_spec(spec), read_model(spec)
    out = [module.coverage(s, model) for module in _planned(model)]
    if model is None:
        out += [{"component": module.COMPONENT, "planned": [], "not_planned": [
            {"what": f"every Triton kernel of {module.__name__}",
             "why": "[spec.sglang.model] is absent: the model's widths beyond its KDA layers are not stated"}]}
            for module in COMPONENTS if module is not ascend_kda]
    by_name = {entry["component"]: entry for entry in out}
    for component, what, why in NOT_PLANNED:
        entry = by_name.setdefault(component, {"component": component, "planned": [], "not_planned": []})
        if entry not in out:
            out.append(entry)
        entry["not_planned"].append({"what": what, "why": why})
    return out


def options(spec: dict) -> list[dict]:
    """Each axis this provider plans on fewer values than sglang accepts (``prewarm plan`` prints them)."""
    from prewarm_kernels.spec import DTYPES, INDEX_DTYPES

    from .common import PATHS, PREFILLS, ROLES

    s = read_spec(spec)
    given = {table: set(spec.get(table) or ()) if isinstance(spec.get(table), dict) else set()
             for table in ("dtypes", "sglang")}
    rows = [(f"dtypes.{role}", s.dtypes[role], list(INDEX_DTYPES if role == "index" else DTYPES)) for role in ROLES]
    rows += [("sglang.paths", list(s.paths), list(PATHS["npu"])),
             ("sglang.prefill", list(s.prefill), list(PREFILLS)),
             ("sglang.track_state", [False, True] if s.track_state else [False], [False, True]),
             ("sglang.replayssm", [False], [False, True])]  # --enable-linear-replayssm(-spec): not planned
    return [{"key": f"spec.{key}", "planned": planned, "accepted": accepted,
             "given": key.split(".")[1] in given.get(key.split(".")[0], set()),
             "narrowed": accepted is not None and planned != accepted} for key, planned, accepted in rows]


@contextlib.contextmanager
def transfer_to_npu() -> Iterator[None]:
    """Within the block ``tensor.is_cuda`` is true on npu tensors, as torch_npu's ``transfer_to_npu`` (imported by
    sglang's NPU workers) makes it: ``torch.Tensor.is_cuda = torch.Tensor.is_npu``. Every ``if x.is_cuda:`` Triton
    dispatch in sglang (DSPARK's accept kernels' ``inputs_on_cuda``, ``compute_dflash_correct_drafts_and_bonus``)
    then takes the Triton path, as on the node."""
    import torch

    original = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: self.device.type in ("cuda", "npu"))
    try:
        yield
    finally:
        torch.Tensor.is_cuda = original


def _planned(model) -> tuple:
    """The component modules planned: every one with the model's widths, the KDA layers alone without them."""
    return COMPONENTS if model is not None else (ascend_kda,)


def _kernel_name(launch) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(launch.kernel).fn.__name__
