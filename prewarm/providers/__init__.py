"""The integrations prewarm plans for, one folder each (``sglang/``, ``vllm/``, ``fla/``, ``flashinfer/``), and the
one registry of them: name -> "module:Class" (:data:`KNOWN_IMPLEMENTATIONS`, as fsspec's registry). Adding a server
is one folder (its provider(s), ``server.py``: a :class:`~prewarm.providers.contract.Server`, its JIT library if it
has one) and one row here; nothing outside the folder names it.

A manifest's ``[[kernels]] provider`` is a module (any installed one, not only these): :func:`provider` imports it and
checks it against the contract (:mod:`prewarm.providers.contract`) once. Module names of earlier releases still load
(:data:`ALIASES`).
"""
from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import TYPE_CHECKING

from .contract import OPTIONAL_PROVIDER_HOOKS, PROVIDER_HOOKS

if TYPE_CHECKING:
    from .contract import Integration, Server

KNOWN_IMPLEMENTATIONS = {  # by name, sorted
    "fla": "prewarm.providers.fla:Fla",
    "flashinfer": "prewarm.providers.flashinfer:FlashInfer",
    "sglang": "prewarm.providers.sglang.server:Sglang",
    "vllm": "prewarm.providers.vllm.server:Vllm",
}
ALIASES = {  # provider modules a manifest may still name -> where they live now
    "prewarm.providers.vllm_kda": "prewarm.providers.vllm.kda",
    "prewarm.providers.fla_kda": "prewarm.providers.fla.kda",
}


@functools.cache
def integration(name: str) -> Integration:
    """The registered integration ``name``, loaded and checked against its contract once."""
    from ..errors import ManifestError
    from .contract import Integration

    if name not in KNOWN_IMPLEMENTATIONS:
        raise ManifestError(f"{name!r} is not an integration prewarm knows ({', '.join(KNOWN_IMPLEMENTATIONS)})")
    module, _, attr = KNOWN_IMPLEMENTATIONS[name].partition(":")
    where = f"prewarm.providers.KNOWN_IMPLEMENTATIONS[{name!r}] = {KNOWN_IMPLEMENTATIONS[name]!r}"
    cls = getattr(importlib.import_module(module), attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, Integration)):
        raise ManifestError(f"{where}: {module} has no Integration class {attr}")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    missing += [a for a in ("name", *(("version",) if _is_server(cls) else ())) if not hasattr(cls, a)]
    if missing:
        raise ManifestError(f"{where}: {module}.{attr} lacks {', '.join(missing)} (prewarm.providers.contract)")
    if cls.name != name:
        raise ManifestError(f"{where}: {module}.{attr}.name is {cls.name!r}, not its registry key {name!r}")
    return cls()


def _is_server(cls: type) -> bool:
    from .contract import Server

    return issubclass(cls, Server)


def integrations() -> list[Integration]:
    """Every registered integration, in registry order."""
    return [integration(name) for name in KNOWN_IMPLEMENTATIONS]


def servers() -> dict[str, Server]:
    """The registered integrations that serve (``prewarm manifest --server``), by name."""
    from .contract import Server

    return {i.name: i for i in integrations() if isinstance(i, Server)}


def server(name: str) -> Server:
    """The server ``name``; ManifestError naming the known ones otherwise."""
    from ..errors import ManifestError

    known = servers()
    if name not in known:
        raise ManifestError(f"--server {name!r}: expected one of {', '.join(known)}")
    return known[name]


def jit_libraries() -> dict[str, str]:
    """Integration name -> "module:Class" of its JIT library, for each integration that has one."""
    return {i.name: i.jit_library for i in integrations() if i.jit_library}


def provider_module(ref: str) -> str:
    """The module a manifest's ``provider = ref`` loads (an alias resolved)."""
    return ALIASES.get(ref, ref)


@functools.cache
def provider(ref: str) -> ModuleType:
    """The provider module ``ref`` names, imported and checked against the contract once: ImportError where it
    cannot be imported (the caller names the manifest entry); ManifestError naming the module and the hook where a
    hook is missing or not callable."""
    from ..errors import ManifestError

    module = importlib.import_module(provider_module(ref))
    for hook in PROVIDER_HOOKS:
        if not callable(getattr(module, hook, None)):
            raise ManifestError(f"provider {ref!r} ({module.__name__}): no {hook}(spec) function: expected a kernel "
                                "provider (prewarm.providers.contract)")
    for hook in OPTIONAL_PROVIDER_HOOKS:
        if hasattr(module, hook) and not callable(getattr(module, hook)):
            raise ManifestError(f"provider {ref!r} ({module.__name__}): {hook} is not a function "
                                "(prewarm.providers.contract)")
    return module
