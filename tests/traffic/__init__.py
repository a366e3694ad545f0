"""Traffic written independently of the providers, from each library's own call sites: what the closure tests (on
fake tensors) and the H200 benches (on a GPU) check the plans against. Test support, not part of the shipped package.

One module per provider: ``vllm_kda`` (vLLM's Kimi-Linear layer -> ``prewarm.providers.vllm.kda``), ``sglang_cuda``
(sglang's CUDA KDA backend -> ``prewarm.providers.sglang.cuda``), ``sglang_ascend`` (sglang's Ascend KDA backend ->
``prewarm.providers.sglang.ascend``), ``sglang_ascend_model`` (Kimi K3's step around its KDA layers on sglang's
Ascend path: scheduler, runner, model, DSPARK worker -> the same provider), ``sglang_layer`` (sglang's CUDA KDA layer: ``KDAAttnBackend`` with its conv,
state tracking, verify commit and the model's o_norm -> ``prewarm.providers.sglang.cuda``), ``sglang_cuda_model``
(Kimi-Linear's MoE under sglang's Triton MoE runner at the token counts the model runner's modes hand it -> the same
provider's ``moe`` component), ``fla_kda`` (fla-core's public API -> ``prewarm.providers.fla.kda``); ``closure``
runs traffic and names what it requested that the plan lacks. (This project's own kernels' traffic is
``prewarm_kernels.kda.traffic``, in their package.)

Imported as ``traffic.<module>`` with ``tests/`` on ``sys.path``: pytest puts it there for every test (tests/ is a
rootdir of conftest.py files, not a package), ``bench/_common.py`` adds it for the benches run from a checkout, and a
child process that imports a generator gets it on ``PYTHONPATH``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator


@dataclass
class Call:
    """One call a traffic generator drew: run it (inside a capture or on a device) to make its launches."""

    label: str
    run: Callable[[], object]
    options: dict = field(default_factory=dict)  # what this call drew (for the bench's JSON and the coverage check)


class ServerTraffic:
    """A server's traffic generator: its envelope ``s`` (the provider's spec reader's), its seeded draws, its device;
    decode batches of every size up to ``s.max_batch``, each once before any twice. A subclass draws call ``i``."""

    def __init__(self, s, rng: random.Random, device: str):
        import torch

        self.s, self.rng, self.device, self.torch = s, rng, device, torch
        self.batches = cycle(rng, range(1, s.max_batch + 1))

    def draw(self, i: int) -> Call:
        raise NotImplementedError

    def calls(self, n: int) -> Iterator[Call]:
        for i in range(n):
            yield self.draw(i)


def cycle(rng: random.Random, values) -> Iterator:
    """Seeded permutations of ``values``, one after the other: every value before any repeats."""
    values = list(values)
    while True:
        rng.shuffle(values)
        yield from list(values)


def short(value) -> str:
    """A drawn value for a call's label (a long list as its length)."""
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} values]"
    return str(value).replace(" ", "")
