"""The batch plan: which sequences each rank trains on at each step, laid out in rows.

Input: the training units (SFT: one sequence each; DPO: a chosen and a rejected
sequence), every sequence's length in tokens, and the batch settings.
Output: for optimizer step k, a `Step`: per rank, its micro batches; per micro
batch, its rows (each row the sequences laid side by side in one row of the
input tensor).

The plan is a pure function of the data, the settings and the seed, so every
rank computes the same one without talking to the others, and a resumed run
only needs the step number to know where in the data it was.

- Data order: each epoch shuffles the units with a generator seeded by
  `(seed, epoch)`; consecutive `train_batch_size` units form one step (the last
  step of an epoch may be smaller); rank r takes every world-th of them.
- Micro batches: `micro_train_batch_size` units each, or with dynamic batching
  as many as fit a token budget (`micro_train_batch_size x max_length`), where
  a padded micro batch costs rows x its longest sequence and a packed one its
  real tokens. Ranks then split micro batches (or add an empty one) until all
  have the same count: ZeRO-3 needs every rank in every forward pass.
- Rows: padding puts one sequence per row; packing fills rows first-fit,
  longest sequence first, each row as wide as the micro batch's longest
  sequence (at most `max_length`). Packing then never computes more positions
  than padding would; rows of the full `max_length` would make a batch of
  short sequences slower where attention has no variable-length kernel (SDPA
  with a block mask costs the row's width squared: measured 1.5x slower on
  the quickstart's 20-token warm-up, CPU).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

Unit = tuple[int, ...]


@dataclass(frozen=True)
class Micro:
    """One forward/backward pass of one rank."""

    units: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    dummy: bool = False  # an empty pass that keeps ranks in step; its loss weight is 0


@dataclass(frozen=True)
class Step:
    """One optimizer step: the global batch, and each rank's micro batches."""

    index: int
    epoch: int
    position: int
    units: tuple[int, ...]
    micro: tuple[tuple[Micro, ...], ...] = field(repr=False)


def pack_rows(seqs: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequences into rows of at most `capacity` tokens.

    Longest first (ties in the given order); each goes to the first row with room.
    (`dynamic_groups` packs whole units into micro batches with it too.)
    """
    order = sorted(range(len(seqs)), key=lambda i: (-lengths[seqs[i]], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        s = seqs[i]
        for r, free in enumerate(room):
            if lengths[s] <= free:
                rows[r].append(s)
                room[r] -= lengths[s]
                break
        else:
            rows.append([s])
            room.append(capacity - lengths[s])
    return rows


def dynamic_groups(
    units: Sequence[Unit], lengths: Sequence[int], budget: int, packing: bool
) -> list[list[int]]:
    """Positions in `units` grouped into micro batches that fit `budget` tokens.

    Packed: first-fit decreasing on each unit's real tokens. Padded: longest unit
    first, a group grows while (its sequences x its longest sequence) fits. A
    unit over the budget on its own forms a group of one.
    """
    total = [sum(lengths[s] for s in u) for u in units]
    longest = [max(lengths[s] for s in u) for u in units]
    if packing:
        return pack_rows(range(len(units)), total, budget)
    order = sorted(range(len(units)), key=lambda i: (-longest[i], i))
    groups: list[list[int]] = []
    nseq, width = 0, 0
    for i in order:
        n, w = nseq + len(units[i]), max(width, longest[i])
        if groups and n * w <= budget:
            groups[-1].append(i)
            nseq, width = n, w
        else:
            groups.append([i])
            nseq, width = len(units[i]), longest[i]
    return groups


class BatchPlan:
    """The deterministic step-by-step plan of a training run."""

    def __init__(
        self,
        units: Sequence[Unit],
        lengths: Sequence[int],
        *,
        train_batch_size: int,
        micro_batch_size: int,
        world_size: int,
        max_length: int,
        packing: bool,
        dynamic: bool,
        seed: int,
        max_epochs: int,
        max_steps: int | None,
    ) -> None:
        if not units:
            raise ValueError("no training data")
        self.units, self.lengths = list(units), list(lengths)
        self.batch, self.micro_size, self.world = train_batch_size, micro_batch_size, world_size
        self.max_length, self.packing, self.dynamic, self.seed = max_length, packing, dynamic, seed
        self.steps_per_epoch = math.ceil(len(self.units) / train_batch_size)
        self.total_steps = max_steps or max_epochs * self.steps_per_epoch
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """The units of `epoch` in training order."""
        if epoch not in self._orders:
            ids = list(range(len(self.units)))
            random.Random(f"pipe-train:{self.seed}:{epoch}").shuffle(ids)
            self._orders = {epoch: ids}  # one epoch at a time is all a run needs
        return self._orders[epoch]

    def step(self, index: int) -> Step:
        """Step `index` (0-based)."""
        epoch, position = divmod(index, self.steps_per_epoch)
        start = position * self.batch
        chosen = tuple(self.order(epoch)[start : start + self.batch])
        per_rank = [self.micro_batches(list(chosen[r :: self.world])) for r in range(self.world)]
        self.equalize(per_rank)
        return Step(index, epoch, position, chosen, tuple(tuple(m) for m in per_rank))

    def micro_batches(self, unit_ids: list[int]) -> list[Micro]:
        """One rank's share of a step, cut into micro batches."""
        if self.dynamic:
            budget = self.micro_size * self.max_length
            picked = [self.units[u] for u in unit_ids]
            groups = dynamic_groups(picked, self.lengths, budget, self.packing)
            return [self.micro([unit_ids[i] for i in g]) for g in groups]
        size = self.micro_size
        return [self.micro(unit_ids[i : i + size]) for i in range(0, len(unit_ids), size)]

    def micro(self, unit_ids: Sequence[int]) -> Micro:
        """A micro batch of these units, with its rows laid out."""
        seqs = [s for u in unit_ids for s in self.units[u]]
        if self.packing:
            width = min(self.max_length, max(self.lengths[s] for s in seqs))
            rows = pack_rows(seqs, self.lengths, width)
        else:
            rows = [[s] for s in seqs]
        return Micro(tuple(unit_ids), tuple(tuple(r) for r in rows))

    def equalize(self, per_rank: list[list[Micro]]) -> None:
        """Give every rank the same number of micro batches: split its biggest, or pad."""
        target = max(len(m) for m in per_rank)
        for micros in per_rank:
            while len(micros) < target:
                biggest = max(range(len(micros)), key=lambda i: len(micros[i].units), default=-1)
                if biggest < 0 or len(micros[biggest].units) < 2:
                    micros.append(Micro((), ((self.units[0][0],),), dummy=True))
                    continue
                units = micros[biggest].units
                half = len(units) // 2
                micros[biggest : biggest + 1] = [self.micro(units[:half]), self.micro(units[half:])]
