"""Recordings that check themselves: does this host compute the on-disk key a recorded process looked each request
up under, and where it does not, which part of the key differs?

A record line carries the key its process's Triton computed and the parts Triton composed it of
(:func:`prewarm.building.tritoncompat.cache_key_parts`: the triton build, the kernel's source, starting line, the constexpr
globals it reads and the functions it calls, the backend (CUDA: ptxas's version and the arch), every option, the
env vars of the key). Here the same request is keyed by Triton's own lookup (the probe build and will-hit share);
where the keys differ the parts are recomputed under the active target and compared part by part. Build refuses a
plan whose keys the recording's node would not look up (it would ship a cache that node never hits); will-hit
names the differing part in its rows, so a verdict that differs between two hosts says why.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from . import tritoncompat
from ..node.explain import Difference
from ..planning.plan import Compile, Request, resolve

SIDES = ("recorded", "here")
ABSENT = "absent"


@dataclass(frozen=True)
class KeyDrift:
    """A recorded request whose key this host does not reproduce, and each part that differs."""

    compile_index: int  # its position in the planned compiles
    label: str
    kernel: str
    where: str  # the record line, "FILE:LINE"
    recorded: str  # the key dir the recorded process looked the request up in
    here: str  # the key dir Triton computes for it here
    differences: tuple[Difference, ...]

    def summary(self) -> str:
        """One line: both keys and every differing part."""
        parts = "; ".join(d.format(SIDES) for d in self.differences)
        return f"the recording's process ({self.where}) looked it up under {self.recorded}, here {self.here}: {parts}"

    def to_json(self) -> dict:
        return {"label": self.label, "kernel": self.kernel, "where": self.where, "recorded": self.recorded,
                "here": self.here, "differences": [d.to_json(SIDES) for d in self.differences]}  # fmt: skip


def _values(kind: str, recorded: dict, here: dict, missing: str = ABSENT) -> list[Difference]:
    """A Difference per name whose value differs between two name -> value maps."""
    return [Difference(kind, n, str(recorded.get(n, missing)), str(here.get(n, missing)))
            for n in sorted(set(recorded) | set(here)) if recorded.get(n, missing) != here.get(n, missing)]  # fmt: skip


def _different_lines(recorded: str, here: str) -> tuple[str, str]:
    """What tells two multi-line texts apart, one line each (CUDA's backend.hash(): ptxas's version text, then the
    arch): a line only one side has, the release line first where both sides have one."""
    a, b = recorded.splitlines(), here.splitlines()
    only_a, only_b = [x.strip() for x in a if x not in b], [y.strip() for y in b if y not in a]
    if not only_a or not only_b:
        return " ".join(recorded.split()), " ".join(here.split())
    release = [next((x for x in side if "release" in x), None) for side in (only_a, only_b)]
    return (release[0], release[1]) if all(release) else (only_a[0], only_b[0])


def _short(digest: str) -> str:
    return f"sha256 {digest[:12]}"


def _kernel_differences(name: str, recorded: dict, here: dict) -> list[Difference]:
    out = []
    if recorded.get("source") != here.get("source"):
        out.append(Difference("source", name, _short(str(recorded.get("source"))), _short(str(here.get("source")))))
    if recorded.get("line") != here.get("line"):
        out.append(Difference("line", name, str(recorded.get("line")), str(here.get("line"))))
    out += _values("global", recorded.get("globals", {}), here.get("globals", {}), "not read")
    calls_r, calls_h = recorded.get("calls", {}), here.get("calls", {})
    for ref in sorted(set(calls_r) | set(calls_h)):
        r, h = calls_r.get(ref), calls_h.get(ref)
        if r is None or h is None:
            out.append(Difference("call", ref, "called" if r else "not called", "called" if h else "not called"))
        elif r.get("line") != h.get("line"):
            out.append(Difference("call", f"{ref} line", str(r.get("line")), str(h.get("line"))))
        elif r.get("source") != h.get("source"):
            out.append(Difference("call", f"{ref} source", _short(str(r.get("source"))), _short(str(h.get("source")))))
        elif r.get("cache_key") != h.get("cache_key"):
            out.append(Difference("call", f"{ref} (a function it calls, or a global one reads)",
                                  _short(str(r.get("cache_key"))), _short(str(h.get("cache_key")))))
    if not out and recorded.get("cache_key") != here.get("cache_key"):
        out.append(Difference("source", f"{name} cache_key", _short(str(recorded.get("cache_key"))),
                              _short(str(here.get("cache_key")))))
    return out


def compare(kernel: str, recorded: dict, here: dict) -> list[Difference]:
    """Every part of two keys' parts (``tritoncompat.cache_key_parts``) that differs, named: the triton build, the
    backend, each option, each env var, the kernel's source / line / globals / callees, the request's own hash."""
    out = []
    tr, th = recorded.get("triton", {}), here.get("triton", {})
    if tr.get("version") != th.get("version"):
        out.append(Difference("triton", "version", str(tr.get("version")), str(th.get("version"))))
    elif tr.get("digest") != th.get("digest"):
        out.append(Difference("triton", "build (triton_key: its compiler sources, libtriton.so, the Python ABI)",
                              _short(str(tr.get("digest"))), _short(str(th.get("digest")))))
    if recorded.get("backend") != here.get("backend"):
        out.append(Difference("backend", "backend.hash() (CUDA: ptxas --version and the arch; Ascend: the SoC)",
                              *_different_lines(str(recorded.get("backend")), str(here.get("backend")))))
    opt_r, opt_h = recorded.get("options", {}), here.get("options", {})
    options = _values("option", opt_r.get("values", {}), opt_h.get("values", {}))
    if not options and opt_r.get("digest") != opt_h.get("digest"):
        options = [Difference("option", "options.hash()", _short(str(opt_r.get("digest"))),
                              _short(str(opt_h.get("digest"))))]
    out += options
    out += _values("env", recorded.get("env", {}), here.get("env", {}), "unset")
    kernel_diffs = _kernel_differences(kernel.rsplit(":", 1)[-1], recorded.get("kernel", {}), here.get("kernel", {}))
    out += kernel_diffs
    if not out and recorded.get("request") != here.get("request"):
        out.append(Difference("request", "src.hash() (the kernel's key with the request's signature, constexprs, attrs)",
                              _short(str(recorded.get("request"))), _short(str(here.get("request")))))
    if not out:  # the parts prewarm reads no longer make up compile()'s key: a triton prewarm does not know
        out.append(Difference("request", "key", "every recorded part equal",
                              "a different key (report it: prewarm's reading of compile()'s key is out of date)"))
    return out


def check(requests: list[Request], compiles: list[Compile], keys: list[str | None] | None = None) -> list[KeyDrift]:
    """Every compile that is a recorded request as recorded (not a closing variant) whose key here (``keys[i]``,
    the probe's for compile i; computed by Triton's own lookup where not given) is not the key its recorded process
    saw, with the differing parts. Requests recorded without a key (older prewarm) are not checked."""
    recorded: dict[str, tuple] = defaultdict(tuple)  # on-disk request -> the keys its recorded processes saw
    for r in requests:
        if r.specialization is not None and r.recorded:
            recorded[tritoncompat.on_disk(r.specialization)] += r.recorded
    same = [tritoncompat.on_disk(c.specialization) if not c.closing else None for c in compiles]
    todo = [i for i in range(len(compiles)) if same[i] in recorded]
    if keys is None:
        keys = _keys_here(compiles, todo)
    out = []
    for i in todo:
        c, here = compiles[i], keys[i]
        for seen in recorded[same[i]]:
            if seen.key is None or here is None or seen.key == here:
                continue
            _, parts = tritoncompat.cache_key_parts(resolve(c.kernel), c.specialization)
            out.append(KeyDrift(i, c.label, c.kernel, seen.where, seen.key, here,
                                tuple(compare(c.kernel, seen.parts, parts))))
    return out


def _keys_here(compiles: list[Compile], indices: list[int]) -> list[str | None]:
    """The key dir Triton looks each of ``indices``' compiles up in (probe.lookup; None for the others)."""
    from .probe import ProbeCacheManager, lookup

    keys: list[str | None] = [None] * len(compiles)
    with tritoncompat.cache_scope(os.path.abspath(tritoncompat.cache_dir()), ProbeCacheManager):
        for i in indices:
            p = lookup(resolve(compiles[i].kernel), compiles[i].specialization)
            keys[i] = p.key if p is not None and p.filename.endswith(".json") else None  # not a runtime module's
    return keys


def unchecked(requests: list[Request]) -> int:
    """Recorded requests whose recording carries no key (an older prewarm, or the process could not compute it)."""
    return sum(r.specialization is not None and not any(k.key for k in r.recorded) for r in requests)


def refusal(drift: list[KeyDrift], requests: list[Request]) -> str:
    """The message of a build refused for key drift: how many, then each distinct set of differing parts once, with
    up to three of the requests it concerns."""
    recorded = sum(any(k.key for k in r.recorded) for r in requests)
    groups: dict[tuple[str, ...], list[KeyDrift]] = defaultdict(list)
    for d in drift:
        groups[tuple(x.format(SIDES) for x in d.differences)].append(d)
    lines = [f"{len({d.compile_index for d in drift})} of {recorded} recorded requests would not be found by the "
             f"recording's node: this host computes other cache keys than the process that recorded them"]
    for parts, items in sorted(groups.items(), key=lambda g: -len(g[1])):
        lines.append(f"  {len(items)} differing in: " + "; ".join(parts))
        lines += [f"    {d.label} ({d.where}): recorded {d.recorded}, here {d.here}" for d in items[:3]]
        if len(items) > 3:
            lines.append(f"    ... {len(items) - 3} more")
    lines.append("  the node would compile each of them: build where the node's toolchain, env and kernel sources "
                 "are (or fix the difference); --allow-key-drift builds anyway")
    return "\n".join(lines)
