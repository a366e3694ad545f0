"""Backend selection (Ascend and non-Ascend branches, without an NPU) and the serving launch contract."""
from __future__ import annotations

import sys
import types

import pytest
import torch

SPEC = {"backend": "cuda", "arch": "sm_90",  # a manifest's [spec] as the provider receives it (6 heads per rank)
        "model": {"kda_heads": 6, "head_k_dim": 128, "head_v_dim": 128, "gate_lower_bound": -5.0, "layers": 69},
        "serving": {"decode_batch_buckets": [1, 16], "draft_widths": [4]}}
PREFILL = ["l2norm", "l2norm", "cumsum", "intra_token", "inter_solve", "recompute", "state", "output"]
BUCKETS = {"cuda": [256, 1024, 4096, 16384, 65536], "npu": [256]}  # autotuned: every token bucket; pinned: one call


@pytest.fixture(autouse=True)
def fresh_npu_probe(pk):
    """detect() probes for an NPU once per process; each test here fakes its own environment."""
    pk.backend._npu_present.cache_clear()
    yield
    pk.backend._npu_present.cache_clear()


def test_detect_without_torch_npu_is_default(pk, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not importable
    assert pk.backend.detect() == "default"
    with pk.backend.use("npu"):
        assert pk.backend.detect() == "npu"
    assert pk.backend.detect() == "default"


@pytest.mark.parametrize("available,expected", [(True, "npu"), (False, "default")])
def test_detect_with_torch_npu(pk, monkeypatch, available, expected):
    """torch_npu importable: "npu" only when an NPU is present."""
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = types.SimpleNamespace(name="torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(pk.backend.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: available), raising=False)
    assert pk.backend.detect() == expected


def test_select_npu_pins_configs_on_raw_jit(pk):
    sel = {name: pk.backend.select(name, "npu") for name in ("cumsum", "intra_token", "inter_solve")}
    assert sel["cumsum"].launch_kwargs == {"BS": 64, "num_warps": 4, "num_stages": 3}
    # one program per chunk and head (TB = 64 rows): the grid of every chunk kernel, below the NPU's grid limit
    assert sel["intra_token"].launch_kwargs == {"TB": 64, "BH": 1, "num_warps": 4, "num_stages": 3}
    # triton-ascend's dots take ieee or hf32 only: the solve's tf32 (CUDA) would not lower
    assert sel["inter_solve"].launch_kwargs == {"BK": 64, "DOT_PREC": "ieee", "INV_PREC": "ieee", "num_warps": 4,
                                                "num_stages": 3}
    for s in sel.values():
        assert not s.autotuned and s.kernel is pk.backend.REGISTRY[s.name].kernel.fn
    assert sel["cumsum"].constexprs == {"BS": 64}


def test_select_default_keeps_autotune_lists(pk):
    counts = {name: len(pk.backend.select(name, "cuda").configs) for name in ("cumsum", "intra_token", "inter_solve")}
    assert counts == {"cumsum": 18, "intra_token": 9, "inter_solve": 6}
    for name in pk.backend.REGISTRY:
        sel = pk.backend.select(name, "default")
        assert sel.autotuned == (name != "recurrent")
        assert sel.configs, name
    with pytest.raises(ValueError, match="unknown backend"):
        pk.backend.select("cumsum", "tpu")
    with pytest.raises(KeyError, match="unknown kernel"):
        pk.backend.select("nope", "npu")


@pytest.mark.parametrize("backend", ["cuda", "npu"])
def test_serving_launches_follow_selection(pk, backend):
    launches = pk.serving.launches({**SPEC, "backend": backend})
    labels = [rec.label for rec in launches]
    assert labels == [f"prefill[tokens={t}]/{n}" for t in BUCKETS[backend] for n in PREFILL] + [
        "decode/recurrent", "verify[draft=4]/recurrent", "decode[beta=float32]/recurrent",
        "verify[draft=4,beta=float32]/recurrent"]
    for rec in launches:
        name = rec.label.split("/")[1]
        sel = pk.backend.select(name, backend)
        assert rec.kernel is sel.kernel
        # what the prewarmer resolves: a module-level object reachable by the JIT function's name
        jit = getattr(rec.kernel, "fn", rec.kernel) if sel.autotuned else rec.kernel
        module = sys.modules[jit.fn.__module__]
        assert getattr(module, jit.fn.__name__) in (rec.kernel, getattr(rec.kernel, "fn", None),
                                                     pk.backend.REGISTRY[name].kernel)
        for key, value in sel.launch_kwargs.items():
            assert rec.kwargs[key] == value
    verify = [r for r in launches if r.label.startswith("verify")]
    assert [r.kwargs["DRAFT"] for r in verify] == [4, 4]
    assert [r.args[4].dtype for r in launches[-4:]] == [torch.bfloat16] * 2 + [torch.float32] * 2  # beta as read
    assert launches[2].kwargs["GATE"] == 2
    again = pk.serving.launches({**SPEC, "backend": backend})
    assert [(r.label, r.kernel, r.kwargs, r.grid if not callable(r.grid) else None) for r in again] == \
           [(r.label, r.kernel, r.kwargs, r.grid if not callable(r.grid) else None) for r in launches]


def test_serving_run_makes_the_captured_calls(pk, monkeypatch):
    """run() on real tensors issues exactly the launches that launches() captured on meta tensors, for every
    declared dtype pair: what a device build runs to autotune covers every planned autotune key (Triton's key
    includes the argument dtypes)."""
    spec = {"backend": "npu", "model": {"kda_heads": 1, "head_k_dim": 16, "head_v_dim": 16},
            "dtypes": {"activation": ["float32"], "gate": ["float32", "float16"]},
            "serving": {"decode_batch_buckets": [2], "draft_widths": [1, 2]}}
    planned = pk.serving.launches(spec)
    ran = []
    real_launch = pk.backend.launch

    def spy(kernel, grid, *args, **kwargs):
        ran.append((kernel, tuple(grid), tuple(a if isinstance(a, (int, float)) or a is None else a.dtype for a in args),
                    kwargs))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(pk.backend, "launch", spy)
    pk.serving.run(spec, device="cpu")
    assert [(r.kernel, r.grid, r.kwargs) for r in planned] == [(k, g, kw) for k, g, _, kw in ran]
    assert {r.args[0].dtype for r in planned if r.label.endswith("/cumsum")} == {torch.float32, torch.float16}
    for rec, (_, _, args, _) in zip(planned, ran):
        assert [a if isinstance(a, (int, float)) or a is None else a.dtype for a in rec.args] == list(args)


def test_serving_spec_errors(pk):
    with pytest.raises(ValueError, match=r"spec\.model\.kda_heads is missing: expected a positive integer"):
        pk.serving.launches({"backend": "cuda"})
    with pytest.raises(ValueError, match=r"spec\.dtypes\.activation = 'int8': expected one of bfloat16"):
        pk.serving.launches({**SPEC, "dtypes": {"activation": "int8"}})
    with pytest.raises(ValueError, match=r"spec\.dtypes\.gate = \['int8'\]"):
        pk.serving.launches({**SPEC, "dtypes": {"activation": ["bfloat16"], "gate": ["int8"]}})
    with pytest.raises(ValueError, match=r"spec\.model\.head_k_dim = 512: expected at most 256"):
        pk.serving.launches({**SPEC, "model": {**SPEC["model"], "head_k_dim": 512}})


def test_serving_plans_the_cross_product_of_declared_dtypes(pk):
    """activation x gate dtypes: kernels that read g (cumsum, recurrent) get one request per pair, the others
    one per activation dtype; A_log and dt_bias reach every kernel as fp32 whatever the pair, beta too except in the
    recurrent kernel, which reads it as given in the activation dtype or fp32 (one request each)."""
    spec = {**SPEC, "dtypes": {"activation": ["bfloat16", "float16"], "gate": ["bfloat16", "float32"]}}
    launches = pk.serving.launches(spec)
    pairs = [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16"), ("float16", "float32")]
    prefills = [("prefill", f"tokens={t},", PREFILL) for t in BUCKETS["cuda"]]
    expected = [f"{kind}[{extra}act={a},gate={g}]/{name}" for a, g in pairs
                for kind, extra, names in [*prefills, ("decode", "", ["recurrent"]),
                                           ("verify", "draft=4,", ["recurrent"]),
                                           ("decode", "beta=float32,", ["recurrent"]),
                                           ("verify", "draft=4,beta=float32,", ["recurrent"])] for name in names]
    assert [r.label for r in launches] == expected

    def signature(rec):  # what tells compiled variants apart: argument dtypes and constexprs
        return (rec.label.split("/")[1], tuple(str(a.dtype) if hasattr(a, "dtype") else type(a).__name__
                                                for a in rec.args), tuple(sorted(rec.kwargs.items())))

    distinct = {signature(r) for r in launches}
    by_kernel = {}
    for name, *_ in distinct:
        by_kernel[name] = by_kernel.get(name, 0) + 1
    # cumsum reads g only: one variant per gate dtype; recurrent reads both
    assert by_kernel == {"l2norm": 2, "cumsum": 2, "intra_token": 2, "inter_solve": 2, "recompute": 2,
                         "state": 2, "output": 2, "recurrent": 16}
    for rec in launches:
        name = rec.label.split("/")[1]
        fp32_roles = {"cumsum": [1, 2], "intra_token": [3], "inter_solve": [3], "recompute": [2],
                      "recurrent": [5, 6]}.get(name, [])
        assert all(rec.args[i].dtype == torch.float32 for i in fp32_roles), rec.label
        if name == "recurrent":
            assert rec.args[4].dtype == (torch.float32 if "beta=float32" in rec.label else rec.args[0].dtype)


def test_serving_declared_switches(pk):
    """fused_gate / qk_l2norm from the spec decide GATE and the L2-norm launches (defaults: both on)."""
    plain = pk.serving.launches({**SPEC, "model": {k: v for k, v in SPEC["model"].items() if k != "gate_lower_bound"},
                                 "serving": {**SPEC["serving"], "fused_gate": False, "qk_l2norm": False}})
    assert [r.label for r in plain][:3] == ["prefill[tokens=256]/cumsum", "prefill[tokens=256]/intra_token",
                                            "prefill[tokens=256]/inter_solve"]
    assert {r.kwargs["GATE"] for r in plain if "GATE" in r.kwargs} == {0}
    assert not any(r.kwargs.get("USE_QK_L2NORM") or r.kwargs.get("NORM_QK") for r in plain)


def test_prefill_is_planned_at_every_token_bucket_of_the_budget(pk):
    """The prefill kernels' tuning keys carry the batch's token bucket (a runtime int they do not specialize on):
    with a 8192-token budget, prefill is planned at 256, 1024, 4096 and 16384 tokens (the bucket 8192 falls in), each
    call passing its bucket; every bucket's launch makes the same compile requests (the closure test's business)."""
    common = sys.modules["prewarm_kernels.kda.common"]
    assert [common.token_bucket(n) for n in (1, 256, 257, 16384, 16385, 10**6)] == [256, 256, 1024, 16384, 65536,
                                                                                    65536]
    spec = {**SPEC, "serving": {**SPEC["serving"], "max_prefill_tokens": 8192}}
    cumsum = [r for r in pk.serving.launches(spec) if r.label.endswith("/cumsum")]
    assert [r.label for r in cumsum] == [f"prefill[tokens={t}]/cumsum" for t in (256, 1024, 4096, 16384)]
    assert [(r.args[0].shape[1], r.args[7]) for r in cumsum] == [(t, t) for t in (256, 1024, 4096, 16384)]
    assert {r.kernel.keys[-1] for r in cumsum} == {"t_bucket"}
