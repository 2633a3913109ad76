"""Log-probabilities of completion tokens: one function for the actor and the engine.

Input: a causal LM and samples (token ids of prompt + completion, and where the
completion starts). Output: per sample, the log-probability of each completion token
under `softmax(logits / temperature)`, and the sampling entropy at those positions.

Every pass goes through the model's top-level forward (through the trainer, where there is
one: DeepSpeed's engine forward, the torch trainer's bf16 autocast): ZeRO-3's trace and
prefetch start at the root module's forward hook, DeepSpeed's forward prologue clears the
ZeRO optimizers' backward flags, and autocast applies only there. The vocabulary projection
runs only where a loss reads: padded, over the positions from the batch's first completion
token on (transformers' `logits_to_keep`, the last K positions); packed, over the scored
positions alone, which a pre-hook on the output embeddings selects from the hidden states
(`stages.lib.model.logits.flat_head`: the same on every transformers release, where a 2-D
`logits_to_keep` is new in 5.24 and raises `IndexError` in 5.17); either way the projection
runs on 2-D hidden states (a frozen head on a 3-D slice goes through a batched matmul over
its weight expanded along the batch). The actor (with gradients),
the reference and the engine (for the probe after a sync) call the same code, so equal
weights give equal numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.lib.model.logits import flat_head, token_logprobs
from stages.rl.algo.loss import entropy
from stages.rl.algo.packing import layout


@dataclass(frozen=True)
class Sample:
    """A prompt and a sampled completion, as token ids, with what the update needs."""

    ids: tuple[int, ...]
    prompt_len: int
    old_logprobs: tuple[float, ...] = ()  # the behaviour policy's, per completion token
    advantage: float = 0.0  # GRPO: one per sample
    version: int = 0  # the weight version that sampled it
    advantages: tuple[float, ...] = ()  # PPO: one per completion token (GAE)
    returns: tuple[float, ...] = ()  # PPO: the critic's targets
    old_values: tuple[float, ...] = ()  # PPO: the critic's values when sampled
    reward: float = 0.0  # the verifier's
    ref_logprobs: tuple[float, ...] = ()  # the reference's, when the ref role's ranks scored it
    teacher_logprobs: tuple[float, ...] = ()  # the teacher's (on-policy distillation)
    mask: tuple[int, ...] = ()  # per completion token: 1 the model's, 0 an observation's; () all 1

    @property
    def completion_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def trained_len(self) -> int:
        """The completion tokens that carry loss: the model's own (not an observation's)."""
        return sum(self.mask) if self.mask else self.completion_len

    def loss_mask(self) -> list[float]:
        """1.0 per completion token the loss covers, 0.0 per observation token."""
        return [float(m) for m in self.mask] if self.mask else [1.0] * self.completion_len


def completion_logprobs(
    module: torch.nn.Module,
    samples: Sequence[Sample],
    device: str,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
    call: Callable[..., Any] | None = None,
    packed: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per-sample completion log-probabilities (with gradients when enabled), and the mean
    entropy over every completion token (without gradients) when asked for. `call` runs the
    forward (a trainer: its engine or autocast); the module itself otherwise. `packed`: the
    samples packed into rows (`stages.rl.algo.packing`), the same numbers."""
    lay = layout(samples, device, pad_id, packed)
    with flat_head(module, lay.keep_mask):
        out = (call or module)(**lay.inputs(), logits_to_keep=lay.keep)
    logits = lay.pick(out.logits)
    lp = token_logprobs(logits, lay.targets(), temperature)
    ent = None
    if with_entropy:  # over the tokens the loss covers (not an observation's)
        with torch.no_grad():
            weights = torch.tensor([m for s in samples for m in s.loss_mask()], device=lp.device)
            per_token = entropy(logits.detach(), temperature)
            ent = (per_token * weights).sum() / weights.sum().clamp(min=1.0)
    sizes = [s.completion_len for s in samples]
    return list(torch.split(lp, sizes)), ent


def completion_values(
    critic: torch.nn.Module,
    samples: Sequence[Sample],
    device: str,
    pad_id: int,
    call: Callable[..., Any] | None = None,
    packed: bool = False,
) -> list[torch.Tensor]:
    """The critic's value of the state before each completion token, per sample, through
    its top-level forward (`call`: its trainer), padded or `packed`."""
    lay = layout(samples, device, pad_id, packed)
    values = (call or critic)(**lay.inputs(), rows=lay.rows, cols=lay.cols).float()
    return list(torch.split(values, [s.completion_len for s in samples]))
