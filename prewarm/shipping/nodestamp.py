"""This node's fingerprint (``fingerprint.current()``), remembered in the cache dir and reused while nothing it is
computed from has changed: a `prewarm install` with nothing to do must not pay, at every pod start, for importing
Triton and hashing its sources (triton.key), running ptxas and nvidia-smi.

What ``current()`` reads, and how the stamp sees each of them without importing Triton (stats and small reads):
- the interpreter: sys.executable, sys.version, the machine (verbatim);
- code: every file and dir under the triton package it imports, wherever sys.path finds it (its sources and
  libtriton: triton.key; the wheel's ptxas; triton-ascend's backend), prewarm's own fingerprint code, torch's and
  torch_npu's version modules, and the metadata of each *triton* / torch / torch_npu distribution on sys.path (the
  versions importlib.metadata reads). How the process was started (python -m, a console script) does not matter
  unless it changes what is found;
- tools and the files it reads: every PATH dir (a tool added, removed or renamed there: nvidia-smi,
  bishengir-compile, g++), the file behind TRITON_PTXAS_PATH, each bishengir-compile on PATH and
  $TRITON_NPU_COMPILER_PATH/npuc, CANN's version files under each place the toolkit is looked for;
- devices: the /dev/nvidia* and /dev/davinci* nodes with their device numbers, each GPU's model and bus as
  /proc/driver/nvidia lists it (what nvidia-smi reports the architecture of);
- the environment: every variable's value, except variables learnt, when the fingerprint was computed, to be read
  neither by prewarm (not TRITON_*, ASCEND_*, CUDA_*, PATH...) nor by Triton's key (libtriton's list of
  cache-invalidating variables cannot be enumerated, but Triton reports which of the set variables it holds): such
  variables (HOSTNAME...) may change from pod to pod. A variable not set then is not known: a new one recomputes.
For a library past Triton (prewarm.jit: ``current(meta_dir, library, compute)``, a record per layout), its toolchain
factors are reused the same way: the same interpreter, PATH dirs, devices and environment (variables of the
library's prefixes never ignorable), its fingerprint code (prewarm's and the library's packages it names, walked),
every distribution's metadata on sys.path, and each compiler it runs for its --version, found as the library finds
it, with every link on the way (a compiler switched by update-alternatives or replaced in place is seen).
Files are compared by inode, size, mtime and ctime: any write, replace or chmod moves ctime, which no tool sets back.
Every input as it was => ``current()`` computes the same factors, so they are reused; anything else (no record, an
unreadable one, another prewarm version) computes them afresh. A monkeypatched Python function is not an input.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

from .. import __version__
from .layouts import TRITON, Layout

RECORD = "node.json"
# Variables prewarm's fingerprint code (or a tool it runs) may read: never learnt as ignorable.
_READ_PREFIXES = ("TRITON_", "ASCEND_", "CUDA_", "NVIDIA_", "NPU_", "CANN_", "TORCH_", "PYTORCH_", "PYTHON", "LD_",
                  "ENABLE_")
_READ = {"PATH", "HOME", "CC", "CXX", "VIRTUAL_ENV", "CONDA_PREFIX"}
_DISTS = re.compile(r"(\w*triton\w*|torch|torch_npu)-[^-]+\.(?:dist|egg)-info", re.IGNORECASE)
_ANY_DIST = re.compile(r".+-[^-]+\.(?:dist|egg)-info")
_DEVICES = re.compile(r"nvidia(?:\d+|ctl|-uvm)|davinci(?:\d+|_manager)")
_PREWARM = Path(__file__).resolve().parents[1]
# prewarm's own code the factors come from (under prewarm/): a module, or a package's modules
_FINGERPRINT_CODE = ("node/fingerprint.py", "building/tritoncompat", "shipping/nodestamp.py")
_ASCEND_HOMES = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def current(meta_dir: Path | None, library=None, compute=None) -> tuple[dict[str, str], dict | None]:
    """(this node's factors, a record to ``remember`` them by, or None where the one in ``meta_dir`` was reused).
    ``library``: a library past Triton (prewarm.jit) whose factors ``compute()`` gives; None: Triton's."""
    snapshot = _snapshot(library)
    layout = library.layout if library is not None else "triton"
    record = _read(meta_dir / record_name(layout), layout) if meta_dir is not None else None
    if record is not None and record["inputs"] == _digest(snapshot, set(record["ignored"])):
        return dict(record["factors"]), None
    if library is None:
        from ..building import tritoncompat
        from ..node import fingerprint


        factors = fingerprint.current()
        reads = tritoncompat.cache_invalidating_env_vars()  # the set ones Triton folds into its key
    else:
        factors, reads = compute(), set()
    prefixes = _READ_PREFIXES + (library.env_prefixes if library is not None else ())
    ignored = {n for n, v in snapshot["env"].items() if v and n not in reads and n not in _READ
               and not n.startswith(prefixes)}
    if library is not None:
        ignored.add(library.env_var)  # where its modules are, not what builds them: set or not, never an input
    ignored = sorted(ignored)
    return factors, {"prewarm": __version__, "layout": layout, "ignored": ignored,
                     "inputs": _digest(snapshot, set(ignored)), "factors": factors}


def record_name(layout: str) -> str:
    """The record's file in the cache dir's meta dir: one per layout (a JIT layout's factors are its library's)."""
    return RECORD if layout == "triton" else f"node.{layout}.json"


def remember(meta_dir: Path, record: dict) -> None:
    """Keep ``record`` for the next process (best effort: a dir it cannot write only costs recomputing)."""
    from .cachedir import write_atomic

    try:
        write_atomic(meta_dir / record_name(record["layout"]), json.dumps(record, sort_keys=True).encode(), durable=False)
    except OSError:
        pass


def _read(path: Path, layout: str) -> dict | None:
    from .bundle import open_regular, read_bounded
    from ..errors import IntegrityError

    try:
        record = json.loads(read_bounded(open_regular(path), 1 << 20, str(path)))  # no link, FIFO or device read
        ok = (record.get("prewarm") == __version__ and record.get("layout") == layout
              and type(record.get("inputs")) is str
              and type(record.get("ignored")) is list and type(record.get("factors")) is dict
              and all(type(v) is str for v in record["factors"].values()))
        return record if ok else None
    except (OSError, ValueError, AttributeError, RecursionError, IntegrityError):
        return None


def _digest(snapshot: dict, ignored: set[str]) -> str:
    env = {n: v for n, v in snapshot["env"].items() if n not in ignored}
    return hashlib.sha256(repr({**snapshot, "env": sorted(env.items())}).encode()).hexdigest()


def _stat(path: str | os.PathLike) -> tuple:
    try:
        st = os.stat(path)
        return str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode
    except OSError:
        return str(path), None


def _tree(root: str, out: list) -> None:
    """Every file and dir under ``root`` but bytecode caches, which importing the code writes (a dir: its inode and
    mode; what it holds is listed, so its mtime, which a new __pycache__ moves, adds nothing)."""
    try:
        with os.scandir(root) as it:
            for d in sorted(it, key=lambda d: d.name):
                if d.name == "__pycache__":
                    continue
                st = d.stat(follow_symlinks=False)
                if d.is_dir(follow_symlinks=False):
                    out.append((d.path, st.st_ino, st.st_mode))
                    _tree(d.path, out)
                else:
                    out.append((d.path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode))
    except OSError:
        out.append((root, None))


def _package_dir(name: str) -> str | None:
    """Where ``import name`` would load a package from (a dotted name: its dir under the top package's), found
    without importing it."""
    import importlib.util

    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if not (spec and spec.submodule_search_locations):
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), *rest)


def _chain(path: str) -> list:
    """A tool as a process running it finds it: each link on the way (alternatives, a venv's) and the file."""
    hops = []
    for _ in range(40):
        hops.append(_stat(path))
        if not os.path.islink(path):
            break
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return hops


def _snapshot(library=None) -> dict:
    env = dict(os.environ)
    if library is None:
        stats: list = [_stat(p) for rel in _FINGERPRINT_CODE
                       for p in (sorted((_PREWARM / rel).glob("*.py")) if (_PREWARM / rel).is_dir() else [_PREWARM / rel])]
        code, dists = ("triton",), _DISTS
    else:  # its code (prewarm's side and the library's), the distributions it reads versions of, its compilers
        stats = [_stat(sys.modules[type(library).__module__].__file__), _stat(Path(__file__).with_name("install.py"))]
        code, dists = library.stamp_code, _ANY_DIST  # every version it may read: the library's list is in its code
        for tool in library.compilers(env):
            stats += _chain(tool)
    for name in code:
        if found := _package_dir(name):
            _tree(found, stats)
    for name in ("torch", "torch_npu"):
        if found := _package_dir(name):
            stats.append(_stat(os.path.join(found, "version.py")))
    for entry in sys.path:  # the distributions importlib.metadata would find, wherever the process started
        try:
            names = sorted(n for n in os.listdir(entry or ".") if dists.fullmatch(n))
        except OSError:
            continue
        stats += [_stat(os.path.join(entry, d, meta)) for d in names for meta in ("METADATA", "PKG-INFO")]
    path_dirs = [d for d in env.get("PATH", "").split(os.pathsep) if d]
    stats += [_stat(d) for d in path_dirs]
    tools = [os.path.join(d, "bishengir-compile") for d in path_dirs]
    tools += [p for p in (env.get("TRITON_PTXAS_PATH"), os.path.join(env.get("TRITON_NPU_COMPILER_PATH", ""), "npuc"))
              if p]
    stats += [_stat(t) for t in tools]
    for home in (env.get("ASCEND_HOME_PATH"), env.get("ASCEND_TOOLKIT_HOME"), *_ASCEND_HOMES):
        if home:
            stats.append(_stat(home))
            stats += [_stat(p) for p in sorted(Path(home).glob("*-linux/ascend_toolkit_install.info"))]
    try:
        devices = sorted((n, os.stat(f"/dev/{n}").st_rdev) for n in os.listdir("/dev") if _DEVICES.fullmatch(n))
    except OSError:
        devices = []
    gpus = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            gpus.append((info.parent.name, info.read_text(errors="replace")))
        except OSError:
            gpus.append((info.parent.name, None))
    return {"python": (sys.executable, sys.version, os.uname().machine), "env": env, "stats": stats,
            "devices": devices, "gpus": gpus}


def node_fingerprint(cache_dir: Path | None = None) -> dict[str, str]:
    """This node's own factors: backend and arch detected here, never taken from a bundle (a CUDA node without a
    visible device reports its arch unknown: not compared; an Ascend node that cannot tell its SoC is refused; a node
    with another GPU or SoC is a mismatch). With ``cache_dir``: reused from its record while still true."""
    from .cachedir import CacheDir

    return current(CacheDir(cache_dir).meta if cache_dir else None)[0]


def node_factors(layout: Layout, meta_dir: Path | None) -> tuple[dict[str, str], dict | None]:
    """(this node's own factors for a bundle of ``layout``, a record to remember them by in ``meta_dir`` or None):
    what install's check_node and verify compare a bundle's fingerprint with, and what pack records where the dir's build
    recorded none. Reused from ``meta_dir``'s record while still true: Triton's (``node_fingerprint``), or a layout past
    Triton's from its library (``jit_node_factors``: importing the library and running its compilers takes seconds,
    which a pod start would pay at every install)."""
    if layout is TRITON:
        return current(meta_dir)
    from .. import jit

    return current(meta_dir, jit.for_layout(layout.name), lambda: jit_node_factors(layout))


def jit_node_factors(layout: Layout) -> dict[str, str]:
    """This node's factors for a bundle of a layout past Triton: what its library keys its cache on besides the
    sources, as this node's library computes them (prewarm.jit: imported here, lazily, since prewarm.shipping.layouts sits
    below every module that reads a cache dir), for this node's GPU. A node without a visible GPU states the rest
    and its target as unknown (a device factor: not compared, as ``target.arch`` is not)."""
    from ..node import fingerprint
    from .. import jit

    lib = jit.for_layout(layout.name)
    arch = fingerprint.detect_arch("cuda")
    if arch != fingerprint.UNKNOWN:
        return lib.toolchain(arch)
    factors = lib.toolchain("sm_90")  # any arch: only the target factor depends on it
    return {**factors, lib.target_factor: fingerprint.UNKNOWN}
