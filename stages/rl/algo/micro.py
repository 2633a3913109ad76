"""Each trained rank's micro batches of one optimizer step: the same count on every rank.

Input: a batch's samples and the seeded shuffle (`epoch_steps`: each ppo epoch's optimizer
steps), then each step's samples (every rank of a role holds all of them), the rank count, the
micro batch size and whether micro batches are cut by a token budget (`use_dynamic_batch`).
Output: per rank, its micro batches in order; an empty micro batch is a dummy pass.

Rank r takes every world-th sample of the step, as before; then ranks split their largest
micro batch (or add a dummy) until all have the same count, the rule of the train stage
(`stages.train.batch_plan.BatchPlan.equalize`). ZeRO-3 gathers each layer's weights in every
forward and reduces the gradients in every backward with all ranks taking part, so a
rank with one pass more than another waits for it forever. A dummy pass runs a real
sample forward and backward with loss weight 0: it takes part in every collective and
adds nothing to the loss or the gradients. Splitting a micro batch changes no sum: the
loss is the sum of per-token losses over the step's token count over all ranks, however
the tokens are cut.

Every rank computes the whole plan from the whole step, so the ranks agree on the count
without talking to each other.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar


class HasIds(Protocol):
    @property
    def ids(self) -> tuple[int, ...]: ...


S = TypeVar("S", bound=HasIds)


def epoch_steps(
    samples: Sequence[S], rng: random.Random, epochs: int, size: int
) -> list[list[list[S]]]:
    """Per ppo epoch, its optimizer steps: the samples shuffled by `rng` (one shuffle per
    epoch, in order), cut in pieces of `size`."""
    out = []
    for _ in range(epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        out.append(
            [[samples[i] for i in order[lo : lo + size]] for lo in range(0, len(order), size)]
        )
    return out


def plan_micros(
    chunk: Sequence[S], world: int, size: int, dynamic: bool, packed: bool = False
) -> list[list[list[S]]]:
    """Per rank, the micro batches of `chunk` (an empty one is a dummy pass), all ranks
    with the same count. `size` samples each, or with `dynamic` a token budget of `size` x
    the step's mean sample length (longest-first within a rank, so similar lengths pad
    together; `packed`: the budget counts the samples' own tokens, which packed rows hold)."""
    shares = [list(chunk[r::world]) for r in range(world)]
    mean = sum(len(s.ids) for s in chunk) // max(len(chunk), 1)
    budget = size * max(1, mean)
    per_rank = [cut(share, size, budget if dynamic else None, packed) for share in shares]
    equalize(per_rank)
    return per_rank


def cut(share: list[S], size: int, budget: int | None, packed: bool = False) -> list[list[S]]:
    """One rank's samples in micro batches: `size` each, or (with a `budget`) sorted by
    length and grown while samples x the longest (padded) or the samples' tokens (packed)
    fit the budget."""
    if budget is None:
        return [share[i : i + size] for i in range(0, len(share), size)]
    micros: list[list[S]] = []
    tokens = 0
    for s in sorted(share, key=lambda s: len(s.ids)):
        cost = (
            tokens + len(s.ids) if packed else (len(micros[-1]) + 1) * len(s.ids) if micros else 0
        )
        if not micros or cost > budget:
            micros.append([])
            tokens = 0
        micros[-1].append(s)
        tokens += len(s.ids)
    return micros


def equalize(per_rank: list[list[list[S]]]) -> None:
    """Give every rank the same number of micro batches: split its largest in two, or
    (a rank whose micro batches hold one sample each, or none) add a dummy."""
    target = max((len(m) for m in per_rank), default=0) or 1
    for micros in per_rank:
        while len(micros) < target:
            biggest = max(range(len(micros)), key=lambda i: len(micros[i]), default=-1)
            if biggest < 0 or len(micros[biggest]) < 2:
                micros.append([])
                continue
            whole = micros[biggest]
            half = len(whole) // 2
            micros[biggest : biggest + 1] = [whole[:half], whole[half:]]
