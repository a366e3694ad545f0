"""Record: run any command and log every Triton compile request it makes, child processes included.

The command runs with a ``sitecustomize.py`` first on PYTHONPATH, so every Python process it starts installs
the JIT cache hook (3.4+: ``knobs.runtime.jit_cache_hook``; 3.2: ``JITFunction.cache_hook``) the moment it
imports triton. The hook appends one JSON line per request (kernel "module:qualname" + the specialization data
``JITFunction.preload`` takes) to the output file under a file lock, and never changes what Triton does. Each line
also carries the on-disk key this process's Triton computes for the request, what that key is made of (Triton's
own parts: :func:`prewarm.building.tritoncompat.cache_key_parts`) and the device it ran on, so a build elsewhere can check
that it reproduces the key (:mod:`prewarm.building.keys`) and plan as that device. A manifest includes the file with
``record = "FILE"``; build replays it. :func:`read` is the one reader of the format.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EnvironmentProblem, ManifestError

ENV = "PREWARM_RECORD_FILE"

_SITECUSTOMIZE = '''\
"""Put first on PYTHONPATH by `prewarm record` / `prewarm guard`: installs the hooks the environment asks for
(PREWARM_RECORD_FILE, PREWARM_GUARD), then runs the sitecustomize this one shadows."""
import importlib.machinery, importlib.util, os, sys

for _env, _module in (("PREWARM_RECORD_FILE", "prewarm.planning.record"), ("PREWARM_GUARD", "prewarm.node.guard")):
    if os.environ.get(_env):
        try:
            importlib.import_module(_module).install_from_env()
        except ImportError as e:
            print(f"{_module}: {sys.executable} cannot import prewarm ({e}); its compiles are not seen",
                  file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


@dataclass
class RecordResult:
    output: str
    returncode: int
    lines: int  # compile requests logged (every process, repeats included)
    unique: int  # distinct requests (what a build replays)

    def to_json(self) -> dict:
        return {"output": self.output, "returncode": self.returncode, "lines": self.lines, "unique": self.unique}


def record(output: str | os.PathLike, command: list[str]) -> RecordResult:
    """Run ``command`` with the hook on; ``output`` is truncated first."""
    if not command:
        raise ManifestError("record: no command given: expected `prewarm record -o FILE -- COMMAND ...`")
    out = Path(output).resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")
    except OSError as e:
        raise EnvironmentProblem(f"record -o {output}: cannot write it: {e.strerror}") from e
    env = {**os.environ, ENV: str(out), "PYTHONPATH": hooked_pythonpath()}
    try:
        returncode = subprocess.call(command, env=env)
    except OSError as e:
        raise EnvironmentProblem(f"record: cannot run {command[0]!r}: {e.strerror}") from e
    lines = read(out)
    return RecordResult(str(out), returncode, len(lines), len({(line.kernel, line.specialization) for line in lines}))


def hooked_pythonpath() -> str:
    """PYTHONPATH with the hook-installing sitecustomize first: every Python process started with it (children
    too) installs the hooks its environment asks for. The file lives in a dir named by its content, made once per
    user (a command may be exec'd with it, so it outlives this process)."""
    import hashlib

    digest = hashlib.sha256(_SITECUSTOMIZE.encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prewarm"
    site = base / f"site-{digest}"
    try:
        if (site / "sitecustomize.py").read_text() != _SITECUSTOMIZE:
            raise FileNotFoundError
    except OSError:
        try:
            base.mkdir(parents=True, exist_ok=True)
            fresh = Path(tempfile.mkdtemp(prefix=".site-", dir=base))
        except OSError:  # no writable home (a read-only container): a private temp dir, kept
            fresh = Path(tempfile.mkdtemp(prefix="prewarm-site-"))
            site = fresh
        (fresh / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        if fresh != site:
            try:
                os.rename(fresh, site)  # atomic; another process may have made it first: then use that one
            except OSError:
                shutil.rmtree(fresh, ignore_errors=True)
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)


def request_entry(fn, compile: dict) -> dict:
    """One compile request as a record line holds it: kernel "module:qualname" + ``preload``'s data, and what this
    process knows of its key and device (:func:`observed`)."""
    entry = {"kernel": f"{fn.module}:{fn.name}", "specialization_data": compile["specialization_data"],
             "pid": os.getpid()}  # fmt: skip
    return {**entry, **observed(fn.jit_function, compile)}


def observed(jit, compile: dict) -> dict:
    """``key`` (the dir this process's Triton looks the request up in), ``key_parts`` (what it made the key of) and
    ``device`` (what it runs on, :func:`prewarm.devices.observe`). Never raises: recording must not break the
    recorded process; a key that could not be computed is said (``key_error``), an unknown device left out."""
    from .. import devices
    from ..building import tritoncompat

    out: dict[str, Any] = {}
    try:
        out["key"], out["key_parts"] = tritoncompat.cache_key_parts(jit, compile["specialization_data"])
    except Exception as e:
        out["key_error"] = f"{type(e).__name__}: {e}"
    try:
        device = devices.observe(compile.get("device", 0))
    except Exception:
        device = None
    if device:
        out["device"] = device
    return out


AUTOTUNE_EVENT = "autotune"  # a guard record line's "event": an autotune benchmark, no compile request
JIT_EVENT = "jit"  # a guard record line's "event": a module past Triton built (prewarm.jit), no Triton request


@dataclass(frozen=True)
class RecordedKey:
    """The key a recorded process's Triton looked a request up under, and its parts as it computed them."""

    where: str  # "FILE:LINE" of the record line
    key: str | None  # the key dir (None: the process could not compute it, see ``error``)
    parts: dict  # tritoncompat.cache_key_parts' parts
    error: str = ""


@dataclass(frozen=True)
class RecordLine:
    """One line of a record file, checked: what older prewarm versions wrote (kernel + specialization data, an
    optional label) and what this one adds (key, device); ``key``/``device`` are None on older lines."""

    where: str  # "FILE:LINE"
    kernel: str  # "module:qualname"
    specialization: str  # the data JITFunction.preload takes
    label: str | None
    key: RecordedKey | None
    device: dict | None


def read(path: str | os.PathLike) -> list[RecordLine]:
    """Every request line of a record file, in order (blank lines skipped); a malformed line is a ManifestError
    naming file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read record file: {e.strerror}") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") in (AUTOTUNE_EVENT, JIT_EVENT):
                continue  # the guard's note of an autotune benchmark or a JIT build: no Triton compile to replay
            kernel, data = entry["kernel"], entry["specialization_data"]
            json.loads(data)["name"]
            key = entry.get("key")
            parts = entry.get("key_parts", {})
            device = entry.get("device")
            if not (key is None or isinstance(key, str)) or not isinstance(parts, dict) \
                    or not (device is None or isinstance(device, dict) and isinstance(device.get("name"), str)):
                raise TypeError("'key' must be a string, 'key_parts' an object, 'device' an object with a 'name'")
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(
                f"{where}: {line[:80]!r}: expected a JSON object with 'kernel' and 'specialization_data' "
                f"(a line written by `prewarm record`) ({e})"
            ) from e
        recorded = None
        if key is not None or "key_error" in entry:
            recorded = RecordedKey(where, key, parts, str(entry.get("key_error", "")))
        out.append(RecordLine(where, kernel, data, entry.get("label"), recorded, device))
    return out


def append(path: str, entry: dict) -> None:
    """Append one line to a record file, whole, under a file lock (every rank and child writes to it)."""
    from filelock import FileLock

    with FileLock(path + ".lock"), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def make_hook(path: str, previous=None):
    """A jit_cache_hook appending each request to ``path``; chains to an existing hook."""

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        append(path, request_entry(fn, compile))
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)  # fmt: skip
        return False

    return hook


def hook_this_process(path: str) -> None:
    """Log this process's compile requests to ``path`` from now on (triton must be importable)."""
    from ..building import tritoncompat

    tritoncompat.set_jit_cache_hook(make_hook(path, tritoncompat.get_jit_cache_hook()))


class _AfterImport:
    """A meta path finder that runs the queued installers of a module right after its import completes (not before:
    importing triton, or a JIT library, in every Python process the command starts would slow down and could break
    the ones that never use it). It stays on ``sys.meta_path`` until each such module is really imported: torch and
    fla first probe with ``importlib.util.find_spec("triton")``, which asks this finder too and then imports
    nothing."""

    def __init__(self):
        self.installers: dict[str, list] = {}  # module name -> installers to run once it is imported

    def find_spec(self, name, import_path=None, target=None):
        if name not in self.installers:
            return None
        spec = next((s for s in (f.find_spec(name, import_path, target) for f in sys.meta_path
                                 if f is not self and hasattr(f, "find_spec")) if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module, finder = spec.loader.exec_module, self

        def exec_then_install(module):
            exec_module(module)
            installers = finder.installers.pop(name, [])
            if not finder.installers and finder in sys.meta_path:
                sys.meta_path.remove(finder)
            for install_one in installers:
                install_one()

        spec.loader.exec_module = exec_then_install
        return spec


def when_imported(name: str, installer) -> None:
    """Run ``installer()`` now if module ``name`` is loaded, else right after it gets imported (one finder for every
    hook)."""
    if name in sys.modules:
        installer()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.installers.setdefault(name, []).append(installer)


def install_from_env() -> None:
    """Called from the injected sitecustomize: hook now if triton is loaded, else when it gets imported."""
    path = os.environ.get(ENV)
    if path:
        when_imported("triton", lambda: hook_this_process(path))
