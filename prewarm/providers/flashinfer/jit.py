"""FlashInfer's JIT modules (``flashinfer.jit``), shipped as AOT artifacts: built, looked up and watched through
FlashInfer's own ``JitSpec``.

FlashInfer's JIT dir (``~/.cache/flashinfer/<version>/<archs>/cached_ops/<name>/``) is ninja's: its build.ninja
names absolute paths and ninja compares input mtimes against its own logs, so a module copied there is rebuilt.
What ``JitSpecNvcc.try_load`` loads without ninja is an AOT artifact: ``<flashinfer package>/data/aot/<name>/<name>.so``
(``jit_env.FLASHINFER_AOT_DIR``; ``get_aot_artifacts`` returns it whenever the file exists, with no arch or version
check; flashinfer-jit-cache provider packages aside). So a build here runs the module's ``gen_*_module()`` JitSpec's
own ``build()`` (its ninja file, nvcc) for the manifest's arch (``FLASHINFER_CUDA_ARCH_LIST``) in a private
workspace, and places the ``.so`` at ``root/<name>/<name>.so``; a lookup asks ``spec.aot_artifacts`` with the AOT
dir pointed at ``root``. FlashInfer reads its environment at import, so each of these runs in a child process of
this interpreter. Because FlashInfer loads an AOT module without checking what it was built for, the bundle's
:meth:`FlashInferJit.toolchain` (arch, FlashInfer, nvcc, tvm-ffi) is what says whether a node may use it.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from ...shipping import layouts
from ...errors import BuildError, EnvironmentProblem
from ...jit import JitLibrary, JitRequest, Lookup, parse_arch

_MARK = "prewarm-flashinfer "

# run as `python -c _CHILD JOB`: each request's JitSpec from its gen_*_module call; "build" runs spec.build(); every
# op answers the spec's name, the JIT-path .so and FlashInfer's AOT artifacts for it (its AOT dir moved to JOB's)
_CHILD = f"""
import importlib, json, os, subprocess, sys, traceback
from pathlib import Path
job = json.loads(sys.argv[1])
import flashinfer.jit.env as jit_env
if job.get("aot_dir"):
    jit_env.FLASHINFER_AOT_DIR = Path(job["aot_dir"])
out = {{"aot_dir": str(jit_env.FLASHINFER_AOT_DIR), "specs": []}}
if job["op"] == "toolchain":
    from flashinfer.jit.core import check_cuda_arch, current_compilation_context
    from flashinfer.jit.cpp_ext import get_cuda_path
    from importlib.metadata import version
    check_cuda_arch()
    out["toolchain"] = {{
        "flashinfer.version": version("flashinfer-python"),
        "flashinfer.apache-tvm-ffi": version("apache-tvm-ffi"),
        "flashinfer.nvcc": subprocess.check_output([os.path.join(get_cuda_path(), "bin", "nvcc"), "--version"],
                                                   text=True).strip(),
        "flashinfer.archs": " ".join(f"{{m}}.{{n}}" for m, n in sorted(current_compilation_context.TARGET_CUDA_ARCHS)),
    }}
for r in job["requests"]:
    module, fn = r["function"].split(":")
    try:
        spec = getattr(importlib.import_module(module), fn)(*r.get("args", []), **r.get("kwargs", {{}}))
        row = {{"name": spec.name, "so": str(spec.jit_library_path)}}
        if job["op"] == "build":
            spec.build()
        row["aot"] = [str(a.path) for a in spec.aot_artifacts]
    except Exception as e:
        row = {{"error": "".join(traceback.format_exception_only(e)).strip()}}
    out["specs"].append(row)
print({_MARK!r} + json.dumps(out))
"""


def _arch_list(arch: str) -> str:
    """``arch`` as FLASHINFER_CUDA_ARCH_LIST takes it ("9.0a"; without a suffix FlashInfer picks its own)."""
    major, minor, suffix = parse_arch(arch)
    return f"{major}.{minor}{suffix}"


def _ask(op: str, calls: list[Mapping], environ: Mapping[str, str], arch: str | None = None,
         aot_dir: Path | None = None) -> dict:
    """One child of this interpreter running ``_CHILD`` (FlashInfer reads its environment at import)."""
    env = dict(environ)
    if arch is not None:
        env["FLASHINFER_CUDA_ARCH_LIST"] = _arch_list(arch)
    job = {"op": op, "requests": list(calls), "aot_dir": str(aot_dir) if aot_dir else None}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(job)], env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(_MARK)), None)
    if proc.returncode or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise EnvironmentProblem(f"FlashInfer in {sys.executable} could not {op} ({' / '.join(tail)})")
    return json.loads(line[len(_MARK):])


def _torch_arch() -> str | None:
    """The GPU this process's torch reports (a planner's device profile answers it), else None."""
    try:
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    except Exception:
        return None


def module_request(function: str, *args, origin: str = "", arch: str | None = None) -> JitRequest:
    """The request for the module ``function(*args)`` makes ("module.path:gen_x_module"), named by FlashInfer
    (``JitSpec.name``, asked in a child for ``arch``: None, the GPU this process's torch reports; once per process)."""
    call = {"function": function, "args": list(args)}
    return JitRequest("flashinfer", _spec_name(json.dumps(call), arch or _torch_arch()), call, origin)


@functools.lru_cache(maxsize=None)
def _spec_name(call: str, arch: str | None) -> str:
    row = _ask("name", [json.loads(call)], os.environ, arch)["specs"][0]
    if "error" in row:
        raise EnvironmentProblem(f"FlashInfer cannot name the module of {call}: {row['error']}")
    return row["name"]


# FlashInfer's AOT dir (``flashinfer/data/aot/<name>/<name>.so``, which ``JitSpec`` loads without building): an entry
# is ``<name>``. It lives inside the server's flashinfer package: no variable names it, install needs the dir given.
# What FlashInfer loads (``loader``): ``jit_env.get_aot_artifacts(name)`` returns ``FLASHINFER_AOT_DIR / name /
# f"{name}.so"`` whenever that path ``exists()`` (links followed), for any name a ``JitSpec`` carries: FlashInfer
# checks no name (its batch-prefill modules' run to 169 characters), so every name in the dir is one it could load.
# prewarm's own entries: the names its modules have (letters, digits, ``_``, ``-``) up to 252 characters, so that
# ``<name>.so`` fits a file name.
LAYOUT = layouts.Layout("flashinfer-aot", (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,251}"),), "<module name>", None,
                        None, False, loader=(re.compile(r".+", re.S),), loads="{key}/{0}.so",
                        reader="FlashInfer's get_aot_artifacts")


class FlashInferJit(JitLibrary):
    name = "flashinfer"
    cache_layout = LAYOUT
    env_var = ""  # none: the AOT dir is inside the flashinfer package
    hook_module = "flashinfer.jit.core"
    target_factor = "flashinfer.archs"
    stamp_code = ("flashinfer.jit",)
    env_prefixes = ("FLASHINFER_", "TVM_")

    def node_dir(self, environ: Mapping[str, str] = os.environ) -> Path:
        """``jit_env.FLASHINFER_AOT_DIR`` of the flashinfer a child of this interpreter imports with ``environ``."""
        return Path(_ask("dir", [], environ)["aot_dir"])

    def toolchain(self, arch: str) -> dict[str, str]:
        """What an AOT module depends on, which FlashInfer never checks at load: the arch it is built for, FlashInfer's
        version (its sources and bindings), tvm-ffi's (the module ABI), nvcc's ``--version`` (the CUDA major its
        libcudart.so.N link names)."""
        return _ask("toolchain", [], os.environ, arch)["toolchain"]

    def build(self, requests: list[JitRequest], root: Path, arch: str) -> list[Lookup]:
        root = Path(root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="prewarm-flashinfer-") as work:
            env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_DISABLE_JIT"}
            env["FLASHINFER_WORKSPACE_BASE"] = work  # a private JIT dir: no other build's ninja state
            rows = _ask("build", [r.call for r in requests], env, arch)["specs"]
            for request, row in zip(requests, rows):
                if "error" in row or row["name"] != request.name:
                    why = row.get("error") or f"FlashInfer names it {row['name']!r}"
                    raise BuildError(f"FlashInfer module {request.name} ({request.origin or request.call}) did not "
                                     f"build for {arch}: {why}")
                target = root / request.name / f"{request.name}.so"
                target.parent.mkdir(exist_ok=True)
                part = target.with_name(target.name + ".part")
                shutil.copyfile(row["so"], part)
                os.replace(part, target)  # whole or absent: never a half-written module FlashInfer would load
        return self.lookup(requests, root, arch)

    def lookup(self, requests: list[JitRequest], root: Path, arch: str | None = None) -> list[Lookup]:
        root = Path(root).resolve()
        rows = _ask("lookup", [r.call for r in requests], os.environ, arch, aot_dir=root)["specs"]
        out = []
        for request, row in zip(requests, rows):
            if "error" in row:
                out.append(Lookup(request, False, None, f"FlashInfer cannot resolve it: {row['error']}"))
            elif row["aot"]:
                out.append(Lookup(request, True, row["aot"][0]))
            else:
                out.append(Lookup(request, False, None, f"no AOT module {root / request.name / (request.name + '.so')}"
                                                        f": FlashInfer JIT-builds it into {Path(row['so']).parent}"))
        return out

    def watch_builds(self, on_build: Callable[[str, str], None]) -> None:
        """Hooks ``JitSpecNvcc.build``: ``build_and_load`` calls it whenever no AOT module is there (ninja then
        compiles, or finds its own JIT dir current); an exception from ``on_build`` leaves nothing built."""
        from flashinfer.jit import env as jit_env
        from flashinfer.jit.core import JitSpecNvcc

        build = getattr(JitSpecNvcc.build, "__wrapped__", JitSpecNvcc.build)

        def watched(spec, *args, **kwargs):
            on_build(spec.name, f"flashinfer: no AOT module in {jit_env.FLASHINFER_AOT_DIR}; ninja builds it into "
                                f"{spec.build_dir}")
            return build(spec, *args, **kwargs)

        watched.__wrapped__ = build
        JitSpecNvcc.build = watched
