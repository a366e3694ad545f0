"""Guard: in a serving process, every Triton compile that the cache does not cover is seen, explained and recorded.

Enabled by the environment (the pre-launch job exports it; ``prewarm guard -- COMMAND`` puts the hook-installing
sitecustomize of :mod:`prewarm.record` on PYTHONPATH, so every Python process of the server, children included,
installs it right after ``import triton``):

    PREWARM_GUARD=warn|error      off when unset
    PREWARM_GUARD_RECORD=FILE     uncovered requests are appended here, as `prewarm record` lines: a manifest
                                  including it (``[[kernels]] record = "FILE"``) makes the next build cover them
    PREWARM_GUARD_PLAN=MANIFEST   explain each against this plan (nearest planned compile, what differs)
    PREWARM_GUARD_ARM=import|manual   import (default): from the start; manual: from ``prewarm.guard.arm()``,
                                  the one line a server calls after its own warmup

It hooks Triton's ``jit_cache_hook``, which fires only when a request misses the in-memory kernel cache: the
launch path of an already loaded kernel is untouched. For each such request the key is computed by Triton itself
and looked up as the runtime will (:func:`prewarm.willhit.lookup`); a disk hit goes on unremarked. Anything else
is logged on stderr with its explanation and appended to the record file; in ``error`` mode
:class:`UncoveredCompile` is raised before the compiler starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

MODE, RECORD, PLAN, ARM = "PREWARM_GUARD", "PREWARM_GUARD_RECORD", "PREWARM_GUARD_PLAN", "PREWARM_GUARD_ARM"
MODES, ARMS = ("warn", "error"), ("import", "manual")


class UncoveredCompile(RuntimeError):
    """Raised by the guard in error mode, before Triton compiles a request the cache does not hold."""

    def __init__(self, kernel: str, explanation: str):
        super().__init__(f"prewarm guard: {kernel} is not in the cache and would compile here: {explanation}")
        self.kernel, self.explanation = kernel, explanation


class _Guard:
    def __init__(self, mode: str, record: str | None, plan: str | None):
        self.mode, self.record, self.plan = mode, record, plan
        self.armed = False
        self.local = threading.local()  # set while the guard's own lookup runs (it re-enters the hook)
        self.planned = None  # the plan's compiles, expanded at the first uncovered request

    def hook(self, previous):
        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            if getattr(self.local, "busy", False):
                return False  # the guard's own lookup: let it reach the cache probe
            if self.armed:
                self.check(fn, compile)
            if previous is not None:
                return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled)  # fmt: skip
            return False

        return hook

    def check(self, fn, compile: dict) -> None:
        from . import tritoncompat
        from .record import append, request_entry
        from .willhit import ProbeCacheManager, entry_state, lookup

        data = compile["specialization_data"]
        cache_dir = tritoncompat.cache_dir()
        self.local.busy = True
        try:
            with tritoncompat.cache_scope(os.path.abspath(cache_dir), ProbeCacheManager):
                found = lookup(fn.jit_function, data)
        except Exception as e:  # the runtime will fail on the same request; not the guard's to report
            print(f"prewarm guard: cannot compute the cache key of {fn.module}:{fn.name}: {e}", file=sys.stderr)
            return
        finally:
            self.local.busy = False
        if found is None:
            return
        hit, why = entry_state(cache_dir, found.key, found.filename)
        if hit:
            return
        entry = request_entry(fn, compile)
        explanation = self.explain(entry["kernel"], data, cache_dir, found.key)
        if self.record:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.record)), exist_ok=True)
                append(self.record, {**entry, "guard": explanation})
            except OSError as e:  # the server goes on; the log line below still says what compiled
                print(f"prewarm guard: cannot append to {self.record}: {e}", file=sys.stderr)
        doing = "refusing to compile" if self.mode == "error" else "compiling"
        print(f"prewarm guard: {doing} {entry['kernel']}: {why}; {explanation}", file=sys.stderr)
        if self.mode == "error":
            raise UncoveredCompile(entry["kernel"], explanation)

    def explain(self, kernel: str, data: str, cache_dir: str, key: str) -> str:
        """The nearest planned compile and what differs; a planned request missing from the cache is explained
        against the cache's entries instead (env vars, a deleted entry...)."""
        from .explain import explain, explain_miss
        from .plan import Compile

        if not self.plan:
            return f"not planned (no {PLAN} to explain it against)"
        try:
            planned = self.planned_compiles()
        except Exception as e:
            return f"not explained: the plan {self.plan} could not be expanded ({e})"
        e = explain(data, planned, kernel=kernel)
        if not e.planned:
            return e.summary()
        missing = explain_miss(Compile(e.nearest.request, kernel, e.nearest.label, data), cache_dir, key)
        return f"planned as {e.nearest.label!r} but not in the cache: {missing.summary()}"

    def planned_compiles(self):
        """The plan's compiles, expanded once, in a separate process: the planner imports providers and activates
        a target driver, which a serving process must not have done to it."""
        from .manifest import load
        from .plan import Compile

        if self.planned is None:
            mode = "offline" if load(self.plan).backend == "cuda" else "auto"
            env = {k: v for k, v in os.environ.items() if k not in (MODE, "PREWARM_RECORD_FILE")}
            done = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", "--compiles", "--json", "--mode", mode,
                                   self.plan], capture_output=True, text=True, env=env)
            if done.returncode:
                raise RuntimeError((done.stderr.strip().splitlines() or ["no message"])[-1])
            doc = json.loads(done.stdout)
            self.planned = [Compile(c["request"], c["kernel"], c["label"], c["specialization_data"])
                            for c in doc["compiles"]]  # fmt: skip
        return self.planned


_guard: _Guard | None = None


def _settings() -> tuple[str, str | None, str | None, str] | None:
    mode = os.environ.get(MODE, "").strip().lower()
    if mode in ("", "off", "0"):
        return None
    arm = os.environ.get(ARM, "import").strip().lower()
    for name, value, allowed in ((MODE, mode, MODES), (ARM, arm, ARMS)):
        if value not in allowed:
            print(f"prewarm guard: {name}={value!r} is not one of {', '.join(allowed)}: the guard is off",
                  file=sys.stderr)
            return None
    return mode, os.environ.get(RECORD) or None, os.environ.get(PLAN) or None, arm


def install_from_env() -> None:
    """From the injected sitecustomize: install the guard when triton is imported; arm it then unless manual."""
    from .record import when_triton_imported

    settings = _settings()
    if settings is None:
        return
    mode, record, plan, arm = settings
    when_triton_imported(lambda: _install(mode, record, plan, armed=arm == "import"))


def _install(mode: str, record: str | None, plan: str | None, armed: bool) -> None:
    global _guard
    from . import tritoncompat

    if _guard is None:
        _guard = _Guard(mode, record, plan)
        tritoncompat.set_jit_cache_hook(_guard.hook(tritoncompat.get_jit_cache_hook()))
    _guard.armed = _guard.armed or armed


def arm() -> bool:
    """Start guarding now: the one line a server calls after its own warmup (with PREWARM_GUARD_ARM=manual).
    Installs the guard first if the process was not started with the hook (the environment still decides whether
    it is on). Returns whether the guard is armed."""
    settings = _settings()
    if settings is None:
        return False
    mode, record, plan, _ = settings
    _install(mode, record, plan, armed=True)
    return True
