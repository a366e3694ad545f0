"""The EAGLE worker's JIT modules as sglang 0.5.23 runs them on CUDA: the JIT rows of the model component
``spec_worker`` of ``prewarm.providers.sglang.cuda`` (its Triton kernels: :mod:`.model_spec_worker`).

``eagle_utils.verify`` (the target verify of every EAGLE step, chain or tree) accepts the draft tokens with
``verify_tree_greedy_func``, on CUDA sglang's JIT ``verify_tree_greedy`` (``sglang.kernels.ops.speculative.tree``:
module ``speculative_tree``, no template arguments), for a batch whose requests are all greedy; a batch with a
sampled request (temperature > 0) takes ``tree_speculative_sampling_target_only``
(``sglang.kernels.ops.speculative.sampling``: module ``speculative_sampling`` with ``vec_size = gcd(4, vocab)`` and
``deterministic``, which ``verify`` always passes True) unless ``--speculative-use-rejection-sampling`` (a Triton
kernel, not planned here). A tree draft (``--speculative-eagle-topk`` > 1, ``spec.sglang.eagle_tree``) builds its tree
with ``build_tree_kernel_efficient`` (``build_tree_kernel_efficient_func``: the same ``speculative_tree`` module).
:func:`calls` makes each of those calls with the tensors ``verify`` / ``build_tree_kernel_efficient`` hand them, at
every draft width, chain and (with ``eagle_tree``) tree; the modules they load are the plan's JIT requests.
"""
from __future__ import annotations

from typing import Callable, Iterator

COMPONENT = "spec_worker"
KERNELS = ()  # no Triton kernel here (the worker's Triton kernels: model_spec_worker)
TREE, SAMPLING = "sglang.kernels.ops.speculative.tree", "sglang.kernels.ops.speculative.sampling"
DETERMINISTIC = True  # eagle_utils.verify: tree_speculative_sampling_target_only(..., deterministic=True)
NOT_PLANNED = [
    {"what": "the sampled verify under --speculative-use-rejection-sampling",
     "why": "chain_speculative_sampling_triton, a Triton kernel this module does not drive"},
]


def calls(spec: dict, s, device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, thunk) of the verify accept (greedy; sampled where ``[spec.sglang.model] vocab_size`` is stated) at
    each draft width, chain and (``eagle_tree``) tree, and the tree build; none without draft widths (no EAGLE)."""
    from prewarm_kernels.spec import SpecError

    vocab = ((spec.get("sglang") or {}).get("model") or {}).get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise SpecError("sglang.model.vocab_size", vocab, "a positive integer: config.json vocab_size")
    for width in s.draft_widths:
        for tree in (False, True) if s.eagle_tree else (False,):
            shape = f"draft={width},{'tree' if tree else 'chain'}"
            yield f"{COMPONENT}/verify_tree_greedy[{shape}]", lambda w=width: _verify_greedy(w, device)
            if vocab is not None:
                yield (f"{COMPONENT}/tree_speculative_sampling_target_only[{shape},vocab={vocab}]",
                       lambda w=width: _verify_sampled(w, vocab, device))
            if tree:
                yield f"{COMPONENT}/build_tree_kernel_efficient[{shape}]", lambda w=width: _build_tree(w, device)


def _accept_buffers(draft: int, device: str):
    """What ``verify`` allocates for one request: ``predict`` ``[draft]`` int32, ``accept_index`` ``[1, depth]``
    int32 (depth: the draft's, at most its width), ``num_correct_drafts`` ``[1]`` int32, the candidates and the
    retrieve tables ``[1, draft]`` int64."""
    import torch

    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    return (torch.zeros(draft, **i32), torch.full((1, draft), -1, **i32), torch.empty(1, **i32),
            torch.empty(1, draft, **i64), *torch.full((3, 1, draft), -1, **i64))


def _verify_greedy(draft: int, device: str) -> None:
    """``verify_tree_greedy_func`` on CUDA: the target's argmax (int64) against the candidates."""
    import importlib

    import torch

    predict, accept, correct, candidates, index, next_token, next_sibling = _accept_buffers(draft, device)
    importlib.import_module(TREE).verify_tree_greedy(
        predicts=predict, accept_index=accept, accept_token_num=correct, candidates=candidates,
        retrive_index=index, retrive_next_token=next_token, retrive_next_sibling=next_sibling,
        target_predict=torch.empty(1, draft, dtype=torch.int64, device=device))


def _verify_sampled(draft: int, vocab: int, device: str) -> None:
    """``tree_speculative_sampling_target_only`` as ``verify`` calls it: fp32 target probabilities ``[1, draft,
    vocab]`` (softmax, renormed), zero draft probabilities like them, fp32 coins."""
    import importlib

    import torch

    predict, accept, correct, candidates, index, next_token, next_sibling = _accept_buffers(draft, device)
    target = torch.empty(1, draft, vocab, dtype=torch.float32, device=device)
    importlib.import_module(SAMPLING).tree_speculative_sampling_target_only(
        predicts=predict, accept_index=accept, accept_token_num=correct, candidates=candidates,
        retrive_index=index, retrive_next_token=next_token, retrive_next_sibling=next_sibling,
        uniform_samples=torch.empty(1, draft, dtype=torch.float32, device=device),
        uniform_samples_for_final_sampling=torch.empty(1, dtype=torch.float32, device=device),
        target_probs=target, draft_probs=torch.zeros_like(target), threshold_single=1.0, threshold_acc=1.0,
        deterministic=DETERMINISTIC)


def _build_tree(draft: int, device: str) -> None:
    """``build_tree_kernel_efficient_func`` on CUDA for a tree of ``draft`` tokens (topk 2, draft - 1 steps, the full
    mask): the parents and selected indices as the draft's top-k hands them (int64)."""
    import importlib

    import torch

    topk, steps = 2, max(1, draft - 1)
    i64 = dict(dtype=torch.int64, device=device)
    importlib.import_module(TREE).build_tree_kernel_efficient(
        torch.empty(1, topk * (steps - 1) + 1, **i64), torch.empty(1, draft - 1, **i64), torch.empty(1, **i64),
        torch.empty(draft * (draft + 1), dtype=torch.bool, device=device), torch.empty(draft, **i64),
        *torch.full((3, 1, draft), -1, **i64), topk, steps, draft, 0)


def coverage(spec: dict) -> dict:
    """This component's JIT rows of the provider's coverage hook (the modules are listed with the plan's JIT
    modules: the hook counts Triton kernels)."""
    vocab = ((spec.get("sglang") or {}).get("model") or {}).get("vocab_size")
    rows = [dict(d) for d in NOT_PLANNED]
    if vocab is None:
        rows.append({"what": f"{SAMPLING}:tree_speculative_sampling_target_only (sglang JIT module "
                             f"'speculative_sampling')",
                     "why": "no [spec.sglang.model] vocab_size: its vec_size template argument is gcd(4, vocab)"})
    return {"component": COMPONENT, "planned": [], "not_planned": rows}
