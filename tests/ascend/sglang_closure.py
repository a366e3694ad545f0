"""What the sglang Ascend tests share (tests/ascend/test_sglang_ascend.py: the KDA layer's traffic;
test_sglang_ascend_model.py: the model step's): the shipped manifest, and how a traffic launch is checked against
its plan by keys. The plan itself is conftest.py's ``sglang_k3`` fixture (planned once per session)."""
from __future__ import annotations

import collections

from conftest import REPO

from prewarm.building import tritoncompat

MANIFEST = REPO / "manifests" / "kimi-k3-ascend-a3-sglang.toml"


def by_kernel(compiles) -> dict[str, dict[str, str]]:
    """kernel -> on-disk specialization -> the compile's label."""
    out = collections.defaultdict(dict)
    for c in compiles:
        out[c.kernel][tritoncompat.on_disk(c.specialization)] = c.label
    return out


def keys(kernel) -> bool:
    """Does this triton-ascend compute ``kernel``'s cache key (what a node's JIT does at its first call)?"""
    try:
        tritoncompat.jit_function(kernel).cache_key  # noqa: B018
    except Exception:  # noqa: BLE001  (whatever the walk raises, the node's JIT raises too)
        return False
    return True


def specializations(launch, choose) -> list[str]:
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


def nearest(kernel, data: str, planned: dict[str, str]) -> tuple[str, str]:
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
