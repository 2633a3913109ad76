"""The rl ranks' micro-batch plan: every rank the same number of passes, every sample once."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from stages.rl.algo.micro import plan_micros


@dataclass(frozen=True)
class S:
    ids: tuple[int, ...]
    n: int  # which sample


def chunk(count: int, seed: int = 0) -> list[S]:
    rng = random.Random(seed)
    return [S(tuple(range(rng.randint(4, 40))), i) for i in range(count)]


def counts(plan: list[list[list[S]]]) -> list[int]:
    return [len(micros) for micros in plan]


def test_the_issues_74_samples_on_16_ranks_at_micro_1_give_5_passes_each_one_a_dummy():
    plan = plan_micros(chunk(74), world=16, size=1, dynamic=False)
    assert counts(plan) == [5] * 16
    dummies = [sum(not m for m in micros) for micros in plan]
    assert dummies == [0] * 10 + [1] * 6  # ranks 10-15 hold 4 samples: one dummy pass each


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("count", "world", "size"), [(7, 3, 1), (7, 3, 2), (2, 3, 1), (50, 4, 3)])
def test_every_rank_runs_as_many_passes_and_every_sample_is_trained_once_on_its_rank(
    count: int, world: int, size: int, dynamic: bool
):
    samples = chunk(count, seed=count)
    plan = plan_micros(samples, world, size, dynamic)
    assert len(set(counts(plan))) == 1
    for rank, micros in enumerate(plan):
        mine = sorted(s.n for m in micros for s in m)
        assert mine == [s.n for s in samples[rank::world]]


def test_a_rank_with_a_bigger_share_splits_its_micro_batch_instead_of_adding_a_dummy():
    # 5 samples on 2 ranks at micro 4: rank 0 holds 3 (one pass), rank 1 holds 2 (one pass)
    assert counts(plan_micros(chunk(5), 2, 4, False)) == [1, 1]
    # 9 at micro 4: rank 0 holds 5 (passes of 4 and 1), rank 1 holds 4, split in two halves
    plan = plan_micros(chunk(9), 2, 4, False)
    assert [[len(m) for m in micros] for micros in plan] == [[4, 1], [2, 2]]


def test_dynamic_batches_share_one_token_budget_longest_sample_last():
    samples = [S(tuple(range(n)), i) for i, n in enumerate([10, 10, 10, 30])]
    # mean length 15, budget 2 x 15 = 30 tokens: the three short ones pad to 10 (3 x 10),
    # the long one alone
    (micros,) = plan_micros(samples, 1, 2, True)
    assert [[s.n for s in m] for m in micros] == [[0, 1, 2], [3]]
