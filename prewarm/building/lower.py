"""Lower: take every planned compile through triton-ascend's real front end, on a machine without an NPU.

Ascend is the primary target and CI has neither NPU nor CANN. What can run here does: each compile the plan
makes (bound and specialized by Triton's own JIT, through a target-only driver) goes through the same stages
``triton.compiler.compile`` runs, in order, until the first one that needs CANN:

    ast (ast_to_ttir) -> ttir (make_ttir) -> ttadapter (ttir_to_linalg, the bundled triton-adapter-opt)

The next stage (``npubin``: CANN's bishengir-compile, and the device's SoC) is the NPU build's job. A failure
names the kernel, the variant and the stage's own message. A kernel whose key this triton-ascend cannot compute
(``plan.WillFail``: its source names what this Triton lacks) is not lowered: it is the report's ``will_fail``, each
with its file and line, reason, what the node does and the fix. Each compile also reports the cache key dir the
runtime on an ``arch`` node would look up (same computation as ``compile``), and an estimate of its on-chip
unified-buffer (UB) footprint from the linalg: an autotuned kernel's config (pinned or not) that the estimate says
cannot fit the SoC's UB fails here (stage "ub"), not on a node, since a smaller config can be pinned. A kernel that is
not autotuned runs the one config its library chose, so there is nothing to pin: over the budget it is a warning
(``LoweredCompile.ub_unconfirmed``), since the estimate is an upper bound (every buffer live at once, no reuse) and
only a node's ``bishengir-compile`` can tell whether it fits. A compile two requests make is lowered once.
"""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field

from ..planning import plan as planning
from . import tritoncompat
from .backends import npu
from ..errors import EnvironmentProblem
from ..planning.manifest import Manifest

STAGES = tritoncompat.ASCEND_FRONT_END  # what runs without CANN, in compile()'s order
UB_STAGE = "ub"  # the footprint check after the last stage

# Local buffers in triton-adapter's linalg: loads land in memref.alloc'd buffers, results in tensor.empty ones.
_LOCAL_BUFFER = re.compile(r"(memref\.alloc\(\)|tensor\.empty\(\))\s*:\s*(?:memref|tensor)<([^>]*)>")
_ELEMENT_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def ub_estimate(linalg: str, multibuffer: bool) -> int:
    """Bytes of UB the kernel's linalg asks for, as an upper-bound estimate: every local buffer live at once (no
    reuse by bishengir), loaded buffers doubled where ``multibuffer`` (NPUOptions' default: loads double-buffered);
    buffers of a dynamic shape are not counted (none in pinned configs)."""
    total = 0
    for op, ty in _LOCAL_BUFFER.findall(linalg):
        *dims, element = ty.split(",")[0].split("x")
        if not all(d.isdigit() for d in dims):
            continue
        size = _ELEMENT_BYTES.get(element, 4)
        for d in dims:
            size *= int(d)
        total += size * (2 if multibuffer and op.startswith("memref") else 1)
    return total


@dataclass
class LoweredCompile:
    """One compile request taken through the front end."""

    kernel: str
    label: str
    request: str  # Request.ident
    cache_key: str = ""  # the key dir under TRITON_CACHE_DIR the runtime would use on the target
    ub_bytes: int | None = None  # ub_estimate of the linalg (None: the front end did not reach it)
    stage_ms: dict[str, float] = field(default_factory=dict)  # stages that completed, in order
    failed_stage: str | None = None  # "bind" (plan/JIT binding) or one of STAGES
    error: str | None = None
    crashed: str | None = None  # a stage's tool died by a signal on the first try and the retry lowered (its words)
    ub_unconfirmed: str | None = None  # not autotuned and over the UB estimate: the warning (lowered, not failed)

    @property
    def ok(self) -> bool:
        return self.failed_stage is None

    def failure(self) -> str:
        return f"{self.kernel} variant {self.label!r}: stage {self.failed_stage} failed: {self.error}"


@dataclass
class LowerReport:
    manifest: str
    arch: str
    triton: str  # "triton-ascend 3.2.0"
    compiles: list[LoweredCompile]
    requests: int
    ub_size: int  # bytes of unified buffer per core on ``arch`` (npu.ub_size)
    will_fail: list[planning.WillFail] = field(default_factory=list)  # kernels this Triton cannot key: not lowered

    @property
    def lowered(self) -> int:
        return sum(c.ok for c in self.compiles)

    @property
    def failed(self) -> list[LoweredCompile]:
        return [c for c in self.compiles if not c.ok]

    @property
    def warnings(self) -> list[str]:
        """One line per kernel whose fixed config's UB estimate exceeds the budget: unconfirmed, not failed."""
        return list(dict.fromkeys(c.ub_unconfirmed for c in self.compiles if c.ub_unconfirmed))

    def to_json(self) -> dict:
        return {
            "manifest": self.manifest, "arch": self.arch, "triton": self.triton, "requests": self.requests,
            "ub_size": self.ub_size, "lowered": self.lowered, "failed": len(self.failed), "stages": list(STAGES),
            "compiles": [{**asdict(c), "ok": c.ok} for c in self.compiles],
            "warnings": self.warnings,
            "will_fail": [w.to_json() for w in self.will_fail],
        }  # fmt: skip


def _message(e: BaseException) -> str:
    """The stage's own words: triton-adapter-opt's stderr, or the front end's error."""
    if isinstance(e, subprocess.CalledProcessError):
        text = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return text.strip() or f"{e.cmd[0]} exited with {e.returncode}"
    return f"{type(e).__name__}: {e}".strip()


def _run_stage(step, module, out: LoweredCompile):
    """One front-end stage; a stage tool killed by a signal is run once more. triton-ascend 3.2.0's
    triton-adapter-opt aborts now and then (``malloc(): corrupted top size``) on an input it lowers on the next try:
    that is the toolchain's flakiness, not the plan's, and it is reported (``crashed``), not hidden."""
    try:
        return step(module)
    except subprocess.CalledProcessError as e:
        if e.returncode >= 0 or out.crashed is not None:
            raise
        out.crashed = (_message(e).splitlines() or [f"signal {-e.returncode}"])[0]
        return step(module)


def lower_compile(c: planning.Compile, arch: str) -> LoweredCompile:
    """Run ``compile()``'s stages up to ``ttadapter`` on exactly what ``preload(c.specialization)`` compiles, then
    check its UB estimate against ``arch``'s UB."""
    out = LoweredCompile(c.kernel, c.label, c.request)
    jit = tritoncompat.jit_function(planning.resolve(c.kernel))
    with tritoncompat.ascend_front_end(jit, c.specialization, npu.NpuOfflineDriver(arch).target) as front:
        out.cache_key = front.key_dir
        module = None
        for name, step in front.steps:
            start = time.perf_counter()
            try:
                module = _run_stage(step, module, out)
            except Exception as e:
                out.failed_stage, out.error = name, _message(e)
                return out
            out.stage_ms[name] = round((time.perf_counter() - start) * 1000, 2)
    if "ttadapter" in out.stage_ms:  # (simt_only kernels: no linalg, no estimate)
        out.ub_bytes = ub_estimate(str(module), bool(getattr(front.options, "multibuffer", False)))
        budget = npu.ub_size(arch)
        if out.ub_bytes > budget and tritoncompat.find_autotuner(planning.resolve(c.kernel)) is None:
            out.ub_unconfirmed = (f"{c.kernel}: estimated on-chip buffer footprint {out.ub_bytes / 1024:.0f} KB "
                                  f"exceeds {arch}'s {budget // 1024} KB unified buffer in the one config its "
                                  f"library chose (not autotuned: nothing to pin); the estimate is an upper bound "
                                  f"(no buffer reuse), unconfirmed: only a node's bishengir-compile can tell")
        elif out.ub_bytes > budget:
            out.failed_stage = UB_STAGE
            out.error = (f"estimated on-chip buffer footprint {out.ub_bytes / 1024:.0f} KB exceeds {arch}'s "
                         f"{budget // 1024} KB unified buffer: this config cannot fit; pin smaller blocks")
    return out


def lower(m: Manifest) -> LowerReport:
    """Plan ``m`` and take every distinct compile of every request through the front end (none stops the others),
    except the requests of a kernel this Triton cannot key (the report's ``will_fail``); an autotuned kernel the
    manifest's table pins is lowered in its pinned config alone, as the build compiles it."""

    if m.backend != "npu":
        raise EnvironmentProblem(f"{m.path}: target.backend is {m.backend!r}: lower checks the Ascend (npu) "
                                 f"front end only")
    npu.activate_offline(m.arch, planning.manifest_device(m))  # before planning: triton 3.2 binds @autotune to it
    the_plan = planning.plan(m)
    requests, will_fail = planning.set_apart_will_fail(the_plan.requests)
    pins = planning.manifest_pins(m)
    dist, version = tritoncompat.triton_distribution()
    compiles: list[LoweredCompile] = []
    seen: set[tuple[str, str]] = set()  # (kernel, on-disk specialization): a compile two requests make, lowered once
    for req in requests:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # triton-ascend prints advice on every bind
                planned = planning.expand(req, pins)
        except Exception as e:
            compiles.append(LoweredCompile(req.kernel, req.label, req.ident, failed_stage="bind", error=_message(e)))
            continue
        for c in planned:
            same = (c.kernel, tritoncompat.on_disk(c.specialization))
            if same not in seen:
                seen.add(same)
                compiles.append(lower_compile(c, m.arch))
    return LowerReport(str(m.path), m.arch, f"{dist} {version}", compiles, len(the_plan.requests), npu.ub_size(m.arch),
                       will_fail)
