"""Logits only where a loss reads them: the vocabulary projection over selected positions.

Input: a causal LM (a Hugging Face model, the module a trainer wraps) and, optionally, a
boolean mask `[rows, width]` of the positions a loss reads. Output, while `flat_head` is open:
the model's logits as `[1, N, vocab]`, N the mask's True count, in row-major order (without a
mask: the logits the model gives, `[B, T, vocab]`), the projection computed on 2-D input.

At a 150k-token vocabulary the projection (and its gradient) is the largest cost of a
forward and backward; a loss reads only the answer tokens. A forward pre-hook on the output
embeddings selects the hidden states, so the pass still enters through the model's
top-level forward (DeepSpeed's engine and ZeRO-3's hooks, the torch trainer's autocast) and
works the same on every transformers release (a 2-D `logits_to_keep` is new in 5.24). The
rl stage's log-probabilities, the train stage's SFT and DPO losses and the local engine's
generation use it, and `token_logprobs`, the one function the losses turn those logits into
log-probabilities with.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


@contextmanager
def flat_head(module: torch.nn.Module, mask: torch.Tensor | None = None) -> Iterator[None]:
    """While open, `module`'s vocabulary projection runs on 2-D hidden states: `[B, T, H]`
    flattened to `[B*T, H]`, its logits shaped back to `[B, T, vocab]`; with `mask`
    ([rows, width]), only the hidden states where it is True, flattened row-major: logits
    come out `[1, N, vocab]`. A forward pre-hook and a forward hook, so the pass still enters
    through the model's top-level forward.

    Why 2-D: transformers selects the positions it projects with a slice
    (`hidden[:, -k:, :]`, `logits_to_keep`), a 3-D view that torch's `linear` cannot fold into
    one matrix when the head's weight is frozen (LoRA, the reference, generation); it then
    runs a batched matmul over the weight expanded along the batch, which oneDNN copies
    contiguously on CPUs with bf16 support: 262,144 x 640 x 2 bytes x 200 rows asked 67 GB of
    the allocator in Gemma 3's held-out scoring. On 2-D input it is one GEMM, and the memory
    is the logits'."""
    head = module.get_output_embeddings()  # type: ignore[operator]
    assert isinstance(head, torch.nn.Module), f"{type(module).__name__} has no output embeddings"
    shapes: list[tuple[int, ...]] = []  # the leading shape of each pass's logits

    def flatten(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if mask is not None:
            hidden = hidden[mask]
            shapes.append((1, hidden.shape[0]))
        else:
            shapes.append(tuple(hidden.shape[:-1]))
            hidden = hidden.reshape(-1, hidden.shape[-1])
        return (hidden, *args[1:])

    def unflatten(_: torch.nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out.reshape(*shapes.pop(), out.shape[-1])

    before = head.register_forward_pre_hook(flatten)  # the last before the forward
    after = head.register_forward_hook(unflatten, prepend=True)  # the first after it
    try:
        yield
    finally:
        before.remove()
        after.remove()


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
