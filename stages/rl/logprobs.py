"""Log-probabilities of completion tokens: one function for the actor and the engine.

Input: a causal LM and samples (token ids of prompt + completion, and where the
completion starts). Output: per sample, the log-probability of each completion token
under `softmax(logits / temperature)`, and the sampling entropy at those positions.

Only completion positions go through the output layer: the decoder runs over the whole
sequence, the vocabulary projection over the answer tokens alone. The actor (with
gradients, through its trainer's module) and the engine (for the probe after a sync)
call the same code, so equal weights give equal numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stages.rl.loss import entropy, token_logprobs


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

    @property
    def completion_len(self) -> int:
        return len(self.ids) - self.prompt_len


def _gather(
    samples: Sequence[Sample], device: str, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask, and the (row, position) of the state before each
    completion token."""
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        rows += [b] * s.completion_len
        cols += range(s.prompt_len - 1, len(s.ids) - 1)
    r = torch.tensor(rows, device=device)
    c = torch.tensor(cols, device=device)
    return ids.to(device), mask.to(device), r, c


def completion_logprobs(
    module: torch.nn.Module,
    samples: Sequence[Sample],
    device: str,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per-sample completion log-probabilities (with gradients when enabled), and the mean
    entropy over every completion token (without gradients) when asked for."""
    ids, mask, r, c = _gather(samples, device, pad_id)
    decoder = module.get_decoder()  # type: ignore[operator]
    head = module.get_output_embeddings()  # type: ignore[operator]
    hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = head(hidden[r, c])
    lp = token_logprobs(logits, ids[r, c + 1], temperature)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = entropy(logits.detach(), temperature).mean()
    sizes = [s.completion_len for s in samples]
    return list(torch.split(lp, sizes)), ent


def completion_values(
    critic: torch.nn.Module, samples: Sequence[Sample], device: str, pad_id: int
) -> list[torch.Tensor]:
    """The critic's value of the state before each completion token, per sample."""
    ids, mask, r, c = _gather(samples, device, pad_id)
    hidden = critic.decoder(input_ids=ids, attention_mask=mask).last_hidden_state  # type: ignore[operator]
    values = critic.value_head(hidden[r, c]).squeeze(-1).float()  # type: ignore[operator]
    return list(torch.split(values, [s.completion_len for s in samples]))
