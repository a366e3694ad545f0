"""sglang 0.5.23's Ascend KDA backend on triton-ascend 3.2.0 (no NPU, no torch_npu, the CANN ops stood in): the A3
profile answers torch.npu's queries as torch_npu would; independent traffic (``traffic.sglang_ascend``,
in tests/traffic: the backend made by its own constructors, pools and metadata from sglang's sources, the report-era
prefill from the report author's fork) drives ``AscendKDAAttnBackend`` through both prefill layouts, decode and DSPARK
verify with the state updates after it, and every launch is checked against the shipped manifest's plan: a kernel
this triton-ascend keys is compiled there with the launch's very specialization (Triton's own JIT binding computes
it, an autotuned kernel in the config the guard gives it), a kernel it cannot key is in the will-fail verdict, and
the verdict names nothing else. The shipped manifest's own lowering is `.ci/run`'s `prewarm lower`.
"""
from __future__ import annotations

import collections

import pytest
from traffic.closure import fresh_seed
from conftest import REPO

from prewarm import devices

from prewarm.building import tritoncompat
from prewarm.building.backends import get_target
from prewarm.planning.manifest import load
from prewarm.planning.plan import expand_all, plan_for

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml"
CALLS_PER_SEED = 90
RECURRENT = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent:"
             "fused_sigmoid_gating_delta_rule_update_kernel")
O_NORM = "sglang.kernels.ops.attention.fla.fused_norm_gate:layer_norm_gated_fwd_kernel"
CUMSUM = "sglang.kernels.ops.attention.fla.cumsum:chunk_local_cumsum_vector_kernel"
SGLANG_L2NORM = "sglang.kernels.ops.attention.fla.l2norm:l2norm_fwd_kernel"


@pytest.fixture(scope="module")
def planned():
    """The shipped manifest planned under the A3 profile (once: it drives the provider over the whole envelope);
    torch.npu is taken away again afterwards."""
    m = load(MANIFEST)
    try:
        yield m, plan_for(m, get_target("npu", m.arch, "offline", "A3"))
    finally:
        devices.deactivate()


@pytest.fixture(scope="module")
def verdict(planned) -> dict[str, dict[str, str]]:
    """kernel -> the specializations of the will-fail verdict's requests (on-disk form) -> label, expanded as
    Triton's JIT binds them (binding needs no key)."""
    _, p = planned
    return _by_kernel(expand_all([r for w in p.will_fail for r in w.requests]))


def test_the_a3_profile_answers_torch_npu_as_torch_npu_would(planned):
    import torch
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel
    from sglang.srt.utils import is_npu

    assert torch.npu.is_available() and torch.npu.device_count() == 1
    assert torch.npu.get_device_name(0) == "Ascend910_9391" and torch.device("npu").type == "npu"
    with torch.npu.device(0):
        pass
    assert is_npu() and not TritonKDAKernel.supports_packed_decode  # sglang's NPU decode: the recurrent kernel


@pytest.mark.parametrize("seed", [0, fresh_seed()], ids=lambda s: f"seed{s}")
def test_independent_traffic_makes_only_planned_requests(planned, verdict, seed):
    """Every launch of the traffic is planned: a keyable kernel's specialization among the plan's compiles (0
    missing), an unkeyable one's among the will-fail verdict's requests; the verdict holds exactly the kernels the
    traffic could not key; both prefill layouts, decode and verify (each width, dense and ragged) ran."""
    from prewarm.planning.pins import pin_chooser
    from prewarm.providers import capture
    from prewarm.providers.sglang import common
    from traffic import sglang_ascend as ascend_traffic
    from prewarm.providers.sglang.ascend import cann_ops

    m, p = planned
    compiles = _by_kernel(p.compiles)
    choose = pin_chooser(p.pins)  # what the guard gives each Autotuner on the node
    keyable, missed = {}, collections.defaultdict(list)  # (kernel, how it differs) -> the calls
    layouts, verified, decoded = collections.defaultdict(set), set(), 0  # what ran
    ascend_traffic.import_kernels()
    with common.fake_device("npu"), cann_ops():
        for call in ascend_traffic.calls(m.spec(), seed, CALLS_PER_SEED):
            o = call.options
            decoded += o["kind"] == "decode"
            if o["kind"] == "target_verify":
                verified.add((o["draft"], o["ragged"]))
            for launch in capture.launches_of(call.run):
                ref = tritoncompat.kernel_ref(launch.kernel)
                if ref not in keyable:
                    keyable[ref] = _keys(launch.kernel)
                if o["kind"] == "extend":
                    layouts[o["prefill"]].add(ref)
                plan_of = (compiles if keyable[ref] else verdict).get(ref, {})
                for data in _specializations(launch, choose):
                    if data not in plan_of:
                        where = "compiles" if keyable[ref] else "will-fail verdict"
                        nearest, differs = _nearest(launch.kernel, data, plan_of)
                        missed[f"{ref} (not in the plan's {where}): {differs}"].append(f"{call.label}; {nearest}")
    assert not missed, f"seed {seed}: launches not planned:\n" + "\n".join(
        f"{what}: {len(seen)} launches, e.g. {seen[0]}" for what, seen in missed.items())
    assert {ref for ref, keys in keyable.items() if not keys} == {w.kernel for w in p.will_fail} == {RECURRENT, O_NORM}
    # both layouts ran: 0.5.23's (sglang's l2norm around the CANN core) and the report era's Triton decomposition
    assert CUMSUM in layouts["triton"] - layouts["cann"] and SGLANG_L2NORM in layouts["cann"] - layouts["triton"]
    assert verified == {(width, ragged) for width in (4, 8) for ragged in (False, True)} and decoded


def test_triton_ascend_32_cannot_hash_the_o_norm_or_the_decode_kernel(planned):
    """Why those two are will-fail: sglang 0.5.23's o_norm kernel (every mode) and decode kernel name
    tl.extra.cuda (gdc_wait, gdc_launch_dependents) and triton-ascend 3.2.0 has no triton.language.extra.cuda, so
    its JIT cannot hash their source, on a node as here. When this test fails, the installed triton-ascend can."""
    from sglang.kernels.ops.attention.fla.fused_norm_gate import layer_norm_gated_fwd_kernel
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd_kernel
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update_kernel as recurrent,
    )

    assert l2norm_fwd_kernel.cache_key
    for kernel in (recurrent, layer_norm_gated_fwd_kernel):
        with pytest.raises(AttributeError, match="extra.* has no attribute 'cuda'"):
            tritoncompat.jit_function(kernel).cache_key  # noqa: B018


def _by_kernel(compiles) -> dict[str, dict[str, str]]:
    """kernel -> on-disk specialization -> the compile's label."""
    out = collections.defaultdict(dict)
    for c in compiles:
        out[c.kernel][tritoncompat.on_disk(c.specialization)] = c.label
    return out


def _keys(kernel) -> bool:
    """Does this triton-ascend compute ``kernel``'s cache key (what a node's JIT does at its first call)?"""
    try:
        tritoncompat.jit_function(kernel).cache_key  # noqa: B018
    except Exception:  # noqa: BLE001  (whatever the walk raises, the node's JIT raises too)
        return False
    return True


def _specializations(launch, choose) -> list[str]:
    """The launch's compile requests as Triton's JIT binds its arguments (on-disk form); an autotuned kernel in the
    one config the guard pins it to, where the plan's table pins one."""
    from prewarm.providers import capture

    kernel = launch.kernel
    tuner = tritoncompat.find_autotuner(kernel)
    pinned = choose(tuner) if tuner is not None else None
    if pinned is not None:
        kernel = tritoncompat.with_configs(kernel, [pinned])
    args = tuple(capture.as_meta(a) for a in launch.args)
    kwargs = {k: capture.as_meta(v) for k, v in launch.kwargs.items()}
    with tritoncompat.compile_requests(skip=True) as captured:
        tritoncompat.warmup(kernel, args, kwargs, grid=(1,))
    return [tritoncompat.on_disk(d) for d in dict.fromkeys(captured)]


def _nearest(kernel, data: str, planned: dict[str, str]) -> tuple[str, str]:
    """(the planned compile of ``kernel`` closest to ``data``, the arguments and options in which it differs)."""
    if not planned:
        return "", "the plan has this kernel nowhere"
    names = tritoncompat.jit_function(kernel).arg_names
    want = tritoncompat.parse_specialization(data, names)

    def differences(other: str) -> list[str]:
        have = tritoncompat.parse_specialization(other, names)
        args = [f"{n}: {_arg(a, have.args.get(n))} (planned {_arg(have.args.get(n), a)})"
                for n, a in want.args.items() if have.args.get(n) != a]
        return args + [f"{k}={v!r} (planned {have.options.get(k)!r})" for k, v in want.options.items()
                       if have.options.get(k) != v]

    best = min(planned, key=lambda other: len(differences(other)))
    return f"nearest planned: {planned[best]!r}", "; ".join(differences(best))


def _arg(arg, other) -> str:
    """How ``arg`` reads beside ``other``: its dtype and class, or all of it where those read alike."""
    if arg is None:
        return "absent"
    return arg.describe() if other is None or arg.describe() != other.describe() else repr(arg)
