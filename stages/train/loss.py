"""Micro batch -> tensors -> loss: collation for padded and packed rows, SFT, DPO, RM losses.

Input: a `Micro` from the batch plan and the tokenized `Example`s.
Output: a `Batch` of tensors the model takes, and the summed loss of its
response tokens (SFT) or pairs (DPO, RM), which the step divides by the global
batch's count so that every token (or pair) weighs the same whatever micro
batch or rank it landed in.

Padded rows carry a 2-D attention mask. Packed rows carry position ids that
restart at 0 for every sequence and no attention mask: transformers then
finds the sequence boundaries from the position ids and keeps attention
within each sequence (a block-diagonal causal mask with SDPA/eager,
variable-length kernels with flash-attention). The padding at the end of a
packed row forms a sequence of its own, masked out of the loss.

One name, two sides of one concept (the loss of a trained model: train's (SFT, DPO, RM);
`stages/rl/algo/loss.py`: rl's (the clipped policy loss)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from stages.lib.distributed import seqpar
from stages.lib.distributed.seqpar import SeqPar
from stages.lib.model.logits import IGNORE, token_logprobs
from stages.train.batch_plan import Micro
from stages.train.data import Example


@dataclass
class Batch:
    """Model inputs, and per position the next token to predict (or -100) and its sequence."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    targets: torch.Tensor  # targets[r, t]: the token at t+1 when it is a response token
    slots: torch.Tensor  # slots[r, t]: index of the sequence in `seqs` that target belongs to
    seqs: tuple[int, ...]  # sequence ids in slot order
    tokens: int  # real (non-pad) tokens

    def scored(self, device: torch.device | str) -> torch.Tensor:
        """Where a loss reads the logits: the positions with a target
        (`stages.lib.model.logits`)."""
        return (self.targets != IGNORE).to(device)

    def at(self, scored: torch.Tensor) -> Batch:
        """This batch with targets and slots at the `scored` positions only, as one row: what
        the logits of a forward under `flat_head(model, scored)` line up with."""
        mask = scored.cpu()
        return replace(self, targets=self.targets[mask][None], slots=self.slots[mask][None])

    def shard(self, sp: SeqPar) -> Batch:
        """This rank's contiguous share of every row under sequence parallelism
        (`stages.lib.distributed.seqpar`): the width padded to a multiple of the group's size,
        position ids the global ones (rotary embeddings at each token's place in the whole
        row), no attention mask (attention over the gathered rows is causal; right padding
        never precedes a real token). Targets are shifted before the cut, so a shard's last
        position predicts the next shard's first token."""
        assert self.position_ids is None, "packed rows are refused with ring_attn_size at plan"
        width = self.input_ids.shape[1]
        positions = torch.arange(width).expand(self.input_ids.shape[0], width)
        return replace(
            self,
            input_ids=seqpar.shard(self.input_ids, sp, 0),
            position_ids=seqpar.shard(positions, sp, 0),
            attention_mask=None,
            targets=seqpar.shard(self.targets, sp, IGNORE),
            slots=seqpar.shard(self.slots, sp, 0),
        )

    def model_inputs(self, device: torch.device | str) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": self.input_ids.to(device), "use_cache": False}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids.to(device)
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask.to(device)
        return out


def collate(micro: Micro, examples: Sequence[Example], pad_id: int, packed: bool) -> Batch:
    """Lay a micro batch out as tensors: one row per `micro.rows` entry, right-padded."""
    width = max(sum(len(examples[s].input_ids) for s in row) for row in micro.rows)
    n = len(micro.rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    targets = torch.full((n, width), IGNORE, dtype=torch.long)
    slots = torch.zeros((n, width), dtype=torch.long)
    seqs: list[int] = []
    tokens = 0
    for r, row in enumerate(micro.rows):
        at = 0
        for s in row:
            ex = examples[s]
            length = len(ex.input_ids)
            ids[r, at : at + length] = torch.tensor(ex.input_ids)
            pos[r, at : at + length] = torch.arange(length)
            mask[r, at : at + length] = 1
            if not micro.dummy:
                # position t predicts token t+1: a trained token at t+1 is the target at t
                for start, end in ex.trained():
                    targets[r, at + start - 1 : at + end - 1] = torch.tensor(
                        ex.input_ids[start:end]
                    )
            slots[r, at : at + length] = len(seqs)
            seqs.append(s)
            at += length
            tokens += length
        pos[r, at:] = torch.arange(width - at)
    return Batch(
        input_ids=ids,
        position_ids=pos if packed else None,
        attention_mask=None if packed else mask,
        targets=targets,
        slots=slots,
        seqs=tuple(seqs),
        tokens=0 if micro.dummy else tokens,
    )


def sft_loss_sum(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Summed negative log-likelihood of the response tokens."""
    return -token_logprobs(logits, batch.targets).sum()


def sequence_logprobs(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Summed response log-probability of each sequence, in slot order."""
    lp = token_logprobs(logits, batch.targets)
    out = torch.zeros(len(batch.seqs), dtype=lp.dtype, device=lp.device)
    return out.index_add(0, batch.slots.reshape(-1).to(lp.device), lp.reshape(-1))


def dpo_terms(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: -logsigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r))), and that margin.

    `policy` and `reference` hold (chosen, rejected) log-probabilities
    interleaved: chosen of pair i at 2i, rejected at 2i+1.
    """
    ratio = policy - reference
    margin = beta * (ratio[0::2] - ratio[1::2])
    return -F.logsigmoid(margin), margin


def reward_terms(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: the Bradley-Terry loss -logsigmoid(r_chosen - r_rejected - margin) of a
    reward model's scores (OpenRLHF's `PairWiseLoss`, TRL's `RewardTrainer`), and the gap
    r_chosen - r_rejected (the pair is in the right order when it is positive)."""
    gap = chosen.float() - rejected.float()
    return -F.logsigmoid(gap - margin.to(gap)), gap
