"""Independent traffic -> the compile requests Triton's JIT makes for it; shared by the CUDA and Ascend closure tests.

Calls come from ``prewarm_kernels.kda.traffic`` (never from the planner's provider). Each runs through the public
API on ``meta`` tensors inside a launch capture; each captured launch is then bound and specialized by the real JIT
entry point (``warmup``, under whatever target is active) with compiles skipped, exactly as ``prewarm.planning.plan.expand``
does for a planned launch, but on the launch's own arguments: a view's pointer offset (its alignment class) is kept.
Each autotuned launch's tuning key (and the key dir its kept result is looked up in) is computed as the plan's are
(``prewarm.building.autotune.call_tuning``): a key the plan lacks is a benchmark on the node.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field

from prewarm.building import tritoncompat
from prewarm.building.autotune import PlannedTuning, call_tuning
from prewarm.planning.manifest import Manifest
from prewarm.planning.plan import Compile, expand_all, plan

FIXED_SEEDS = [0, 1, 2]


def fresh_seed() -> int:
    """A seed no test fixed, in the test id: PREWARM_CLOSURE_SEED (conftest draws one per run), else a random one."""
    return int(os.environ.get("PREWARM_CLOSURE_SEED") or random.SystemRandom().randrange(10**3, 10**9))


def seeds() -> list[int]:
    """The fixed seeds plus a fresh one."""
    return FIXED_SEEDS + [fresh_seed()]


@dataclass
class Traffic:
    calls: int = 0
    launches: int = 0
    compiles: dict[str, Compile] = field(default_factory=dict)  # specialization data -> first call making it
    tunings: dict[str, PlannedTuning] = field(default_factory=dict)  # result key dir -> first call tuning it
    refused: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # API error -> call labels


def run_traffic(m: Manifest, seed: int, n: int) -> Traffic:
    """``n`` calls of seed ``seed`` within ``m``'s envelope, and every compile request they make (target active)."""
    from prewarm_kernels.kda.traffic import Envelope, calls  # after the target: triton 3.2 binds @autotune to it
    from prewarm_kernels.launch import capture

    out = Traffic()
    for call in calls(Envelope.from_spec(m.spec()), seed, n, "meta"):
        out.calls += 1
        try:
            with capture() as launches:
                call.run()
        except Exception as e:  # a call a server makes, refused by the API: a kernel bug, reported
            out.refused[f"{type(e).__name__}: {e}"].append(call.label)
            continue
        for launch in launches:
            out.launches += 1
            # triton-ascend prints advice on every bind
            with tritoncompat.compile_requests(skip=True) as captured, contextlib.redirect_stdout(io.StringIO()):
                tritoncompat.warmup(launch.kernel, launch.args, launch.kwargs, grid=(1,))
            ref = tritoncompat.kernel_ref(launch.kernel)
            for data in captured:
                out.compiles.setdefault(data, Compile("runtime", ref, f"{call.label} -> {ref.split(':')[1]}", data))
            tuning = call_tuning(f"{call.label} -> {ref.split(':')[1]}", launch.kernel, launch.args, launch.kwargs)
            if tuning is not None:
                out.tunings.setdefault(tuning.key, tuning)
    return out


def planned_compiles(m: Manifest) -> list[Compile]:
    """Everything ``m``'s plan compiles (target active), for the explanation of a miss."""
    with contextlib.redirect_stdout(io.StringIO()):
        return expand_all(plan(m).requests)


def failure_report(m: Manifest, seed: int, t: Traffic, missed: list[Compile]) -> str:
    """What a reader needs to fix it: the calls the API refused (a kernel bug), then the missed requests grouped by
    what tells them from the nearest planned request (``prewarm.node.explain``), with a count and an example call."""
    from prewarm.node.explain import explain

    lines = [f"{m.name}, seed {seed} (rerun: PREWARM_CLOSURE_SEED={seed}): {t.calls} calls, {t.launches} launches, "
             f"{len(t.compiles)} distinct compile requests; {len(missed)} would compile (not planned); "
             f"{sum(map(len, t.refused.values()))} calls refused by the API"]
    for err, labels in t.refused.items():
        lines.append(f"REFUSED {len(labels)} calls, e.g. {labels[0]}: {err}")
    planned = planned_compiles(m) if missed else []
    groups: dict[str, list[tuple[Compile, str]]] = defaultdict(list)  # what differs -> (request, explanation)
    for c in missed:
        e = explain(c.specialization, planned, kernel=c.kernel)
        groups["; ".join(map(str, e.differences)) or e.summary()].append((c, str(e)))
    for n, group in enumerate(sorted(groups.values(), key=len, reverse=True)):
        if n == 12:
            lines.append(f"... and {len(groups) - 12} more kinds of miss")
            break
        kernels = sorted({c.kernel.split(":")[1] for c, _ in group})
        lines += [f"MISS x{len(group)} ({', '.join(kernels)}), e.g. {group[0][0].label}",
                  "  " + group[0][1].replace("\n", "\n  ")]
    return "\n".join(lines)
