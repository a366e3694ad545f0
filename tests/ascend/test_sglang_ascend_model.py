"""Kimi K3's whole step on sglang 0.5.23's Ascend path, checked against the shipped manifest's plan by keys
(triton-ascend 3.2.0, no NPU, no torch_npu): independent traffic (``traffic.sglang_ascend_model``, in tests/traffic:
written from sglang's scheduler, model runner, model and DSPARK worker, never from the provider) runs one rank's
steps in every forward mode, with ``transfer_to_npu``'s dispatch, and every Triton launch it makes must be planned:
a kernel this triton-ascend keys compiled with the launch's very specialization (Triton's own JIT binding computes
it; an autotuned kernel in the one config the manifest pins, which it must pin: an unpinned one benchmarks on the
node at its first request), a kernel it cannot key in the will-fail verdict. The KDA layer's own traffic is
``test_sglang_ascend.py``'s, against the same plan (conftest's ``sglang_k3``: planned once per session).
"""
from __future__ import annotations

import collections

import pytest
import sglang_closure
from traffic.closure import fresh_seed

from prewarm.building import tritoncompat

CALLS_PER_SEED = 60
# What the traffic reaches (it says what it drives in its docstring): a kernel that stops coming is a traffic that
# stopped driving a component, not a plan that covers it.
REACHED = {
    "sgl_kernel_npu.activation.situ:_situ_and_mul_kernel",  # dense MLP, shared experts (autotuned)
    "sgl_kernel_npu.activation.situ:_situ_kernel",  # routed experts, int8 requant
    "sgl_kernel_npu.kimi_k3.attn_residual:_mix_fused_kernel",
    "sgl_kernel_npu.mem_cache.allocator:alloc_extend_kernel",
    "sgl_kernel_npu.sample.chain_speculative_sampling:_chain_rejection_accept_kernel",
    "sgl_kernel_npu.sample.chain_speculative_sampling:_chain_rejection_block_sum_kernel",
    "sgl_kernel_npu.sample.chain_speculative_sampling:_chain_rejection_sample_kernel",
    "sglang.kernels.ops.activation.softcap:softcap_inplace_logits_kernel",  # the graph logits' fp32 cast
    "sglang.kernels.ops.attention.position:compute_position_kernel",
    "sglang.kernels.ops.memory.common:write_req_to_token_pool_triton",
    "sglang.kernels.ops.memory.memcpy_triton:memcpy_triton_kernel",
    "sglang.kernels.ops.speculative.dflash:_fused_correct_drafts_and_bonus_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_cap_correct_len_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_finalize_accept_lens_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_gather_row_bonus_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_gather_two_level_bonus_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_mixed_accept_select_kernel",
    "sglang.kernels.ops.speculative.dspark.dspark_accept:_softmax_temp_kernel",
    "sglang.kernels.ops.speculative.dspark.markov_sample:_markov_sample_finish_kernel",
    "sglang.kernels.ops.speculative.dspark.markov_sample:_markov_sample_partial_kernel",
    "sglang.srt.mem_cache.allocation:assign_req_to_token_pool",
}


@pytest.fixture(scope="module")
def planned(sglang_k3):
    return sglang_k3


@pytest.fixture(scope="module")
def verdict(sglang_k3_verdict):
    return sglang_k3_verdict


def test_transfer_to_npu_makes_an_npu_tensor_a_cuda_one(planned):
    """The dispatch every sglang NPU worker sees (torch_npu's ``Tensor.is_cuda = Tensor.is_npu``): sglang's
    ``inputs_on_cuda`` routes DSPARK's accept to its Triton kernels."""
    import torch
    from sglang.kernels.ops.speculative.dspark.dispatch import inputs_on_cuda
    from traffic.sglang_ascend_model import transfer_to_npu

    from prewarm.providers.sglang import common

    with common.fake_device("npu"):
        npu = torch.zeros(2, device="npu")
        assert not npu.is_cuda and not inputs_on_cuda(npu)
        with transfer_to_npu():
            assert npu.is_cuda and inputs_on_cuda(npu) and not torch.zeros(2).is_cuda
        assert not npu.is_cuda


@pytest.mark.parametrize("seed", [0, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_model_traffic_makes_only_planned_requests(planned, verdict, seed):
    """0 launches missing by keys: each launch's compile requests are among the plan's compiles (or, for a kernel
    this triton-ascend cannot key, the will-fail verdict's requests), each autotuned launch pinned. A miss is listed
    per kernel and difference, with the step that made it (its mode and every drawn option)."""
    from traffic import sglang_ascend_model as model_traffic

    from prewarm.planning.pins import pin_chooser
    from prewarm.providers import capture
    from prewarm.providers.sglang import common

    m, p = planned
    compiles = sglang_closure.by_kernel(p.compiles)
    choose = pin_chooser(p.pins)  # what the guard gives each Autotuner on the node
    keyable, missed, modes = {}, collections.defaultdict(list), collections.Counter()
    reached = set()
    model_traffic.import_kernels()
    with common.fake_device("npu"), model_traffic.transfer_to_npu():
        for call in model_traffic.calls(m.spec(), seed, CALLS_PER_SEED):
            modes[call.options["mode"]] += 1
            for launch in capture.launches_of(call.run):
                ref = tritoncompat.kernel_ref(launch.kernel)
                reached.add(ref)
                if ref not in keyable:
                    keyable[ref] = sglang_closure.keys(launch.kernel)
                tuner = tritoncompat.find_autotuner(launch.kernel)
                if keyable[ref] and tuner is not None and choose(tuner) is None:
                    missed[f"{ref}: autotuned and not pinned (the node benchmarks it)"].append(call.label)
                plan_of = (compiles if keyable[ref] else verdict).get(ref, {})
                for data in sglang_closure.specializations(launch, choose):
                    if data not in plan_of:
                        where = "compiles" if keyable[ref] else "will-fail verdict"
                        nearest, differs = sglang_closure.nearest(launch.kernel, data, plan_of)
                        missed[f"{ref} (not in the plan's {where}): {differs}"].append(f"{call.label}; {nearest}")
    assert not missed, f"seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {len(missed)} kinds of launch not " \
        f"planned, {len({k.split(' ')[0].rstrip(':') for k in missed})} kernels:\n" + "\n".join(
            f"{what}: {len(seen)} launches, e.g. {seen[0]}" for what, seen in sorted(missed.items()))
    assert set(modes) == set(model_traffic.MODES) and reached == REACHED, (modes, reached ^ REACHED)
