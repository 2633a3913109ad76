"""Logits only where a loss reads them: the vocabulary projection over selected positions.

Input: a causal LM (a Hugging Face model, the module a trainer wraps) and a boolean mask
`[rows, width]` of the positions a loss reads. Output, while `scored_only` is open: the
model's logits as `[1, N, vocab]`, N the mask's True count, in row-major order.

At a 150k-token vocabulary the projection (and its gradient) is the largest cost of a
forward and backward; a loss reads only the answer tokens. A forward pre-hook on the output
embeddings selects the hidden states, so the pass still enters through the model's
top-level forward (DeepSpeed's engine and ZeRO-3's hooks, the torch trainer's autocast) and
works the same on every transformers release (a 2-D `logits_to_keep` is new in 5.24). The
rl stage's log-probabilities and the train stage's SFT and DPO losses use it, and
`token_logprobs`, the one function both turn those logits into log-probabilities with.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


@contextmanager
def scored_only(module: torch.nn.Module, mask: torch.Tensor | None) -> Iterator[None]:
    """While open, `module`'s vocabulary projection sees only the hidden states where `mask`
    ([rows, width]) is True, flattened row-major as one row: logits come out `[1, N, vocab]`.
    A forward pre-hook, so the pass still enters through the model's top-level forward."""
    if mask is None:
        yield
        return
    head = module.get_output_embeddings()  # type: ignore[operator]
    assert isinstance(head, torch.nn.Module), f"{type(module).__name__} has no output embeddings"

    def select(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0][mask].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


IGNORE = -100  # a target no loss reads (Hugging Face's label padding)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) at every position under `softmax(logits / temperature)`, in fp32; 0 where
    the target is `IGNORE`. train's losses read it at temperature 1, rl's ratio and KL at the
    sampling temperature (the policy the engine sampled from)."""
    scaled = logits.float() / max(temperature, 1e-6)
    flat = F.cross_entropy(
        scaled.reshape(-1, scaled.shape[-1]),
        targets.reshape(-1).to(logits.device),
        ignore_index=IGNORE,
        reduction="none",
    )
    return -flat.view(targets.shape)
