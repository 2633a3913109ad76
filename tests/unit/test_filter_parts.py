"""The filter's building blocks: the bounded reward histogram, prompt-aligned ranges, the sort."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from stages.filter.histogram import RewardHist
from stages.filter.scan import iter_rows, sort_by_prompt, split_ranges


def test_reward_histogram_bins_exact_values() -> None:
    hist = RewardHist()
    for value in (0.0, 1.0, 1.0, 0.25):
        hist.add(value)
    assert hist.items() == [(0.0, 1), (0.25, 1), (1.0, 2)]
    assert hist.summary() == {"n": 4, "mean": 0.5625, "min": 0.0, "max": 1.0}


def test_reward_histogram_coarsens_to_stay_bounded() -> None:
    hist = RewardHist()
    hist.MAX_BINS = 10
    for i in range(100):
        hist.add(i / 1000)  # 0.000 .. 0.099: 100 distinct values
    assert hist.decimals == 2
    assert hist.items() == [(i / 100, 10) for i in range(10)]
    assert hist.n == 100


def test_reward_histograms_merge_at_the_coarser_resolution() -> None:
    fine, coarse = RewardHist(), RewardHist()
    fine.add(0.123456)
    coarse.MAX_BINS = 1
    coarse.add(0.1)
    coarse.add(0.29)  # two bins > 1: coarsens down to 0 decimals
    assert coarse.decimals == 0
    fine.merge(coarse)
    assert (fine.decimals, fine.items(), fine.n) == (0, [(0.0, 3)], 3)


def write_groups(path: Path, sizes: list[int]) -> list[bytes]:
    lines = []
    for p, n in enumerate(sizes):
        for s in range(n):
            lines.append(
                json.dumps({"prompt_idx": p, "sample_idx": s, "reward": 1.0}).encode() + b"\n"
            )
    path.write_bytes(b"".join(lines))
    return lines


def test_ranges_start_where_a_prompt_starts(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    lines = write_groups(path, [3, 1, 4, 2, 5])
    ranges = split_ranges(str(path), 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    group_starts = {starts[i] for i in (0, 3, 4, 8, 10)}
    assert {a for a, _ in ranges} <= group_starts
    assert len(ranges) > 1
    seen = [[r.prompt_idx for r in iter_rows(str(path), a, b)] for a, b in ranges]
    assert [p for part in seen for p in part] == [0] * 3 + [1] + [2] * 4 + [3] * 2 + [4] * 5
    for before, after in itertools.pairwise(seen):
        assert before[-1] != after[0]


def test_one_huge_group_is_one_range(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_groups(path, [50])
    assert split_ranges(str(path), 8) == [(0, path.stat().st_size)]


def test_external_sort_orders_by_prompt_then_sample(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    order = [(3, 1), (0, 2), (3, 0), (1, 0), (0, 0), (2, 5), (0, 1), (1, 1)]
    src.write_text(
        "".join(
            json.dumps({"prompt_idx": p, "sample_idx": s, "reward": 0}) + "\n" for p, s in order
        )
    )
    out = sort_by_prompt(str(src), str(tmp_path), part_bytes=60)  # several partitions
    assert [(r.prompt_idx, r.sample_idx) for r in iter_rows(out)] == sorted(order)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "sorted.jsonl"]
