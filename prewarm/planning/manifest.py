"""Manifests: what will run where (TOML). Loading validates every key, so a typo is an error, not a silent miss.

The core is ``[target]`` and ``[[kernels]]``. ``[spec]`` (any table) is the providers' business: the planner hands
it to each provider with the target's backend, arch and device, and the provider validates it (its errors name
``spec.<key>``; the planner adds the file). A record-only or function-only manifest needs none.
Every error names the file, the key, the bad value and what was expected (ManifestError, exit code 3).
"""
from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ManifestError

BACKENDS = ("cuda", "npu")
TENSOR_DTYPES = (
    "bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class KernelSource:
    """One ``[[kernels]]`` entry: a provider module, a record file, or a single third-party function.

    ``function`` entries: ``args`` maps parameter name -> value; a value is ``{tensor = "dtype"}`` (a tensor of
    that dtype), an int / float / bool / string, or a list of those (one request per combination, in order).
    ``options`` holds ``num_warps`` / ``num_stages`` (int or list) and other compile options.
    """

    kind: str  # "provider" | "record" | "function"
    ref: str  # module name, record path (resolved), or "module:function"
    where: str  # "kernels[2]" for messages
    args: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    close: bool | tuple[str, ...] = False  # record entries: int parameters also compiled in their other classes:
    # True: those that took several classes in the recording; a tuple: those and the ones named (plan.closed_params)
    close_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # record entries: (pointer parameter, its dtypes)


OLD_ENVELOPE = ("model", "parallel", "dtypes", "serving")  # top-level tables before [spec]: refused, with the move


@dataclass(frozen=True)
class Manifest:
    path: Path
    name: str
    digest: str  # sha256 over the manifest bytes and every record file it includes
    backend: str
    arch: str
    device: str | None  # a device profile name (prewarm.devices) plan and build processes answer as
    kernels: tuple[KernelSource, ...]
    spec_table: dict[str, Any] = field(default_factory=dict)  # [spec] as written: the providers validate it
    archs: tuple[str, ...] = ()  # every SoC ``[target] arch`` lists (npu); ``arch`` is the first
    tuned: Path | None = None  # ``[target] tuned``: the autotune table (prewarm.building.autotune) builds write results from
    triton: tuple[str, ...] = ()  # ``[target] triton``: the Triton series ("3.8") the manifest and its table are for
    libcuda_dirs: tuple[str, ...] | None = None  # ``[target] libcuda_dirs`` (CUDA): where nodes' libcuda.so.1 is

    def spec(self) -> dict[str, Any]:
        """The dict every provider's ``launches(spec)`` / ``run(spec, device)`` receives: the target's backend,
        arch and device, and the ``[spec]`` table's keys."""
        return {"backend": self.backend, "arch": self.arch, "device": self.device, **self.spec_table}


class _Reader:
    """Typed access to one TOML table with errors that say file, key, value and expectation."""

    def __init__(self, path: Path, table: dict, prefix: str):
        self.path, self.table, self.prefix = path, table, prefix
        self.used: set[str] = set()

    def fail(self, key: str, value: Any, expected: str) -> ManifestError:
        return ManifestError(f"{self.path}: {self.prefix}{key} = {value!r}: expected {expected}")

    def get(self, key: str, types: type | tuple, expected: str, default: Any = ..., check=None) -> Any:
        self.used.add(key)
        if key not in self.table:
            if default is ...:
                raise ManifestError(f"{self.path}: {self.prefix}{key} is missing: expected {expected}")
            return default
        value = self.table[key]
        bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
        if not isinstance(value, types) or bad_bool or (check is not None and not check(value)):
            raise self.fail(key, value, expected)
        return value

    def names(self, key: str, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
        """A string or a non-empty list of distinct strings, each one of ``allowed``."""
        expected = f"one of {', '.join(allowed)}, or a non-empty list of distinct ones"
        value = self.get(key, (str, list), expected, list(default))
        values = [value] if isinstance(value, str) else value
        if not values or len(set(map(str, values))) != len(values) or any(v not in allowed for v in values):
            raise self.fail(key, value, expected)
        return tuple(values)

    def table_of(self, key: str) -> "_Reader":
        return _Reader(self.path, self.get(key, dict, "a table", {}), f"{self.prefix}{key}.")

    def done(self) -> None:
        extra = sorted(set(self.table) - self.used)
        if extra:
            raise self.fail(extra[0], self.table[extra[0]], f"no such key here (known: {', '.join(sorted(self.used))})")


def load(path: str | Path) -> Manifest:
    """Parse and validate a manifest file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read manifest: {e.strerror}") from e
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid TOML: {e}") from e

    top = _Reader(path, doc, "")
    name = top.get("name", str, "a string", path.stem)

    t = top.table_of("target")
    backend = t.get("backend", str, f"one of {', '.join(BACKENDS)}", check=lambda v: v in BACKENDS)
    if backend == "cuda":
        arch = t.get("arch", str, "a CUDA arch like 'sm_90'", check=lambda v: re.fullmatch(r"sm_?\d{2,3}a?", v))
        archs = (arch,)
    else:  # a list where a fleet mixes SoCs (A3: Ascend910_9391, 9392, 9381, 9382, 9372, 9362): one cache dir each
        expected = "an Ascend SoC name like 'Ascend910_9391', or a non-empty list of distinct ones"
        value = t.get("arch", (str, list), expected)
        archs = (value,) if isinstance(value, str) else tuple(value)
        if not archs or len(set(archs)) != len(archs) or not all(isinstance(a, str) and a.strip() for a in archs):
            raise t.fail("arch", value, expected)
        arch = archs[0]
    device = t.get("device", str, "a device profile name from prewarm.devices (H200, H100, A100, B200, Ascend910B, A3)",
                   None)
    tuned = t.get("tuned", str, "a path to an autotune table made by `prewarm tune` (relative to the manifest)", None)
    if tuned is not None and device is None:
        raise t.fail("tuned", tuned, "target.device too: the table's rows are keyed by the device they were "
                                     "measured on (e.g. device = \"H200\")")
    triton = t.get("triton", (str, list), "a Triton series like \"3.8\" (the nodes' Triton), or a list of them", [])
    triton = (triton,) if isinstance(triton, str) else tuple(triton)
    if not all(isinstance(v, str) and re.fullmatch(r"\d+\.\d+", v) for v in triton):
        raise t.fail("triton", t.table["triton"], "a Triton series like \"3.8\" (major.minor), or a list of them")
    libcuda_dirs = None
    if backend == "cuda":
        expected = "a list of absolute dirs the nodes' libcuda.so.1 is in, e.g. [\"/usr/lib/x86_64-linux-gnu\"]"
        libcuda_dirs = t.get("libcuda_dirs", list, expected, None)
        if libcuda_dirs is not None:
            if not libcuda_dirs or not all(isinstance(d, str) and os.path.isabs(d) for d in libcuda_dirs):
                raise t.fail("libcuda_dirs", libcuda_dirs, expected)
            libcuda_dirs = tuple(libcuda_dirs)
    t.done()

    old = [k for k in OLD_ENVELOPE if k in doc]
    if old:
        raise ManifestError(
            f"{path}: [{old[0]}] is the old form: expected it under [spec] (rename [{'], ['.join(old)}] to "
            f"[spec.{'], [spec.'.join(old)}])"
        )
    spec_table = top.get("spec", dict, "a table of the providers' settings ([spec.model], [spec.serving], ...)", {})
    if any(k in spec_table for k in ("backend", "arch", "device")):
        key = next(k for k in ("backend", "arch", "device") if k in spec_table)
        raise ManifestError(f"{path}: spec.{key} = {spec_table[key]!r}: expected it in [target] (the planner "
                            f"passes the target's {key} to the providers)")

    kernels_raw = top.get("kernels", list, "an array of [[kernels]] tables", [])
    kernels = tuple(_kernel(path, i, entry) for i, entry in enumerate(kernels_raw))
    if not kernels:
        raise ManifestError(f"{path}: kernels is empty: expected at least one [[kernels]] entry")
    top.done()

    digest = hashlib.sha256(raw)
    for k in kernels:
        if k.kind == "record":
            digest.update(Path(k.ref).read_bytes())
    table = (path.parent / tuned).resolve() if tuned is not None else None
    if table is not None and table.is_file():  # its results go into the build; a missing one is reported there
        digest.update(table.read_bytes())
    return Manifest(path, name, digest.hexdigest(), backend, arch, device, kernels, spec_table, archs, table, triton,
                    libcuda_dirs)


def _kernel(path: Path, i: int, entry: Any) -> KernelSource:
    where = f"kernels[{i}]"
    if not isinstance(entry, dict):
        raise ManifestError(f"{path}: {where} = {entry!r}: expected a table")
    r = _Reader(path, entry, f"{where}.")
    kinds = [k for k in ("provider", "record", "function") if k in entry]
    if len(kinds) != 1:
        raise ManifestError(
            f"{path}: {where} has {kinds or 'none'} of provider / record / function: expected exactly one"
        )
    kind = kinds[0]
    label = r.get("label", str, "a string", "")
    if kind == "provider":
        ref = r.get("provider", str, "an importable module name", check=lambda v: re.fullmatch(r"[A-Za-z_][\w.]*", v))
        r.done()
        return KernelSource("provider", ref, where, label=label)
    if kind == "record":
        rel = r.get("record", str, "a path to a `prewarm record` file (relative to the manifest)")
        rec = (path.parent / rel).resolve()
        if not rec.is_file():
            raise r.fail("record", rel, f"an existing file (looked for {rec})")
        close = r.get("close", (bool, list), "true, false, or a list of int parameter names (also compile the other "
                      "specialization classes of the recorded ints that varied, and of those named)", False,
                      check=lambda v: isinstance(v, bool) or bool(v) and len(set(map(str, v))) == len(v)
                      and all(isinstance(n, str) and n.isidentifier() for n in v))
        close = close if isinstance(close, bool) else tuple(close)
        dtypes = r.table_of("close_dtypes")
        close_dtypes = tuple((param, dtypes.names(param, TENSOR_DTYPES, ())) for param in dtypes.table)
        r.done()
        return KernelSource("record", str(rec), where, label=label, close=close, close_dtypes=close_dtypes)
    ref = r.get("function", str, "'module:function'", check=lambda v: _REF.match(v))
    args = r.get("args", dict, "a table of parameter name -> value", {})
    for name, value in args.items():
        for v in value if isinstance(value, list) else [value]:
            _check_arg(path, f"{where}.args.{name}", v)
    options = r.get("options", dict, "a table of compile options (num_warps, num_stages, ...)", {})
    for name, value in options.items():
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, (int, float, bool, str)):
                raise ManifestError(f"{path}: {where}.options.{name} = {v!r}: expected an int, float, bool or string")
    r.done()
    return KernelSource("function", ref, where, args=args, options=options, label=label)


def _check_arg(path: Path, key: str, v: Any) -> None:
    if isinstance(v, dict):
        if set(v) - {"tensor", "shape"} or v.get("tensor") not in TENSOR_DTYPES:
            raise ManifestError(
                f"{path}: {key} = {v!r}: expected {{tensor = DTYPE}} with DTYPE one of {', '.join(TENSOR_DTYPES)}"
            )
    elif not isinstance(v, (int, float, bool, str)):
        raise ManifestError(f"{path}: {key} = {v!r}: expected {{tensor = DTYPE}}, an int, float, bool or string")
