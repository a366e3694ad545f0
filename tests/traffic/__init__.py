"""Traffic written independently of the providers, from each library's own call sites: what the closure tests (on
fake tensors) and the H200 benches (on a GPU) check the plans against. Test support, not part of the shipped package.

One module per provider: ``vllm_kda`` (vLLM's Kimi-Linear layer -> ``prewarm.providers.vllm.kda``), ``sglang_cuda``
(sglang's CUDA KDA backend -> ``prewarm.providers.sglang.cuda``), ``sglang_ascend`` (sglang's Ascend KDA backend ->
``prewarm.providers.sglang.ascend``), ``sglang_ascend_model`` (Kimi K3's step around its KDA layers on sglang's
Ascend path: scheduler, runner, model, DSPARK worker -> the same provider), ``sglang_layer`` (sglang's CUDA KDA layer: ``KDAAttnBackend`` with its conv,
state tracking, verify commit and the model's o_norm -> ``prewarm.providers.sglang.cuda``), ``sglang_cuda_model``
(Kimi-Linear's MoE under sglang's Triton MoE runner at the token counts the model runner's modes hand it -> the same
provider's ``moe`` component), ``sglang_cuda_step`` (Kimi-Linear's steps around those layers: the scheduler's
``req_to_token`` writes, the MLA layers on FA3, the EAGLE v2 worker and its graph runners, the grammar mask, the JIT
modules they reach -> the same provider's other components), ``sglang_graph`` (sglang's serving path around the KDA
layer under CUDA graphs), ``vllm_layer`` (vLLM's Kimi-Linear layer forward), ``vllm_model`` and ``vllm_step`` (the
MoE, the V2 runner, samplers, staged writes, mamba bookkeeping and MTP drafter -> ``prewarm.providers.vllm``'s model
components), ``vllm_runner_step`` (an engine step of vLLM's V2 runner, written apart from those two and from the
provider: the same components and the KV-block zeroer), ``vllm_sampling_options`` (the requests' sampling options
-> the ``sampler_options`` component, written likewise apart), ``fla_kda`` (fla-core's public API -> ``prewarm.providers.fla.kda``); ``closure`` runs traffic and names
what it requested that the plan lacks. :func:`interleave` mixes several generators' calls into one server's steps (the
benches' model-level runs); :func:`fill_expert_alignment` writes, on a GPU without the server's compiled extensions,
what its CUDA MoE align writes. (This project's own kernels' traffic is
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


def fill_expert_alignment(topk_ids, block_size: int, num_experts: int, sorted_ids, expert_ids, num_post_pad) -> None:
    """What a server's CUDA ``moe_align_block_size`` op writes into the buffers its wrapper sized (sgl-kernel's,
    vLLM's ``_moe_C``), in torch: where the traffic runs on a GPU whose image lacks the server's compiled extensions
    (the device's torch is not the one they were built for). Each expert's token slots (flattened ``topk_ids``
    positions, in order) padded to ``block_size`` with the sentinel ``topk_ids.numel()``, the expert of each block,
    the padded total: valid contents, so the Triton GEMMs after it read in range. Keys do not depend on it (the
    buffers' shapes and dtypes are the wrapper's)."""
    import torch

    flat = topk_ids.flatten().long()
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(numel, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    total = int(padded.sum())
    sorted_ids.fill_(numel)
    sorted_ids[starts[experts] + rank] = order.to(sorted_ids.dtype)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    expert_ids.fill_(-1)
    expert_ids[:blocks.numel()] = blocks.to(expert_ids.dtype)
    num_post_pad[0] = total


def interleave(rng: random.Random, **streams: Iterator[Call]) -> Iterator[Call]:
    """The calls of several generators (a layer's, the model components' around it) in a seeded order, as one
    server's steps reach every component in turn; each call's options gain ``traffic`` = its generator's name. Ends
    when every generator is spent."""
    live = dict(streams)
    while live:
        name = rng.choice(sorted(live))
        call = next(live[name], None)
        if call is None:
            del live[name]
            continue
        call.options = {**call.options, "traffic": name}
        yield call
