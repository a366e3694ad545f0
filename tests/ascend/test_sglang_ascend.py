"""sglang 0.5.23's own KDA kernels on Ascend (triton-ascend 3.2.0, no NPU, no torch_npu): the A3 profile answers
torch.npu's queries as torch_npu would, the provider plans what sglang's Ascend KDA backend runs through Triton
(decode and verify through TritonKDAKernel, on npu tensors: another grid layout, no PDL), and independent traffic
(``prewarm.providers.sglang_traffic``) makes only planned requests. Requests are compared as Triton's specialization
data: triton-ascend 3.2.0 cannot compute the recurrent kernel's key at all (see the last test), and the key is a
function of the data. The shipped manifest's own lowering is `.ci/run`'s `prewarm lower`.
"""
from __future__ import annotations

import pytest
from closure_traffic import fresh_seed
from conftest import REPO

from prewarm import devices, tritoncompat
from prewarm.backends import get_target
from prewarm.manifest import load
from prewarm.plan import plan_for

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml"
SHIPPED_PATHS = 'paths = ["ascend_extend"]'
CALLS_PER_SEED = 60


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The shipped manifest with the recurrent paths it leaves out for triton-ascend 3.2.0 (decode, target_verify),
    planned under the A3 profile; torch.npu is taken away again afterwards."""
    text = MANIFEST.read_text()
    assert SHIPPED_PATHS in text
    path = tmp_path_factory.mktemp("sglang") / "k3.toml"
    path.write_text(text.replace(SHIPPED_PATHS, 'paths = ["ascend_extend", "decode", "target_verify"]'))
    m = load(path)
    try:
        p = plan_for(m, get_target("npu", m.arch, "offline", "A3"))
        yield m, p
    finally:
        devices.deactivate()


def test_the_a3_profile_answers_torch_npu_as_torch_npu_would(planned):
    import torch
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel
    from sglang.srt.utils import is_npu

    assert torch.npu.is_available() and torch.npu.device_count() == 1
    assert torch.npu.get_device_name(0) == "Ascend910_9391" and torch.device("npu").type == "npu"
    with torch.npu.device(0):
        pass
    assert is_npu() and not TritonKDAKernel.supports_packed_decode  # sglang's NPU decode path


def test_decode_and_verify_are_planned_as_ascend_runs_them(planned):
    """On npu tensors sglang launches the recurrent kernel on the (NK, NV, N*HV) grid (SPLIT_N_HV_GRID False), with
    no programmatic dependent launch, the model's lower bound in-kernel; every token bucket of 1..64 requests x 8
    draft tokens."""
    from sglang.kernels.ops.attention.linear import fused_sigmoid_gating_recurrent as recurrent

    _, p = planned
    names = recurrent.fused_sigmoid_gating_delta_rule_update_kernel.arg_names
    specs = [tritoncompat.parse_specialization(c.specialization, names) for c in p.compiles
             if c.kernel.endswith(":fused_sigmoid_gating_delta_rule_update_kernel")]
    assert specs and all(s.args["SPLIT_N_HV_GRID"].value is False and s.args["USE_GDC"].value is False
                         and s.args["USE_LOWER_BOUND"].value is True for s in specs)
    assert {s.args["NP2_T"].value for s in specs} == {1 << k for k in range(10)}
    assert {s.args["DISABLE_STATE_UPDATE"].value for s in specs} == {False, True}


@pytest.mark.parametrize("seed", [0, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_traffic_makes_only_planned_requests(planned, seed):
    from prewarm.providers import sglang_env, sglang_traffic

    m, p = planned
    have = {c.specialization for c in p.compiles}
    seen, missed, kinds = 0, {}, set()
    with sglang_env.fake_device("npu"):
        for call in sglang_traffic.calls(m.spec(), seed, CALLS_PER_SEED, "npu"):
            kinds.add(call.options["kind"])
            for launch in sglang_env.launches_of(call.run):
                args = tuple(sglang_env.as_meta(a) for a in launch.args)
                kwargs = {k: sglang_env.as_meta(v) for k, v in launch.kwargs.items()}
                with tritoncompat.compile_requests(skip=True) as captured:
                    tritoncompat.warmup(launch.kernel, args, kwargs, grid=(1,))
                seen += len(captured)
                for data in captured:
                    if data not in have:
                        missed.setdefault(data, f"{call.label} -> {tritoncompat.kernel_ref(launch.kernel)}")
    assert kinds == {"ascend_extend", "decode", "target_verify"} and seen > CALLS_PER_SEED
    assert not missed, f"seed {seed}: {len(missed)} unplanned requests, e.g. {list(missed.values())[:3]}"


def test_triton_ascend_32_cannot_hash_sglangs_recurrent_kernel(planned):
    """Why the shipped manifest plans only the prefill's l2norm: sglang 0.5.23's decode/verify kernel names
    tl.extra.cuda (gdc_wait, gdc_launch_dependents) and triton-ascend 3.2.0 has no triton.language.extra.cuda, so
    its JIT cannot hash the kernel's source, on a node as here. When this test fails, the installed triton-ascend
    can: add "decode" and "target_verify" to the manifest's [spec.sglang] paths."""
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd_kernel
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update_kernel as recurrent,
    )

    assert l2norm_fwd_kernel.cache_key
    with pytest.raises(AttributeError, match="extra.* has no attribute 'cuda'"):
        recurrent.cache_key
