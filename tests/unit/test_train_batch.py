"""The batch plan: packing layout, dynamic batching, rank split, and resumable order."""

from __future__ import annotations

from stages.lib.distributed.schedule import lr_factor, warmup_steps
from stages.train.batch_plan import BatchPlan, Micro, dynamic_groups, pack_rows


def plan(n: int, lengths: list[int] | None = None, **kw: object) -> BatchPlan:
    settings: dict[str, object] = dict(
        train_batch_size=4,
        micro_batch_size=1,
        world_size=1,
        max_length=16,
        packing=False,
        dynamic=False,
        seed=0,
        max_epochs=1,
        max_steps=None,
    )
    settings.update(kw)
    return BatchPlan([(i,) for i in range(n)], lengths or [4] * n, **settings)  # type: ignore[arg-type]


def test_pack_rows_first_fit_longest_first():
    lengths = [5, 3, 7, 2, 4]
    assert pack_rows([0, 1, 2, 3, 4], lengths, 10) == [[2, 1], [0, 4], [3]]


def test_pack_rows_ties_keep_given_order_and_full_rows_close():
    assert pack_rows([3, 1, 2], [0, 4, 4, 4], 8) == [[3, 1], [2]]
    assert pack_rows([0], [9], 8) == [[0]]  # too long alone: a row of its own


def test_dynamic_groups_packed_fit_real_tokens():
    units = [(0,), (1,), (2,), (3,), (4,)]
    assert dynamic_groups(units, [10, 50, 30, 20, 40], 64, packing=True) == [[1, 0], [4, 3], [2]]


def test_dynamic_groups_padded_fit_rows_times_longest():
    units = [(0,), (1,), (2,), (3,), (4,)]
    assert dynamic_groups(units, [10, 50, 30, 20, 40], 64, packing=False) == [
        [1],
        [4],
        [2, 3],
        [0],
    ]


def test_dynamic_groups_count_both_sequences_of_a_pair():
    # a DPO unit of two 20-token sequences costs 2 x 20 padded tokens
    units = [(0, 1), (2, 3)]
    assert dynamic_groups(units, [20, 20, 20, 20], 80, packing=False) == [[0, 1]]
    assert dynamic_groups(units, [20, 20, 20, 20], 79, packing=False) == [[0], [1]]


def test_micro_batch_rows_padded_and_packed():
    lengths = [5, 3, 7, 2, 4]
    padded = plan(5, lengths, max_length=10)
    assert padded.micro([0, 1, 2]) == Micro((0, 1, 2), ((0,), (1,), (2,)))
    # rows as wide as the longest sequence (7), at most max_length
    packed = plan(5, lengths, max_length=10, packing=True)
    assert packed.micro([0, 1, 2, 3, 4]) == Micro((0, 1, 2, 3, 4), ((2,), (0, 3), (4, 1)))
    # without sequence 2 the rows are 5 wide
    assert packed.micro([0, 1, 3, 4]) == Micro((0, 1, 3, 4), ((0,), (4,), (1, 3)))


def test_dynamic_micro_batches_use_micro_times_max_length_budget():
    lengths = [10, 50, 30, 20, 40]
    p = plan(5, lengths, micro_batch_size=4, max_length=16, dynamic=True, packing=True)
    micros = p.micro_batches([0, 1, 2, 3, 4])
    assert [m.units for m in micros] == [(1, 0), (4, 3), (2,)]


def test_steps_cover_each_epoch_once_in_a_seeded_order():
    p = plan(10, train_batch_size=4)
    assert (p.steps_per_epoch, p.total_steps) == (3, 3)
    steps = [p.step(k) for k in range(3)]
    assert [len(s.units) for s in steps] == [4, 4, 2]
    assert sorted(u for s in steps for u in s.units) == list(range(10))
    assert [s.units for s in steps] == [plan(10).step(k).units for k in range(3)]
    assert [s.units for s in steps] != [plan(10, seed=1).step(k).units for k in range(3)]


def test_max_steps_overrides_epochs_and_reshuffles_each_epoch():
    p = plan(8, train_batch_size=4, max_steps=5)
    assert p.total_steps == 5
    epoch0 = p.step(0).units + p.step(1).units
    epoch1 = p.step(2).units + p.step(3).units
    assert sorted(epoch0) == sorted(epoch1) == list(range(8))
    assert epoch0 != epoch1
    assert (p.step(4).epoch, p.step(4).position) == (2, 0)


def test_ranks_take_every_world_th_unit():
    p = plan(8, train_batch_size=8, world_size=2, micro_batch_size=2)
    step = p.step(0)
    rank0 = [u for m in step.micro[0] for u in m.units]
    rank1 = [u for m in step.micro[1] for u in m.units]
    assert rank0 == list(step.units[0::2])
    assert rank1 == list(step.units[1::2])
    assert [len(m.units) for m in step.micro[0]] == [2, 2]


def test_a_rank_without_data_gets_a_dummy_micro_batch():
    p = plan(9, train_batch_size=4, world_size=2, micro_batch_size=2)
    last = p.step(2)
    assert len(last.units) == 1
    assert last.micro[0] == (Micro(last.units, ((last.units[0],),)),)
    assert last.micro[1] == (Micro((), ((0,),), dummy=True),)


def test_equalize_splits_the_biggest_micro_batch_first():
    p = plan(6, micro_batch_size=4)
    per_rank = [[p.micro([0]), p.micro([1])], [p.micro([2, 3, 4])]]
    p.equalize(per_rank)
    assert [[m.units for m in r] for r in per_rank] == [[(0,), (1,)], [(2,), (3, 4)]]


def test_warmup_then_cosine_and_linear_values():
    assert warmup_steps(10, 0.2) == 2
    assert warmup_steps(100, 0.03) == 3
    cos = [round(lr_factor(s, 10, 2, "cosine"), 6) for s in range(1, 11)]
    assert cos == [
        0.5,
        1.0,
        0.965746,
        0.868198,
        0.722208,
        0.55,
        0.377792,
        0.231802,
        0.134254,
        0.1,
    ]
    lin = [round(lr_factor(s, 10, 2, "linear"), 6) for s in range(1, 11)]
    assert lin == [0.5, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125, 0.1]
    assert [lr_factor(s, 10, 2, "constant") for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    # without warm-up the first step already decays: 0.1 + 0.45 x (1 + cos(pi / 10))
    assert round(lr_factor(1, 10, 0, "cosine"), 6) == 0.977975
    assert lr_factor(10, 10, 0, "linear") == 0.1
