"""The Triton cache dir a serving process really reads, as the server's own code leaves it (`verify --server`, and
the guard when it arms).

A server's own import can move it (what each server's does: its ``prewarm/providers/<server>/server.py``; sglang's
sets ``TRITON_CACHE_DIR`` where it is unset): a server started without the pre-launch job's environment then reads
none of the installed cache while verify of the installed dir says clean. So nothing here restates a server's rules:
:func:`server_cache_dirs` runs the module a server process imports first (its :attr:`Server.imports
<prewarm.providers.contract.Server.imports>`) in a child process with the server's environment and asks that
process's Triton where its cache is, and each JIT library whose modules were installed (prewarm.jit) where it reads
them. The other dirs the import set are reported, not judged. Inside a serving process the guard, when it arms,
checks the dir Triton reads there holds an install receipt or a build's info (:func:`check_serving_process`: a stat
and a listing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from ..errors import CacheDirMismatch, EnvironmentProblem

VARIABLE = "TRITON_CACHE_DIR"
_MARK = "prewarm-serverenv "

# run as `python -c _PROBE MODULE LIBRARIES`: the environment before and after the server's import, Triton's own
# answer, and each named JIT library's (prewarm.jit: the dir it reads its built modules from, after that import)
_PROBE = f"""
import json, os, sys
before = dict(os.environ)
__import__(sys.argv[1])
from prewarm import jit
from prewarm.building import tritoncompat
dirs = {{k: v for k, v in os.environ.items() if before.get(k) != v and os.path.isabs(v)}}
libs = {{name: str(jit.library(name).node_dir(os.environ)) for name in json.loads(sys.argv[2])}}
print({_MARK!r} + json.dumps({{"given": before.get({VARIABLE!r}), "triton": tritoncompat.cache_dir(), "set": dirs,
                               "jit": libs}}))
"""


def server_imports() -> dict[str, str]:
    """Server -> the module a process of it imports first, for each registered server whose import can be run here
    (prewarm.providers' registry): the servers ``verify --server`` can check."""
    from ..providers import servers

    return {name: s.imports for name, s in servers().items() if s.imports}


@dataclass
class ServerCacheDirs:
    """Where a process of ``server``, started with the environment the check ran in, reads Triton's cache."""

    server: str
    installed: str  # the cache dir the bundle was installed into and verified
    triton: str  # Triton's cache dir in that process, after the server's import
    given: str | None  # TRITON_CACHE_DIR in the environment it starts with (None: unset)
    set_by_import: dict[str, str]  # variables the server's import set to a path (its compilers' caches)
    jit_installed: dict[str, str] = field(default_factory=dict)  # JIT library -> the dir its modules were installed in
    jit: dict[str, str] = field(default_factory=dict)  # JIT library -> the dir it reads in that process

    @property
    def jit_wrong(self) -> list[str]:
        """The JIT libraries that would read another dir than their modules were installed in."""
        return [n for n, d in self.jit_installed.items() if os.path.realpath(self.jit[n]) != os.path.realpath(d)]

    @property
    def ok(self) -> bool:
        return os.path.realpath(self.triton) == os.path.realpath(self.installed) and not self.jit_wrong

    def summary(self) -> str:
        why = (f"{VARIABLE} unset" if self.given is None else f"{VARIABLE}={self.given}") + " in this environment"
        if VARIABLE in self.set_by_import:
            why += f"; `import {server_imports()[self.server]}` sets it"
        elif self.given is None:
            why += ": Triton's default"
        return f"a {self.server} server process started with this environment reads Triton's cache at {self.triton} " \
               f"({why})"

    def problem(self) -> str:
        from .. import jit

        wrong = []
        if os.path.realpath(self.triton) != os.path.realpath(self.installed):
            wrong.append(f"{self.summary()}, not {self.installed} where the bundle was installed and verified: set "
                         f"{VARIABLE}={self.installed} in the server's environment")
        for name in self.jit_wrong:
            lib = jit.library(name)
            wrong.append(f"its {name} reads built modules from {self.jit[name]}, not {self.jit_installed[name]} where "
                         f"the {lib.layout} bundle was installed: {lib.where_to_point(self.jit_installed[name])}")
        return "; ".join(wrong)


def server_cache_dirs(server: str, installed: str | os.PathLike, env: dict[str, str] | None = None,
                      jit_installed: dict[str, str] | None = None) -> ServerCacheDirs:
    """Run ``server``'s own import in a child process with ``env`` (default: this process's) and ask its Triton, and
    each JIT library of ``jit_installed`` (library -> the dir its modules were installed in), where they read."""
    from ..providers import server as server_named

    module = server_imports()[server]
    jit_installed = dict(jit_installed or {})
    unreached = [name for name in jit_installed if name not in server_named(server).jit_libraries]
    if unreached:
        raise EnvironmentProblem(f"--server {server}: a {server} process builds no {', '.join(unreached)} modules "
                                 f"(it reaches {', '.join(server_named(server).jit_libraries) or 'no JIT library'}): "
                                 "drop that --jit-dir")
    # a probe is never guarded: none of the guard's settings (PREWARM_GUARD, PREWARM_GUARD_PLAN, ...) reach it
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PREWARM_GUARD")}
    done = subprocess.run([sys.executable, "-c", _PROBE, module, json.dumps(sorted(jit_installed))], env=env,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise EnvironmentProblem(f"--server {server}: `import {module}` failed in {sys.executable} (run to learn the "
                                 f"cache dirs a {server} process uses): {last}")
    doc = json.loads(lines[-1][len(_MARK):])
    return ServerCacheDirs(server, str(installed), doc["triton"], doc["given"], doc["set"], jit_installed, doc["jit"])


def check_serving_process(mode: str) -> None:
    """At the guard's arming: this process's Triton cache dir must be one a bundle was installed into (an install
    receipt) or built into (build info), else none of the node's prewarmed cache is read. "error" raises
    :class:`CacheDirMismatch` (the process refuses to serve); "warn" says it on stderr."""
    from ..building import tritoncompat
    from ..shipping.cachedir import CacheDir

    cache = CacheDir(tritoncompat.cache_dir())
    if cache.build_info.is_file() or any(cache.receipts_dir.glob("*.json")):
        return
    given = os.environ.get(VARIABLE)
    how = f"{VARIABLE} unset: Triton's default" if given is None else \
        f"{VARIABLE}={given}, perhaps set by the server's own import"
    problem = (f"this process reads Triton's cache at {cache.root} ({how}), where no bundle was installed "
               f"(no install receipt in {cache.receipts_dir}): set {VARIABLE} to the dir the pre-launch job installed "
               f"into, in the server's environment")
    if mode == "error":
        raise CacheDirMismatch(problem)
    print(f"prewarm guard: warning: {problem}", file=sys.stderr)
