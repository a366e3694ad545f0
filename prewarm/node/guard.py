"""Guard: in a serving process, every Triton compile that the cache does not cover is seen, explained and recorded.

Enabled by the environment (the pre-launch job exports it; ``prewarm guard -- COMMAND`` puts the hook-installing
sitecustomize of :mod:`prewarm.planning.record` on PYTHONPATH, so every Python process of the server, children included,
installs it right after ``import triton``):

    PREWARM_GUARD=warn|error      off when unset
    PREWARM_GUARD_RECORD=FILE     uncovered requests are appended here, as `prewarm record` lines: a manifest
                                  including it (``[[kernels]] record = "FILE"``) makes the next build cover them
    PREWARM_GUARD_PLAN=MANIFEST   explain each against this plan (nearest planned compile, what differs), and
                                  run each kernel its autotune table pins ([[pinned]]) in that config alone
    PREWARM_GUARD_ARM=import|manual   import (default): from the start; manual: from ``prewarm.node.guard.arm()``,
                                  the one line a server calls after its own warmup
    PREWARM_METRICS_TEXTFILE=FILE.prom   compiles and autotune benchmarks after arming, per kernel, and the
                                  installed bundles, for node-exporter's textfile collector (:mod:`prewarm.node.metrics`)

It sits on the compile path only: Triton's ``jit_cache_hook`` (called when a request misses the in-memory kernel
cache, so the launch path of a loaded kernel is untouched) notes the request, and the cache manager's group lookup
in ``compile()`` (Triton's own lookup: the entry with its metadata file = a disk hit) decides. A disk hit goes on
unremarked; otherwise the request is logged on stderr with its explanation and appended to the record file, and in
``error`` mode :class:`UncoveredCompile` is raised there, before the compiler starts. An autotune benchmark (an
Autotuner about to time its configs because the cache holds no result it reads for the call's tuning key) is
treated the same way, from Triton's own benchmarking (:func:`prewarm.building.tritoncompat.watch_autotune_benchmarks`, on
triton-ascend 3.2 too): logged with the kernel, the tuning key, the config count and the result file it lacked,
appended to the record file as an ``"event": "autotune"`` line (no compile to replay: the build's autotune table
covers it), counted (:func:`autotune_benchmarked`), refused in error mode (:class:`UncoveredBenchmark`) before the
first config runs. With PREWARM_GUARD_PLAN, the guard also gives each kernel pinned in that manifest's autotune table
(``[[pinned]]``) its pinned config alone before its Autotuner's first call (:mod:`prewarm.building.autotune`): it never
benchmarks, where Triton keeps no results (triton-ascend 3.2) as elsewhere.
Builds past Triton are treated the same way: once the server imports a JIT library (sglang's ``load_jit`` layer,
FlashInfer's JIT core), its build step is hooked (:mod:`prewarm.jit`, ``watch_builds``): a module the library's own
cache lookup missed is logged before it builds (sglang's nvcc, FlashInfer's ninja), appended to the record file as an
``"event": "jit"`` line, counted (``prewarm_guard_jit_builds_total``) and refused in error mode
(:class:`UncoveredJitBuild`).
Installing the guard also starts, in a background thread, the one-time work Triton otherwise does at a process's first
kernel launch, i.e. in the first request (its own key: hashing libtriton; the modules its
specializer imports): :func:`prewarm.building.tritoncompat.start_process_warmup`. On triton-ascend, arming also checks the
process's Ascend codegen env vars, which the key misses, against the installed bundles' build
(:func:`prewarm.building.backends.npu.check_serving_env`: error mode refuses to serve). With PREWARM_GUARD_PLAN, arming also
checks that this process's Triton reads a dir a bundle was installed or built into, wherever the server's own import
left TRITON_CACHE_DIR (:func:`prewarm.node.serverenv.check_serving_process`: error mode refuses to serve).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from . import metrics

MODE, RECORD, PLAN, ARM = "PREWARM_GUARD", "PREWARM_GUARD_RECORD", "PREWARM_GUARD_PLAN", "PREWARM_GUARD_ARM"
MODES, ARMS = ("warn", "error"), ("import", "manual")


class UncoveredCompile(RuntimeError):
    """Raised by the guard in error mode, before Triton compiles a request the cache does not hold."""

    def __init__(self, kernel: str, explanation: str):
        super().__init__(f"prewarm guard: {kernel} is not in the cache and would compile here: {explanation}")
        self.kernel, self.explanation = kernel, explanation


class UncoveredBenchmark(UncoveredCompile):
    """Raised by the guard in error mode, before an Autotuner benchmarks a call the cache holds no result for."""

    def __init__(self, kernel: str, explanation: str):
        RuntimeError.__init__(self, f"prewarm guard: {kernel} has no autotune result in the cache and would "
                                    f"benchmark here: {explanation}")
        self.kernel, self.explanation = kernel, explanation


class UncoveredJitBuild(UncoveredCompile):
    """Raised by the guard in error mode, before a library builds a module past Triton the node lacks (an sglang JIT
    module, a FlashInfer module)."""

    def __init__(self, module: str, explanation: str):
        RuntimeError.__init__(self, f"prewarm guard: {module} is not in the installed cache and would be built "
                                    f"here: {explanation}")
        self.kernel, self.explanation = module, explanation


class _Guard:
    def __init__(self, mode: str, record: str | None, plan: str | None):
        self.mode, self.record, self.plan = mode, record, plan
        self.armed = False
        self.pending = threading.local()  # the request Triton is about to look up in the cache (this thread)
        self.planned = None  # the plan's compiles, expanded at the first uncovered request

    def hook(self, previous):
        """The jit_cache_hook: notes the request (its lookup follows in compile()), chains to the previous hook."""

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            if self.armed:
                self.pending.request = (fn, compile)
            if previous is not None:
                return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled)  # fmt: skip
            return False

        return hook

    def take_request(self):
        """The (fn, compile) the jit_cache_hook noted for the lookup now running in this thread, or None."""
        request, self.pending.request = getattr(self.pending, "request", None), None
        return request

    def note(self, line: dict) -> None:
        """Append ``line`` to the record file, if one is set; a failure is said and the server goes on (the log line
        the caller prints still says what happened)."""
        from ..planning.record import append

        if not self.record:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.record)), exist_ok=True)
            append(self.record, line)
        except OSError as e:
            print(f"prewarm guard: cannot append to {self.record}: {e}", file=sys.stderr)

    def uncovered(self, key: str, filename: str, fn_compile) -> None:
        """Triton is about to compile: log it with its explanation, record it, and in error mode refuse it."""
        from ..building import tritoncompat
        from ..planning.record import request_entry

        cache_dir = tritoncompat.cache_dir()
        why = f"no {filename} under {key} in {cache_dir}"
        if fn_compile is None:  # not through the JIT (a direct compile() call): nothing to explain or record
            kernel, explanation, entry = filename.removesuffix(".json"), "not a JIT request: not explained", None
        else:
            entry = request_entry(*fn_compile)
            kernel = entry["kernel"]
            explanation = self.explain(kernel, entry["specialization_data"], cache_dir, key)
        if entry is not None:
            self.note({**entry, "guard": explanation})
        doing = "refusing to compile" if self.mode == "error" else "compiling"
        print(f"prewarm guard: {doing} {kernel}: {why}; {explanation}", file=sys.stderr)
        metrics.count(metrics.COMPILES, kernel)
        if self.mode == "error":
            raise UncoveredCompile(kernel, explanation)

    def benchmark(self, tuner, args: tuple, kwargs: dict) -> None:
        """An Autotuner of this process is about to benchmark its configs for one call (Triton's own benchmarking,
        hooked): log it with what was missing, record it, count it, and in error mode refuse it."""
        from ..building import tritoncompat
        from ..planning.record import AUTOTUNE_EVENT

        lookup, self.pending.autotune = getattr(self.pending, "autotune", None), None
        if not self.armed:
            return
        kernel = tritoncompat.kernel_ref(tuner)
        try:
            tuning = tritoncompat.tuning_of(tuner, args, kwargs)
            tuning_key, configs = str(tuning.key), len(tuning.configs)
        except Exception as e:  # said, never in the server's way
            tuning_key, configs = f"unknown ({type(e).__name__}: {e})", len(tuner.configs)
        if tritoncompat.keeps_results(tuner) and lookup is not None:
            key, filename = lookup
            why = f"no {filename} under {key} in {tritoncompat.cache_dir()}"
        elif not tritoncompat.can_keep_results(tuner):
            key, why = None, (f"not pinned, and this Triton keeps no autotune results (triton-ascend 3.2: no "
                              f"cache_results): it benchmarks in every process; pin it ([[pinned]] in the autotune "
                              f"table of the manifest {PLAN} names)")
        else:
            key, why = None, ("this Autotuner keeps no results (no cache_results, TRITON_CACHE_AUTOTUNING unset "
                              "when its module was imported): it benchmarks in every process")
        what = f"{why}; tuning key {tuning_key}, {configs} configs"
        self.note({"event": AUTOTUNE_EVENT, "kernel": kernel, "tuning_key": tuning_key, "configs": configs, "key": key,
                   "pid": os.getpid(), "guard": why})
        doing = "refusing to benchmark" if self.mode == "error" else "benchmarking"
        print(f"prewarm guard: {doing} {kernel}: {what}", file=sys.stderr)
        autotune_benchmarked(kernel)
        if self.mode == "error":
            raise UncoveredBenchmark(kernel, what)

    def jit_build(self, library: str, module: str, detail: str) -> None:
        """A library of this process is about to build a module past Triton (its own cache lookup missed): log it,
        record it, count it, and in error mode refuse it. Before arming (the server's own warmup) it goes on
        unremarked, as a Triton compile does."""
        from ..planning.record import JIT_EVENT

        if not self.armed:
            return
        name = f"{library}:{module}"
        self.note({"event": JIT_EVENT, "library": library, "module": module, "pid": os.getpid(), "guard": detail})
        doing = "refusing to build" if self.mode == "error" else "building"
        print(f"prewarm guard: {doing} {name}: {detail}", file=sys.stderr)
        metrics.count(metrics.JIT_BUILDS, name)
        if self.mode == "error":
            raise UncoveredJitBuild(name, detail)

    def explain(self, kernel: str, data: str, cache_dir: str, key: str) -> str:
        """The nearest planned compile and what differs; a planned request missing from the cache is explained
        against the cache's entries instead (env vars, a deleted entry...)."""
        from .explain import explain, explain_miss
        from ..planning.plan import Compile

        if not self.plan:
            return f"not planned (no {PLAN} to explain it against)"
        try:
            planned = self.planned_compiles()
        except Exception as e:
            return f"not explained: the plan {self.plan} could not be expanded ({e})"
        e = explain(data, planned, kernel=kernel)
        if not e.planned:
            return e.summary()
        missing = explain_miss(Compile(e.nearest.request, kernel, e.nearest.label, data), cache_dir, key,
                               sides=("cache", "this process"))
        return f"planned as {e.nearest.label!r} but not in the cache: {missing.summary()}"

    def planned_compiles(self):
        """The plan's compiles, expanded once, in a separate process: the planner imports providers and activates
        a target driver, which a serving process must not have done to it. The offline target: the same requests,
        and the device is left to the server."""
        from ..errors import WillFailError
        from ..planning.plan import Compile

        if self.planned is None:
            env = {k: v for k, v in os.environ.items() if k not in (MODE, "PREWARM_RECORD_FILE", "TRITON_CACHE_MANAGER")}
            done = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", "--compiles", "--json", "--mode",
                                   "offline", self.plan], capture_output=True, text=True, env=env)
            if done.returncode not in (0, WillFailError.exit_code):  # will-fail: the compiles are still listed
                raise RuntimeError((done.stderr.strip().splitlines() or ["no message"])[-1])
            doc = json.loads(done.stdout)
            self.planned = [Compile(c["request"], c["kernel"], c["label"], c["specialization_data"])
                            for c in doc["compiles"]]  # fmt: skip
        return self.planned


_guard: _Guard | None = None


def _watched(base: type) -> type:
    """``base`` (the cache manager Triton uses) with its group lookup watched: compile() asks ``get_group`` for the
    entry and compiles when it lacks the metadata file. That very lookup decides; nothing is computed twice."""

    class GuardedCacheManager(base):
        def get_group(self, filename):
            group = super().get_group(filename)
            if _guard is not None and _guard.armed:
                request = _guard.take_request()  # this lookup's request, hit or miss
                if group is None or filename not in group:
                    _guard.uncovered(self.key, filename, request)
            return group

        def get_file(self, filename):
            path = super().get_file(filename)
            if _guard is not None and path is None and filename.endswith(".autotune.json"):
                _guard.pending.autotune = (self.key, filename)  # an Autotuner's lookup: it benchmarks next
            return path

    GuardedCacheManager.__qualname__ = "GuardedCacheManager"
    return GuardedCacheManager


def __getattr__(name: str):
    """``prewarm.node.guard:GuardedCacheManager``, as triton 3.2 imports TRITON_CACHE_MANAGER (a child process inherits
    the variable; the class is made once triton is there, and watches nothing where no guard is installed)."""
    if name == "GuardedCacheManager":
        from triton.runtime.cache import FileCacheManager

        globals()[name] = cls = _watched(FileCacheManager)
        return cls
    raise AttributeError(name)


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
    from ..planning.record import when_imported

    settings = _settings()
    if settings is None:
        return
    mode, record, plan, arm = settings
    when_imported("triton", lambda: _install(mode, record, plan, armed=arm == "import"))


def _install(mode: str, record: str | None, plan: str | None, armed: bool) -> None:
    global _guard
    from ..building import tritoncompat

    if _guard is None:
        _guard = _Guard(mode, record, plan)
        current = tritoncompat.cache_manager_class()  # 3.4+: a custom one is kept
        # (3.2 imports TRITON_CACHE_MANAGER by name)
        manager = _watched(current) if current else __getattr__("GuardedCacheManager")
        tritoncompat.set_cache_manager(manager)
        tritoncompat.set_jit_cache_hook(_guard.hook(tritoncompat.get_jit_cache_hook()))
        tritoncompat.watch_autotune_benchmarks(_guard.benchmark)
        _pin_autotuners(plan)
        _watch_jit_builds(_guard)
        tritoncompat.start_process_warmup()  # off the first request's path: not a compile, but it stalls one
        if metrics.textfile():
            metrics.installed_bundles(tritoncompat.cache_dir())
    if armed and not _guard.armed and tritoncompat.triton_distribution()[0] == "triton-ascend":
        from ..building.backends.npu import check_serving_env  # codegen env vars the key misses: refused (error) or said

        check_serving_env(mode)
    if armed and not _guard.armed and plan:  # guarding a planned node: its Triton must read the installed cache
        from .serverenv import check_serving_process

        check_serving_process(mode)
    _guard.armed = _guard.armed or armed


def _watch_jit_builds(guard: _Guard) -> None:
    """Each JIT library's build step hooked (prewarm.jit: ``watch_builds``) once the module it lives in is imported
    by the server: a process that never imports the library never imports it for the guard."""
    from .. import jit
    from ..planning.record import when_imported

    for name in jit.library_names():
        lib = jit.library(name)
        when_imported(lib.hook_module, lambda lib=lib: lib.watch_builds(
            lambda module, detail, library=lib.name: guard.jit_build(library, module, detail)))


def _pin_autotuners(plan: str | None) -> None:
    """Give every pinned kernel's Autotuner its pinned config alone, before its first call (armed or not: a
    server's own warmup would benchmark too): the ``[[pinned]]`` rows of the autotune table that the plan's
    manifest names (``[target] tuned``), for its device. A table that cannot be read is said, not fatal: the
    Autotuners then benchmark, which the guard counts (and refuses in error mode)."""
    from ..building import tritoncompat

    if not plan:
        return
    try:
        from ..planning.manifest import load
        from ..planning.pins import pin_chooser
        from ..planning.plan import manifest_pins

        pins = manifest_pins(load(plan))
    except Exception as e:
        print(f"prewarm guard: no autotune pins from {plan}: {e}", file=sys.stderr)
        return
    if pins:
        tritoncompat.pin_autotuners(pin_chooser(pins))


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


def armed() -> bool:
    """Whether this process is guarded now (installed from its environment, and armed)."""
    return _guard is not None and _guard.armed


def autotune_benchmarked(kernel: str) -> None:
    """An autotuner benchmarks ``kernel``'s ("module:qualname") configs in this process: counted in the metrics
    once the guard is armed. The autotune-benchmark detection calls this."""
    if _guard is not None and _guard.armed:
        metrics.count(metrics.BENCHMARKS, kernel)
