"""sglang 0.5.23's CUDA model around the KDA layer, by component: what ``prewarm.providers.sglang.cuda`` adds to the
KDA backend's launches, and its coverage hook (:mod:`prewarm.providers.contract`).

Each component past the KDA layer is one module beside the provider (``model_<component>.py``) with ``calls(spec, s,
device)`` (label, thunk) pairs that drive sglang's own functions as its runner calls them, and ``coverage(spec)``
(its entry: the kernels it plans, what the model reaches that it does not, with why). Planned so far: ``moe``
(:mod:`.model_moe`), ``logits`` (:mod:`.model_logits`), ``mla`` (:mod:`.model_mla`), ``spec_worker``
(:mod:`.model_spec_worker`), the scheduler's req_to_token writes in ``runner`` (:mod:`.model_scheduler`) and
``sampler`` (:mod:`.model_sampler`). The KDA provider's own launches are labelled by the component they belong to
(:func:`component_of`): ``kda`` (``TritonKDAKernel`` and ``KDAAttnBackend`` with its conv, tracking and graph
metadata), ``runner`` (the model runner's extend positions), ``allocator`` (the mamba pool's slot clear / copy),
``spec_worker`` (the EAGLE worker's verify commit). :data:`NOT_PLANNED` names what the model reaches that no module
plans yet, per component, each with why. A component may have two modules (its Triton kernels, its JIT modules past
Triton: ``dense_mlp`` and the MoE's activations in :mod:`.model_mlp`, the EAGLE verify's in :mod:`.model_spec_jit`;
the KDA provider's launches and a module's, as ``runner``): the coverage hook merges them.
"""
from __future__ import annotations

from . import (model_logits, model_mla, model_mlp, model_moe, model_sampler, model_scheduler, model_spec_jit,
               model_spec_worker)

# the modules whose calls launches() adds, in plan order
COMPONENTS = (model_moe, model_logits, model_mla, model_spec_worker, model_scheduler, model_sampler, model_mlp,
              model_spec_jit)
# the KDA provider's label prefixes (before "[") -> their component
KDA_PROVIDER_COMPONENTS = {"runner.extend_positions": "runner", "runner.mamba_slot_warmup": "allocator",
                           "runner.mamba_slot_clear": "allocator", "runner.mamba_slot_copy": "allocator",
                           "eagle.verify_commit": "spec_worker"}
# the KDA provider's kernels each of its components launches (coverage's "planned"; the KDA layer's are many, and
# the plan counts them from the labels: the hook lists none for it)
PROVIDER_KERNELS = {
    "runner": ["sglang.kernels.ops.attention.position:compute_position_kernel"],
    "allocator": ["sglang.srt.mem_cache.mamba_slot_fused:_fused_slot_clear_kernel",
                  "sglang.srt.mem_cache.mamba_slot_fused:_fused_slot_copy_kernel"],
}
# components of Kimi-Linear's step under sglang 0.5.23 that launch kernels nothing here plans yet: (component, what,
# why), from an independent read of the 0.5.23 wheel (issue 59)
NOT_PLANNED = [
    ("norm", "the RMSNorms (input, post-attention, final; MLA's kv_a_layernorm): sgl_kernel's rmsnorm / "
             "fused_add_rmsnorm, which hand bf16/fp16 to FlashInfer's norm, whose CuTe DSL kernels (rmsnorm_cute, "
             "fused_add_rmsnorm_cute) cute.compile at first call in each process (nvidia-cutlass-dsl is installed "
             "with sglang; without it, or with FLASHINFER_USE_CUDA_NORM=1: FlashInfer's JIT module 'norm')",
     "CuTe DSL compiles are a kernel library prewarm does not build or ship; sglang's own JIT rmsnorm / "
     "fused_add_rmsnorm modules are not what these norms reach (only cast_x_before_out_mul norms, not Kimi-Linear's)"),
]


def component_of(label: str) -> str:
    """The component of one of the KDA provider's call labels (its prefix before ``[``)."""
    return KDA_PROVIDER_COMPONENTS.get(label.split("[", 1)[0], "kda")


def launches(spec: dict, s, kda_launches: list) -> list:
    """The KDA provider's launches, each label prefixed with its component, then every component module's launches
    (labels ``component/call/kernel``), on fake tensors of the target's device type, none run, then the sglang JIT
    modules those calls reached (sglang's ``load_jit`` resolved each: :class:`prewarm.jit.JitRequest`)."""
    from ..capture import launches_of
    from .common import fake_device, published_parallel

    for launch in kda_launches:
        launch.label = f"{component_of(launch.label)}/{launch.label}"
    out = list(kda_launches)
    with published_parallel(s), fake_device(s.device) as device:
        for module in COMPONENTS:
            for label, call in module.calls(spec, s, s.device):
                for launch in launches_of(call):
                    launch.label = f"{label}/{_kernel_name(launch)}"
                    out.append(launch)
    return out + list(dict.fromkeys(device.jit))


def coverage(spec: dict, kda_not_planned: dict[str, str]) -> list[dict]:
    """Per model component, what the sglang CUDA provider plans and what Kimi-Linear's step reaches that it does not
    (the planner counts each component's kernels and compiles from the launches' labels); ``kda_not_planned``: the
    KDA layer's options the provider does not plan (``spec.sglang`` key -> why)."""
    out = [{"component": "kda", "planned": [], "not_planned": [
        {"what": f"spec.sglang.{key}", "why": why} for key, why in kda_not_planned.items()]}]
    out += [{"component": name, "planned": list(kernels), "not_planned": []}
            for name, kernels in PROVIDER_KERNELS.items()]
    by_name = {entry["component"]: entry for entry in out}
    for entry in (module.coverage(spec) for module in COMPONENTS):  # a component may have two modules (Triton, JIT)
        if entry["component"] in by_name:
            by_name[entry["component"]]["planned"] += entry["planned"]
            by_name[entry["component"]]["not_planned"] += entry["not_planned"]
        else:
            by_name[entry["component"]] = entry
            out.append(entry)
    collectives = [("collectives", "sglang's custom all-reduce (JIT) after the attention and MoE/MLP blocks",
                    "an sglang JIT module past Triton, not yet planned")] if spec_tp(spec) > 1 else []
    for name, what, why in NOT_PLANNED + collectives:
        if name not in by_name:
            by_name[name] = {"component": name, "planned": [], "not_planned": []}
            out.append(by_name[name])
        by_name[name]["not_planned"].append({"what": what, "why": why})
    return out


def spec_tp(spec: dict) -> int:
    """``[spec.parallel] tensor_parallel`` (1 where absent): above 1 the model all-reduces between blocks."""
    return (spec.get("parallel") or {}).get("tensor_parallel", 1)


def _kernel_name(launch) -> str:
    from prewarm.building import tritoncompat

    return tritoncompat.jit_function(launch.kernel).fn.__name__
