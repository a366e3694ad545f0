"""Plan: a manifest -> the exact, deterministic list of compile requests the runtime will make.

A :class:`Request` is one kernel call as the serving code makes it (kernel, arguments as dtype+shape tensors and
scalars, options), or one recorded specialization from ``prewarm record``. Providers are called on ``meta``
tensors and their launches captured; nothing compiles. :func:`expand` then turns each request into the compiles
Triton itself would do (one per autotune config), by driving the real JIT entry point (``warmup``) with a
``jit_cache_hook`` that records the specialization data and skips the compile. Build and will-hit both replay
those with ``preload``, so plan, build and check share one definition of "the request".

A provider's ``launches(spec)`` may also yield :class:`prewarm.jit.JitRequest` objects: the modules past Triton its
calls reach (an sglang ``load_jit`` module, a FlashInfer JIT module), built by the library's own code
(:mod:`prewarm.jit`); they are the plan's ``jit`` list.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import re
import textwrap
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import devices
from ..building import tritoncompat
from ..errors import EnvironmentProblem, ManifestError, describe
from ..jit import JitRequest
from .manifest import KernelSource, Manifest
from .record import RecordedKey, read


@dataclass(frozen=True)
class Request:
    """One planned kernel call (``args``/``kwargs`` encoded) or one recorded compile (``specialization``)."""

    kernel: str  # "module:qualname", with ".fn" suffixes for a raw JITFunction under a wrapper
    label: str
    source: str  # the manifest entry it came from, e.g. "kernels[0] prewarm_kernels.kda.serving"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    specialization: str | None = None
    close: tuple[str, ...] = ()  # recorded: the int parameters also compiled in their other classes (other_int_classes)
    close_dtypes: tuple = ()  # recorded: ((pointer parameter, (dtype, ...)), ...) also compiled in (see other_dtypes)
    recorded: tuple[RecordedKey, ...] = field(default=(), compare=False)  # the keys its recording's processes saw

    @functools.cached_property
    def parsed(self) -> tritoncompat.Specialization:
        """A recorded request's specialization data, parsed once: what closing and labels read."""
        return tritoncompat.parse_specialization(self.specialization)

    @property
    def ident(self) -> str:
        """Content id: same kernel + arguments + options = same request, whatever its label."""
        body = json.dumps([self.kernel, list(self.args), self.kwargs, self.specialization], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def describe(self) -> str:
        if self.specialization is not None:
            return describe_specialization(self.parsed)
        parts = [_short(a) for a in self.args] + [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)

    def to_json(self) -> dict:
        out = {"id": self.ident, "kernel": self.kernel, "label": self.label, "source": self.source}
        if self.specialization is None:
            out.update(args=list(self.args), kwargs=self.kwargs)
        else:
            out["specialization_data"] = self.specialization
            if self.close:
                out["close"] = list(self.close)
        return out


@dataclass(frozen=True)
class Compile:
    """One compile Triton would do for a request: replayed with ``JITFunction.preload(specialization)``."""

    request: str  # Request.ident
    kernel: str
    label: str
    specialization: str
    closing: str = ""  # what closing changed in the recorded request ("T=1 n other"); "": Triton's own compile

    @functools.cached_property
    def parsed(self) -> tritoncompat.Specialization:
        """This compile's specialization data, parsed once (what explain compares and labels read)."""
        return parse_compile_data(self.specialization, self.kernel)

    def to_json(self) -> dict:
        return {"request": self.request, "kernel": self.kernel, "label": self.label,
                "specialization_data": self.specialization, "closing": self.closing}  # fmt: skip


def parse_compile_data(data: str, kernel: str | None = None) -> tritoncompat.Specialization:
    """Specialization data of either Triton layout parsed; ``kernel`` ("module:qualname", where known): triton 3.2's
    data keys constexprs by name, their order is the kernel's, read from it where it can be imported."""
    names = None
    if kernel and '"constants"' in data:
        try:
            names = tritoncompat.jit_function(resolve(kernel)).arg_names
        except (ImportError, AttributeError, TypeError):
            names = None
    return tritoncompat.parse_specialization(data, names)


@dataclass
class Plan:
    manifest: Manifest
    requests: list[Request]
    jit: list[JitRequest] = field(default_factory=list)  # modules past Triton the calls reach, each once

    def to_json(self) -> dict:
        m = self.manifest
        return {
            "manifest": {"name": m.name, "path": str(m.path), "digest": m.digest},
            "target": {"backend": m.backend, "arch": m.arch},
            "spec": m.spec(),
            "options": provider_options(m),
            "requests": [r.to_json() for r in self.requests],
            "jit": [j.to_json() for j in self.jit],
        }


def provider_options(manifest: Manifest) -> dict[str, list[dict]]:
    """Each provider entry's ``options(spec)``, where its module has one: per axis of its library's API, the values
    planned against every value the library accepts, so that a narrowed axis is never silent (plan prints them)."""
    from ..providers import provider

    out = {}
    for src in manifest.kernels:
        options = getattr(provider(src.ref), "options", None) if src.kind == "provider" else None
        if options is not None:
            out[f"{src.where} {src.ref}"] = options(manifest.spec())
    return out


def coverage(planned: Planned) -> list[dict]:
    """Per manifest entry (a provider, a record file, a function) and per model component, what the plan holds and
    what the model reaches that it does not (``prewarm plan`` prints it, ``--json`` carries it as ``coverage``).

    A provider with the optional ``coverage(spec)`` hook (:mod:`prewarm.providers.contract`) names its components,
    and the launches it returns carry labels starting with ``component/``; each component's kernels, requests and
    compiles are counted from the plan itself (the requests of that entry whose label starts so), so a count never
    restates the hook. A kernel the hook says it plans and no launch reached is listed as ``unreached`` (the hook
    and the launches disagree: a bug of the provider). An entry without the hook is one component named after it.
    ``compiles`` is None where the plan was not expanded (``planned.compiles`` empty because no target was active)."""
    from ..providers import provider

    expanded = bool(planned.compiles) or not planned.requests
    by_request = Counter(c.request for c in planned.compiles)
    failing = {r.ident: w.kernel for w in planned.will_fail for r in w.requests}
    every = list(planned.requests) + [r for w in planned.will_fail for r in w.requests]
    spec = planned.manifest.spec()
    out = []
    for src in planned.manifest.kernels:
        source = f"{src.where} {src.ref}"
        mine = [r for r in every if r.source == source]
        hook = getattr(provider(src.ref), "coverage", None) if src.kind == "provider" else None
        declared = hook(spec) if hook is not None else [{"component": src.ref, "planned": [], "not_planned": []}]
        names = [d["component"] for d in declared]
        groups: dict[str, list[Request]] = {name: [] for name in names}
        for r in mine:
            name = r.label.split("/", 1)[0] if hook is not None else src.ref
            groups.setdefault(name, []).append(r)
        components = []
        for name, requests in groups.items():
            entry = next((d for d in declared if d["component"] == name), {"planned": [], "not_planned": []})
            kernels = sorted({r.kernel for r in requests})
            components.append({
                "component": name, "kernels": kernels, "requests": len(requests),
                "compiles": sum(by_request[r.ident] for r in requests) if expanded else None,
                "will_fail": sorted({failing[r.ident] for r in requests if r.ident in failing}),
                "unreached": sorted(set(entry["planned"]) - set(kernels)),
                "not_planned": [dict(item) for item in entry["not_planned"]]})
        out.append({"provider": src.ref, "source": source, "components": components})
    return out


# --- building the plan -----------------------------------------------------------------------------------------


def plan(manifest: Manifest) -> Plan:
    """Every request of every ``[[kernels]]`` entry, in manifest order, duplicates dropped (first label kept).

    Activates nothing: the caller gives the process its device view first (a target's ``activate``, or
    ``prewarm.building.backends.activate_for_planning``), before a provider imports a library that asks the device."""
    requests: dict[str, Request] = {}
    jit: dict[JitRequest, JitRequest] = {}
    for source in manifest.kernels:
        for req in _from_source(manifest, source):
            if isinstance(req, JitRequest):
                jit.setdefault(req, req)
            else:
                requests.setdefault(req.ident, req)
    return Plan(manifest, list(requests.values()), list(jit.values()))


def _from_source(manifest: Manifest, src: KernelSource) -> list[Request | JitRequest]:
    if src.kind == "provider":
        return _from_provider(manifest, src)
    if src.kind == "record":
        requests = load_record(src.ref, source=f"{src.where} {src.ref}", close=src.close,
                               close_dtypes=src.close_dtypes)
        _check_close_dtypes(manifest, src, requests)
        _check_close(manifest, src, requests)
        return requests
    return _from_function(manifest, src)


def _from_provider(manifest: Manifest, src: KernelSource) -> list[Request | JitRequest]:
    from ..providers import provider

    where = f"{manifest.path}: {src.where}.provider = {src.ref!r}"
    try:
        module = provider(src.ref)
    except ManifestError as e:
        raise ManifestError(f"{manifest.path}: {src.where}: {e}") from e
    except Exception as e:
        _raise_unprovided(e, f"{where}: cannot import it")
        raise ManifestError(f"{where}: cannot import it ({describe(e)}): expected an installed provider "
                            f"module") from e
    try:
        launches = list(module.launches(manifest.spec()))
    except Exception as e:
        if hasattr(e, "key") and hasattr(e, "expected"):  # the provider's own check of [spec] named the key
            raise ManifestError(f"{manifest.path}: {e} (checked by {src.where}.provider = {src.ref!r})") from e
        _raise_unprovided(e, f"{where}: launches(spec) failed")
        raise ManifestError(f"{where}: launches(spec) failed: {describe(e)}") from e
    out = []
    for n, launch in enumerate(launches):
        if isinstance(launch, JitRequest):
            out.append(launch)
            continue
        label = getattr(launch, "label", "") or f"{src.ref}#{n}"
        ref = _ref_for(launch.kernel, f"{where}, launch {label!r}")
        args = tuple(_encode(a, f"{where}, launch {label!r}, argument {i}") for i, a in enumerate(launch.args))
        kwargs = {k: _encode(v, f"{where}, launch {label!r}, argument {k}") for k, v in launch.kwargs.items()}
        out.append(Request(ref, label, f"{src.where} {src.ref}", args, kwargs))
    return out


def _raise_unprovided(error: BaseException, where: str) -> None:
    """An EnvironmentProblem (exit 11) where ``error`` is a library this machine lacks and the device profile did not
    provide (the server's own import needs it: not the manifest's fault), naming the import and the fix."""
    missing = devices.unprovided(error)
    if missing:
        raise EnvironmentProblem(f"{where} in {_failed_import(error)}: {missing}") from error


def _failed_import(error: BaseException) -> str:
    """The chain of modules whose import was running where ``error`` was raised, outermost first ("import a -> b":
    a's import imported b, which failed), from its traceback's module-level frames; "a module" where none was."""
    import traceback

    modules = [frame.f_globals.get("__name__", "?") for frame, _ in traceback.walk_tb(error.__traceback__)
               if frame.f_code.co_name == "<module>"]
    modules = list(dict.fromkeys(m for m in modules if not m.startswith(("importlib", "<frozen"))))
    return "import " + " -> ".join(modules) if modules else "a module"


def _from_function(manifest: Manifest, src: KernelSource) -> list[Request]:
    where = f"{manifest.path}: {src.where}.function = {src.ref!r}"
    try:
        kernel = resolve(src.ref)
        params = tritoncompat.jit_function(kernel).arg_names
    except (ImportError, AttributeError, TypeError) as e:
        raise ManifestError(f"{where}: {e}: expected 'module:function' naming a @triton.jit kernel") from e
    unknown = [a for a in src.args if a not in params]
    if unknown:
        raise ManifestError(
            f"{manifest.path}: {src.where}.args.{unknown[0]}: the kernel has no such parameter: expected one of "
            f"{', '.join(params)}"
        )
    ref = _ref_for(kernel, where)
    table = {**src.args, **src.options}
    names = list(table)
    choices = [v if isinstance(v, list) else [v] for v in table.values()]
    out = []
    for combo in itertools.product(*choices):
        kwargs = {n: ({"tensor": v["tensor"], "shape": v.get("shape", [1])} if isinstance(v, dict) else v)
                  for n, v in zip(names, combo)}  # fmt: skip
        label = src.label or src.ref.split(":")[1]
        varying = [f"{n}={_short(kwargs[n])}" for n, c in zip(names, choices) if len(c) > 1]
        out.append(Request(ref, f"{label} {' '.join(varying)}".strip(), f"{src.where} {src.ref}", (), kwargs))
    return out


def load_record(path: str, source: str | None = None, close: bool | tuple[str, ...] = False,
                close_dtypes: tuple = ()) -> list[Request]:
    """Requests from a ``prewarm record`` file (JSON lines), deduplicated, in first-seen order, each with the keys
    its recorded processes saw. ``close``: each request also compiles in the other classes of its kernel's int
    parameters that took more than one class in this recording (True), and of the ones named (a tuple)
    (:func:`closed_params`); ``close_dtypes``: and the named pointer parameters' other dtypes (:func:`other_dtypes`)."""
    out: dict[str, Request] = {}
    for line in read(path):
        if line.kernel.startswith("__main__:"):
            raise ManifestError(
                f"{line.where}: kernel {line.kernel} was defined in a script run as __main__: expected kernels in an "
                f"importable module (a build process must import it by name)"
            )
        spec = tritoncompat.parse_specialization(_this_hosts(line.specialization, line.where))
        label = line.label or f"{spec.function} [{describe_specialization(spec)}]"
        req = Request(line.kernel, label, source or path, specialization=spec.data, close_dtypes=close_dtypes)
        req = out.setdefault(req.ident, req)
        if line.key is not None and all(k.key != line.key.key for k in req.recorded):
            out[req.ident] = dataclasses.replace(req, recorded=(*req.recorded, line.key))
    requests = list(out.values())
    params = closed_params(requests, close)
    return [dataclasses.replace(r, close=params.get(r.kernel, ())) for r in requests]


def closed_params(requests: list[Request], close: bool | tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """kernel -> the int parameters closing expands for its recorded requests: those that took more than one
    specialization class among them (a batch size, a token count: values the traffic moves, where a stride or a
    flag stays in its class), plus those ``close`` names; in parameter order. Grouped by kernel, not by its other
    constexprs: what moves an int's class is the traffic, the same for every config of the kernel, and one
    config's few samples would under-close the others."""
    if close is False:
        return {}
    named = set(close) if isinstance(close, tuple) else set()
    seen: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))  # kernel -> param -> classes
    for r in requests:
        for param, cls in r.parsed.int_classes.items():
            seen[r.kernel][param].add(cls)
    return {kernel: tuple(p for p, classes in params.items() if len(classes) > 1 or p in named)
            for kernel, params in seen.items()}  # fmt: skip


def _this_hosts(data: str, where: str) -> str:
    """Recorded specialization data with the recording machine's paths replaced by this host's.

    CUDA options carry the absolute path of libdevice (``extern_libs``, filled in by ``CUDAOptions.__post_init__``
    from the recording host's install). Triton's key hashes that file's content (``CUDAOptions.hash``:
    ``file_hash(path)``), not its path, and the fingerprint ensures the same triton here, so this host's libdevice
    gives the same key. Any other absolute path in the options that this host lacks cannot be replaced: it is named
    (a ManifestError), never left for the compiler to fail on."""
    obj = json.loads(data)
    options = obj.get("options", {})
    local = _local_extern_libs(options)
    replaced: dict[str, str] = {}
    for name, value in options.items():
        if name == "extern_libs" and value:
            for pair in value:
                lib, lib_path = pair
                if lib in local and lib_path != local[lib]:
                    replaced[lib_path] = pair[1] = local[lib]
                elif not Path(lib_path).exists():
                    raise ManifestError(
                        f"{where}: option extern_libs {lib!r} = {lib_path!r}: no such file on this host, and this "
                        f"host's Triton has no {lib!r} of its own to use instead: expected the library at that path"
                    )
        elif isinstance(value, str) and value.startswith("/") and not Path(value).exists():
            raise ManifestError(f"{where}: option {name} = {value!r}: a path that does not exist on this host: "
                                f"expected options without machine-specific paths, or the file at that path")
    if not replaced:
        return data
    key = json.dumps(obj.get("key"))  # the in-memory key repeats option kwargs the launch passed (extern_libs=...)
    for old, new in replaced.items():
        key = key.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
    obj["key"] = json.loads(key)
    return json.dumps(obj)


def _local_extern_libs(options: dict) -> dict[str, str]:
    """The libraries this host's Triton fills into a backend's options when none are given ({} for none)."""
    if options.get("backend_name") != "cuda":
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return {}
    return dict(CUDAOptions().extern_libs)


# --- the device a manifest plans as --------------------------------------------------------------------------


def manifest_device(manifest) -> str | None:
    """The profile name a manifest's ``[target] device`` gives, else the one its recordings ran on
    (:func:`recorded_device`; None: neither names one), checked against its backend and arch."""
    name = manifest.device
    if name is None:
        found = recorded_device(manifest)
        if found is None:
            return None
        name, where, observed = found
        profile = devices.PROFILES[name]
        if profile.backend != manifest.backend or devices.arch_name(manifest.arch) != profile.arch.lower():
            raise ManifestError(f"{where}: recorded on {observed['name']} ({profile.backend} {profile.arch}), but "
                                f"{manifest.path} targets {manifest.backend} {manifest.arch}: expected the recording's "
                                f"arch, or a [target] device naming the device to plan for")
        return name
    profile = devices.lookup(name, f"{manifest.path}: target")
    if profile.backend != manifest.backend or devices.arch_name(manifest.arch) != profile.arch.lower():
        raise ManifestError(f"{manifest.path}: target.device = {name!r}: that device is {profile.backend} "
                            f"{profile.arch}, but the manifest targets {manifest.backend} {manifest.arch}: expected a "
                            f"device of the target's arch")
    return devices.ALIASES.get(name, name)


def manifest_device_name(manifest, where: str) -> str:
    """The device name a manifest's rows are looked up under (its ``[target] device`` profile's name); a table
    without a device to select its rows is refused (exit 3)."""
    profile = manifest_device(manifest)
    if profile is None:
        raise ManifestError(f"{manifest.path}: {where} names an autotune table, but target.device is missing: "
                            f"expected the device the table was measured on (e.g. device = \"H200\"): its rows are "
                            f"keyed by device")
    return devices.lookup(profile, f"{manifest.path}: target").name


def manifest_pins(manifest) -> dict:
    """kernel ("module:qualname") -> its autotune pin (prewarm.planning.pins): the ``[[pinned]]`` rows of the manifest's own
    table (``[target] tuned``; pins decide what the plan compiles, so ``--tuned`` does not replace them) for the
    device it plans for. {} where it names no table or the file does not exist (plan and build say so)."""
    from .pins import read_pins

    if manifest.tuned is None or not manifest.tuned.is_file():
        return {}
    pinned = read_pins(manifest.tuned)
    if not pinned:
        return {}
    device = manifest_device_name(manifest, "target.tuned")
    return {r.kernel: r for r in pinned if r.device == device}


def recorded_device(manifest) -> tuple[str, str, dict] | None:
    """(profile name, first line naming it, the device as recorded) of the device a manifest's record files ran
    on; None where no line names one. Lines naming different devices are a ManifestError naming both lines."""
    first: tuple[str, str, dict] | None = None
    for source in manifest.kernels:
        if source.kind != "record":
            continue
        for line in read(source.ref):
            if line.device is None:
                continue
            if first is None:
                first = (devices.matching_profile(line.device, line.where), line.where, line.device)
            elif line.device["name"] != first[2]["name"] or devices.matching_profile(line.device, line.where) != first[0]:
                raise ManifestError(f"{line.where}: recorded on {line.device['name']!r}, but {first[1]} on "
                                    f"{first[2]['name']!r}: a build plans for one device: expected recordings of one "
                                    f"device per manifest, or a [target] device naming the one to plan for")
    return first


# --- references and argument encoding ---------------------------------------------------------------------------


def resolve(ref: str) -> Any:
    """The kernel object a "module:qualname[.fn...]" reference names (imports the module)."""
    module_name, _, attrs = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    tritoncompat.jit_function(obj)  # TypeError if this is not a Triton kernel
    return obj


def _ref_for(kernel: Any, where: str) -> str:
    """A reference that resolves back to this very object, or a clear error (kernels made in closures...)."""
    try:
        ref = tritoncompat.kernel_ref(kernel)
    except TypeError as e:
        raise ManifestError(f"{where}: {e}") from e
    try:
        obj = resolve(ref)
    except (ImportError, AttributeError, TypeError):
        obj = None
    suffix = ""
    while obj is not None and obj is not kernel:
        obj, suffix = getattr(obj, "fn", None), suffix + ".fn"
    if obj is None:
        raise ManifestError(
            f"{where}: kernel {ref} is not reachable as a module attribute: expected a kernel defined at module "
            f"level (a build process must import it by name)"
        )
    return ref + suffix


def _encode(value: Any, where: str) -> Any:
    """A launch argument -> JSON: tensors keep dtype and shape only (what specialization and heuristics see)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    cls = f"{type(value).__module__}.{type(value).__qualname__}"
    if cls == "torch.dtype":
        return {"tensor": str(value).removeprefix("torch."), "shape": [1]}
    if hasattr(value, "data_ptr") and hasattr(value, "dtype") and hasattr(value, "shape"):
        from ..providers.capture import misaligned

        out = {"tensor": str(value.dtype).removeprefix("torch."), "shape": [int(s) for s in value.shape]}
        if misaligned(value):  # a view whose pointer Triton finds not 16-byte aligned (its specialization class):
            out["aligned"] = False  # kept, so the request binds the same; written only then (other ids unchanged)
        return out
    if cls == "triton.language.core.constexpr":
        return _encode(value.value, where)
    if cls == "triton.language.core.dtype":
        return {"tl_dtype": str(value)}
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode(v, where) for v in value]}
    raise ManifestError(f"{where}: {value!r} ({cls}): expected a tensor, a scalar, a dtype or a tuple of those")


def decode(value: Any) -> Any:
    """JSON -> an argument for the real JIT path (tensors become ``meta`` tensors: no memory, 16-byte aligned, or
    one element in where the launch's pointer was not)."""
    if isinstance(value, dict):
        if "tensor" in value:
            import torch

            t = torch.empty(value["shape"], dtype=getattr(torch, value["tensor"]), device="meta")
            if value.get("aligned", True):
                return t
            base = torch.empty(t.numel() + 1, dtype=t.dtype, device="meta")
            return base.as_strided(t.shape, t.stride(), 1)
        if "tl_dtype" in value:
            import triton.language as tl

            return tl.dtype(value["tl_dtype"])
        if "tuple" in value:
            return tuple(decode(v) for v in value["tuple"])
    return value


def _short(v: Any) -> str:
    if isinstance(v, dict) and "tensor" in v:
        return f"{v['tensor']}{list(v['shape'])}" + ("@unaligned" if v.get("aligned", True) is False else "")
    if isinstance(v, dict) and "tuple" in v:
        return "(" + ", ".join(_short(x) for x in v["tuple"]) + ")"
    if isinstance(v, dict) and "tl_dtype" in v:
        return v["tl_dtype"]
    return repr(v)


def describe_specialization(spec: tritoncompat.Specialization) -> str:
    """"BT=64 BK=32 warps=4 stages=3": the constexprs and options that tell one compile of a kernel from another."""
    parts = [f"{name}={a.value}" for name, a in spec.args.items() if a.type == "constexpr"]
    parts.append(f"warps={spec.options.get('num_warps')} stages={spec.options.get('num_stages')}")
    return " ".join(parts)


# --- expansion into compiles (needs an active target) -----------------------------------------------------------


@dataclass(frozen=True)
class CompileCount:
    """How many compiles one manifest entry plans for one kernel, and how many of those closing added."""

    source: str  # the manifest entry, e.g. "kernels[0] /path/app.jsonl"
    kernel: str
    requests: int
    compiles: int
    closing: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Planned:
    """A manifest's requests expanded into Triton's compiles under its target (activated in this process)."""

    manifest: Manifest
    target: Any  # a prewarm.building.backends Target
    requests: list[Request]  # those whose kernel this Triton can key (the others are in ``will_fail``)
    compiles: list[Compile]
    will_fail: list[WillFail] = field(default_factory=list)
    pins: dict = field(default_factory=dict)  # kernel -> its autotune pin (prewarm.planning.pins.PinnedRow): planned alone
    jit: list[JitRequest] = field(default_factory=list)  # modules past Triton (prewarm.jit): built by their library

    def counts(self) -> list[CompileCount]:
        """Compiles per manifest entry and kernel, the most first (a compile two requests make counts once, for
        the first)."""
        source = {r.ident: r.source for r in self.requests}
        requests = Counter((r.source, r.kernel) for r in self.requests)
        compiles = Counter((source[c.request], c.kernel) for c in self.compiles)
        closing = Counter((source[c.request], c.kernel) for c in self.compiles if c.closing)
        rows = [CompileCount(s, k, n, compiles[s, k], closing[s, k]) for (s, k), n in requests.items()]
        return sorted(rows, key=lambda c: -c.compiles)


def plan_for(manifest: Manifest, target: Any) -> Planned:
    """The one way to plan and expand: ``target`` activated (its device view), ``manifest`` planned, every
    request expanded into Triton's compiles under it, except those of a kernel this Triton cannot key
    (:func:`set_apart_will_fail`). Build, will-hit, explain and ``plan --compiles`` use it."""
    target.activate()
    p = plan(manifest)
    requests, will_fail = set_apart_will_fail(p.requests)
    pins = manifest_pins(manifest)
    return Planned(manifest, target, requests, expand_all(requests, pins), will_fail, pins, p.jit)


def expand_all(requests: list[Request], pins: dict | None = None) -> list[Compile]:
    """Every request's compiles, each distinct compile once (two calls can make the same request of Triton, and
    closing one recorded request can give another; the request itself is kept over a closing variant of another)."""
    out: dict[str, Compile] = {}
    for r in requests:
        for c in expand(r, pins):
            same = tritoncompat.on_disk(c.specialization)
            if same not in out or out[same].closing and not c.closing:
                out[same] = c
    return list(out.values())


def expand(request: Request, pins: dict | None = None) -> list[Compile]:
    """The compiles Triton makes for ``request`` under the active target: one per autotune config, in order; a
    kernel ``pins`` names (:func:`manifest_pins`) in its pinned config alone, as its Autotuner under the guard."""
    if request.specialization is not None:
        variants = [("", request.parsed), *other_dtypes(request.parsed, request.close_dtypes)]
        if request.close:
            kernel = resolve(request.kernel)
            variants += [(f"{what} {ints}".strip(), closed) for what, spec in variants
                         for ints, closed in other_int_classes(kernel, spec, request.close)]
        return [Compile(request.ident, request.kernel, f"{request.label} [closed: {what}]" if what else request.label,
                        spec.data, what) for what, spec in variants]  # fmt: skip
    kernel = resolve(request.kernel)
    args = tuple(decode(a) for a in request.args)
    kwargs = {k: decode(v) for k, v in request.kwargs.items()}
    tuner = tritoncompat.find_autotuner(kernel) if pins else None
    pin = pins.get(tritoncompat.kernel_ref(tuner)) if tuner is not None else None
    if pin is not None:
        from .pins import pinned_config

        kernel = tritoncompat.with_configs(kernel, [pinned_config(tuner, pin)])
    with tritoncompat.compile_requests(skip=True) as captured:
        tritoncompat.warmup(kernel, args, kwargs, grid=(1,))
    unique = list(dict.fromkeys(captured))
    many = len(unique) > 1 or pin is not None
    return [
        Compile(request.ident, request.kernel,
                f"{request.label} [{'pinned: ' if pin else ''}"
                f"{describe_specialization(tritoncompat.parse_specialization(d))}]" if many else request.label, d)
        for d in unique
    ]  # fmt: skip


# --- kernels this Triton cannot key ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WillFail:
    """A planned kernel this process's Triton cannot key: computing its ``cache_key`` (its source hashed, every name
    and attribute it uses resolved, its callees' keys) raises. The node's JIT computes that key at the kernel's
    first call, before any cache lookup, so no cache can hold it: the node crashes there, prewarmed or not. Its
    requests are planned and listed here, never compiled."""

    kernel: str  # "module:qualname"
    file: str  # the kernel's source file
    line: int  # the line of its ``def``
    triton: str  # "triton-ascend 3.2.0": the Triton that cannot key it
    error: str  # the exception's type, e.g. "AttributeError"
    reason: str  # the exception's text
    fix: str
    requests: tuple[Request, ...] = field(compare=False)  # the planned requests that reach it, in plan order

    @property
    def node(self) -> str:
        """What happens on a node with this Triton."""
        return (f"the node's first call of this kernel raises {self.error} in the JIT (before any cache lookup): the "
                f"server crashes at its first {self.requests[0].label!r}")

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "file": self.file, "line": self.line, "triton": self.triton,
                "error": self.error, "reason": self.reason, "node": self.node, "fix": self.fix,
                "requests": [r.ident for r in self.requests], "labels": [r.label for r in self.requests]}


def set_apart_will_fail(requests: list[Request]) -> tuple[list[Request], list[WillFail]]:
    """(the requests whose kernel this process's Triton can key, a :class:`WillFail` for each kernel it cannot with
    the requests that reach it), both in plan order. Expanding a request does not need the key (the JIT binds and
    specializes first); compiling, looking it up and lowering do: the requests set apart go to none of them."""
    verdicts: dict[str, WillFail | None] = {}
    reach: dict[str, list[Request]] = defaultdict(list)
    keyable = []
    for r in requests:
        if r.kernel not in verdicts:
            verdicts[r.kernel] = _unkeyable(r.kernel)
        if verdicts[r.kernel] is None:
            keyable.append(r)
        else:
            reach[r.kernel].append(r)
    return keyable, [dataclasses.replace(verdicts[k], requests=tuple(rs)) for k, rs in reach.items()]


def _unkeyable(ref: str) -> WillFail | None:
    """The verdict on kernel ``ref`` (without its requests), or None: this Triton computes its ``cache_key``, or
    the kernel's module does not even import here (a library that asks the device at import: each of its compiles
    then fails in the build with the library's own error, as before)."""
    try:
        jit = tritoncompat.jit_function(resolve(ref))
    except Exception:  # noqa: BLE001  (the build reports it per compile, with what to name)
        return None
    try:
        jit.cache_key  # noqa: B018  (Triton's own computation, as the node's first call runs it)
        return None
    except Exception as e:  # noqa: BLE001  (whatever the walk raises, the node's JIT raises too)
        error = e
    fn = jit.fn
    lines, start = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    line = start + next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)).lineno - 1
    dist, version = tritoncompat.triton_distribution()
    reason = re.sub(r" at 0x[0-9a-f]+>", ">", str(error))  # "<function f at 0x7f...>": the plan stays deterministic
    return WillFail(ref, inspect.getsourcefile(fn) or "?", line, f"{dist} {version}", type(error).__name__, reason,
                    _fix(error, tree, start, dist), ())


_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")


def _fix(error: Exception, tree: ast.AST, start: int, dist: str) -> str:
    """What would let a node run the kernel: a Triton that has what the source names, or a source that does not
    name it (each use of a missing attribute in the kernel's own source named with its line)."""
    missing = _NO_ATTRIBUTE.fullmatch(str(error)) if isinstance(error, AttributeError) else None
    if missing is None:
        return f"a {dist} that can hash this kernel's source and every name it uses, or a kernel source it can hash"
    module, attr = missing.groups()
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    uses = {}  # each whole attribute chain through the missing attribute ("tl.extra.cuda.gdc_wait") -> its line
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and id(n) not in inner:
            chain, a = [], n
            while isinstance(a, ast.Attribute):
                chain, a = [*chain, a.attr], a.value
            if attr in chain:
                uses.setdefault(ast.unparse(n), start + n.lineno - 1)
    where = ("the kernel's source names " + ", ".join(f"{text} (line {line})" for text, line in
                                                       sorted(uses.items(), key=lambda u: u[1]))
             if uses else "a function the kernel calls names it")
    return f"a {dist} whose {module} has {attr} ({where}), or a kernel source without it"


# --- closing recorded traffic ------------------------------------------------------------------------------------


def other_dtypes(spec: tritoncompat.Specialization,
                 close_dtypes: tuple) -> list[tuple[str, tritoncompat.Specialization]]:
    """``spec`` (a recorded compile request) with the pointer parameters ``close_dtypes`` names in every other
    combination of their listed dtypes (the recorded one included as a choice), as (description, request) pairs: one
    recording covers the dtypes a manifest declares. Each type is Triton's own name for a tensor of that dtype (a
    const pointer stays const); parameters the kernel lacks, or recorded as no pointer, are left as recorded.
    Constexprs a wrapper or heuristic derived from a dtype stay as recorded (the guard names such a miss); the
    in-memory ``key`` is kept, as :func:`other_int_classes` keeps it."""
    pointers = spec.pointers
    axes = []  # (param, [recorded type, other types...])
    for param, names in close_dtypes:
        if param in pointers:
            recorded = pointers[param]
            types = [tritoncompat.pointer_type(n, const=recorded.startswith("*k")) for n in names]
            axes.append((param, list(dict.fromkeys([recorded, *types]))))
    out = []
    for combo in itertools.product(*(types for _, types in axes)):
        changed = {param: ty for (param, types), ty in zip(axes, combo) if ty != types[0]}
        if changed:
            what = " ".join(f"{param}={ty}" for param, ty in changed.items())
            out.append((what, spec.with_pointer_types(changed)))
    return out


def _check_close_dtypes(manifest: Manifest, src: KernelSource, requests: list[Request]) -> None:
    """Every parameter ``close_dtypes`` names is a pointer of some recorded kernel (a typo closes nothing)."""
    pointers = {p for r in requests for p in r.parsed.pointers}
    for param, names in src.close_dtypes:
        if param not in pointers:
            raise ManifestError(
                f"{manifest.path}: {src.where}.close_dtypes.{param} = {list(names)!r}: no recorded kernel has a "
                f"pointer parameter {param!r}: expected one of {', '.join(sorted(pointers)) or '(none recorded)'}"
            )


def _check_close(manifest: Manifest, src: KernelSource, requests: list[Request]) -> None:
    """Every parameter ``close = [...]`` names is a specialized int of some recorded kernel (a typo, a constexpr
    or a ``do_not_specialize`` parameter closes nothing)."""
    if not isinstance(src.close, tuple):
        return
    recorded: dict[str, set] = defaultdict(set)  # kernel -> its int arguments in the recording
    for r in requests:
        recorded[r.kernel].update(r.parsed.int_classes)
    ints = {p for kernel, names in recorded.items() for p in specialized_ints(resolve(kernel)) if p in names}
    for param in src.close:
        if param not in ints:
            raise ManifestError(
                f"{manifest.path}: {src.where}.close = {list(src.close)!r}: no recorded kernel has a specialized int "
                f"parameter {param!r} (a constexpr, do_not_specialize or pointer parameter has no class to close): "
                f"expected one of {', '.join(sorted(ints)) or '(none recorded)'}"
            )


# How a closed request's label names an int argument's class
_CLASS_LABELS = {tritoncompat.INT_ONE: "=1", tritoncompat.INT_DIVISIBLE: "%16=0", tritoncompat.INT_OTHER: " other"}


def specialized_ints(kernel: Any) -> list[str]:
    """The kernel's int parameters Triton specializes (not constexpr, not ``do_not_specialize``, not annotated)."""
    return [p.name for p in tritoncompat.jit_function(kernel).params
            if not (p.is_constexpr or p.do_not_specialize or getattr(p, "annotation_type", None))]  # fmt: skip


def other_int_classes(kernel: Any, spec: tritoncompat.Specialization,
                      params: tuple[str, ...]) -> list[tuple[str, tritoncompat.Specialization]]:
    """``spec`` (a recorded compile request) with its int arguments ``params`` in every other combination of the
    classes Triton tells apart (equal to 1: compiled in; a multiple of 16; neither), as (description, request)
    pairs, so a recording from one traffic sample also covers the next batch size. Arguments the kernel declares
    ``do_not_specialize`` (fla's T and N), constexprs and annotated ones are left as recorded, and so is triton 3.2
    data (its ``int_classes`` are empty). The data's ``key`` is kept."""
    recorded = spec.int_classes
    specialized = set(specialized_ints(kernel))
    choices = []  # (param, width, classes, recorded class)
    for p in tritoncompat.jit_function(kernel).params:
        if p.name not in recorded or p.name not in params or p.name not in specialized:
            continue
        width, now = recorded[p.name]
        classes = [c for c in tritoncompat.INT_CLASSES[width]
                   if not (c == tritoncompat.INT_DIVISIBLE and p.do_not_specialize_on_alignment)]  # fmt: skip
        choices.append((p.name, width, classes, now))
    out = []
    for combo in itertools.product(*(c[2] for c in choices)):
        if all(cls == c[3] for cls, c in zip(combo, choices)):
            continue  # the recorded request itself
        what = " ".join(f"{name}{_CLASS_LABELS[cls]}" for cls, (name, _, _, _) in zip(combo, choices))
        closed = {name: (width, cls) for cls, (name, width, _, _) in zip(combo, choices)}
        out.append((what, spec.with_int_classes(closed)))
    return out
