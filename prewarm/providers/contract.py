"""What prewarm asks of a kernel provider, of an integration and of a server: the hooks, written once.

- A **kernel provider** is a module a manifest names (``[[kernels]] provider = "..."``): ``launches(spec)`` (required)
  returns the launches its calls make (each with ``kernel``, ``args``, ``kwargs``, optionally ``label``) and the
  :class:`prewarm.jit.JitRequest` objects of the modules past Triton they reach; ``options(spec)`` (optional) lists,
  per axis of its library's API, the values planned against those the library accepts; ``run(spec, device)``
  (optional) runs the same calls on a real device once (the CUDA device build caches autotune results and
  launchers with it); ``coverage(spec)`` (optional) says, per model component, what it plans and what the model
  reaches that it does not (:class:`KernelProvider`); its launches' labels then start with their component
  (``"moe/..."``). ``prewarm plan`` prints it per component; a provider without it is one component.
- An **integration** (:class:`Integration`) is one library prewarm plans for: the provider of its own kernels for
  each target backend (``prewarm manifest --kernels NAME``) and its JIT library, where it builds modules past Triton
  (:class:`prewarm.jit.JitLibrary`).
- A **server** (:class:`Server`) is an integration that serves: its launch line and defaults (read by
  ``prewarm manifest``), the module a server process imports first (``verify --server`` runs it to learn where that
  process reads its caches), the JIT libraries its processes reach.

Each is checked once, when loaded (:func:`prewarm.providers.provider`, :func:`prewarm.providers.integration`): a
missing or non-callable hook is a ManifestError naming the module and the hook, not an AttributeError later.
"""
from __future__ import annotations

import abc
import argparse
from typing import Any, ClassVar, Iterable, Mapping, Protocol, runtime_checkable

PROVIDER_HOOKS = ("launches",)  # a kernel provider module must define these
OPTIONAL_PROVIDER_HOOKS = ("options", "run", "coverage")  # and may define these (callable where present)


@runtime_checkable
class KernelProvider(Protocol):
    """A provider module, as the planner calls it (``options``, ``run`` and ``coverage`` may be absent).

    ``coverage(spec) -> list[dict]``: one dict per model component the provider's plan is cut into,

        {"component": "moe",                               # short name: kda, mla, attn_residual, dense_mlp, moe,
                                                           # runner, allocator, logits, sampler, spec_worker, ...
         "planned": ["sgl_kernel_npu.activation.situ:_situ_kernel", ...],   # "module:kernel" refs it launches
         "not_planned": [{"what": "module:kernel or a named JIT module/op", "why": "one line: the reason"}]}

    with every launch labelled ``component/...``; the planner counts each component's kernels, requests and
    compiles from those labels (:func:`prewarm.planning.plan.coverage`), so the hook states names and reasons only."""

    def launches(self, spec: dict) -> Iterable[Any]: ...


class Integration:
    """One library prewarm plans for: one row of :data:`prewarm.providers.KNOWN_IMPLEMENTATIONS`."""

    name: ClassVar[str]  # the registry's key; a JitRequest's ``library`` where it builds modules past Triton
    kernel_providers: ClassVar[Mapping[str, str]] = {}  # target backend ("*": any) -> the provider of its own kernels
    jit_library: ClassVar[str | None] = None  # "module:Class" of its JitLibrary, where it JIT-builds modules
    reads_running_requests: ClassVar[bool] = False  # its providers plan every eager decode batch size up to the cap

    def provider_for(self, backend: str) -> str:
        """The provider module of this integration's own kernels on ``backend``."""
        from ..errors import ManifestError

        found = self.kernel_providers.get(backend) or self.kernel_providers.get("*")
        if found is None:
            raise ManifestError(f"--kernels {self.name}: no provider of {self.name}'s kernels for backend {backend!r} "
                                f"(it has {', '.join(self.kernel_providers) or 'none'})")
        return found

    def check_spec(self, spec: dict) -> None:
        """Read ``spec`` as this integration's providers read it (a SpecError naming the key where one cannot)."""
        from prewarm_kernels.spec import read_kda

        read_kda(spec)


class Server(Integration, abc.ABC):
    """An integration that serves: what ``prewarm manifest`` reads from its launch line, and what its processes do
    to the cache dirs (``verify --server``). Values go back as ``prewarm.planning.manifestgen.Sourced`` (value, source) pairs;
    ``cfg`` is a ``prewarm.planning.manifestgen.ModelConfig`` (not imported here: manifestgen reads this registry)."""

    version: ClassVar[str]  # the release whose source the defaults below were read from ("sglang 0.5.23")
    imports: ClassVar[str | None] = None  # the module a server process imports first (None: verify cannot ask it)
    jit_libraries: ClassVar[tuple[str, ...]] = ()  # the integrations whose JIT modules its processes may build
    default_kernels: ClassVar[str | None] = None  # `prewarm manifest --kernels` when not given

    def argv(self, argv: list[str]) -> list[str]:
        """The launch line in the spelling :meth:`add_flags` reads (as the server's own parser rewrites it first)."""
        return list(argv)

    @abc.abstractmethod
    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """The flags that fix the KDA kernels' envelope, as the server spells them (every spelling it accepts)."""

    @abc.abstractmethod
    def parallel(self, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
        """``[spec.parallel]``: tensor_parallel and attention_dp, each with its source."""

    @abc.abstractmethod
    def serving(self, args: argparse.Namespace, argv: list[str], profile: Any, arch: str
                ) -> tuple[dict[str, Any], Any, list[str]]:
        """(``[spec.serving]``, the running-request cap or None, notes) from the flags and the server's defaults
        (``profile``: the --target device's profile, None where none was named)."""

    def own_kernels_spec(self, args: argparse.Namespace, argv: list[str], cfg: Any,
                         serving: dict[str, Any], backend: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """(``[spec.<table>]`` tables, notes) the provider of this server's own kernels reads beyond the common ones."""
        return {}, []

