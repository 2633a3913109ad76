"""The filter stage in one process: every rule with exact expected rows, and the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext, get_kind
from stages.filter import FilterConfig
from stages.filter.rows import FilterInputError


def row(p: int, s: int, reward: float, completion: str = "x", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": f"q{p}",
        "answer": "4",
        "prompt_idx": p,
        "sample_idx": s,
        "completion": completion,
        "reward": reward,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": len(completion.split())},
        "latency_s": 0.1,
    }
    out.update(extra)
    return out


def run(
    tmp_path: Path, rows: list[dict[str, Any]], **config: Any
) -> tuple[list[Any], dict[str, Any]]:
    """Filter `rows` through the registered stage; return the kept (prompt_idx, sample_idx)
    and the report."""
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage_dir = tmp_path / "filter"
    stage_dir.mkdir(exist_ok=True)
    cfg = FilterConfig(input=str(src), output=str(stage_dir / "filtered.jsonl"), **config)
    ctx = StageContext("filter", "filter", str(stage_dir), str(tmp_path), str(tmp_path))
    kind = get_kind("filter")
    assert kind is not None
    report = kind.call(cfg, ctx)
    kept = [json.loads(line) for line in (stage_dir / "filtered.jsonl").read_text().splitlines()]
    return [(r["prompt_idx"], r["sample_idx"]) for r in kept], report


def test_uniform_groups_are_dropped_whole(tmp_path: Path) -> None:
    rows = [row(0, s, 1.0) for s in range(3)]
    rows += [row(1, 0, 0.0), row(1, 1, 1.0), row(1, 2, 0.0)]
    rows += [row(2, 0, 1.0)]  # one sample: uniform
    rows += [row(3, 0, 0.5), row(3, 1, 0.5)]
    rows += [row(4, 0, 0.0), row(4, 1, 0.0001)]
    kept, report = run(tmp_path, rows, drop_uniform_groups=True)
    assert kept == [(1, 0), (1, 1), (1, 2), (4, 0), (4, 1)]
    assert report["dropped"]["uniform_group"] == 6
    assert (report["groups_in"], report["groups_kept"]) == (5, 2)


def test_uniformity_is_judged_on_the_group_as_collected(tmp_path: Path) -> None:
    # the reward bar comes after: [0, 1, 1] has signal even though only the 1s are kept
    rows = [row(0, 0, 0.0), row(0, 1, 1.0), row(0, 2, 1.0), row(1, 0, 1.0), row(1, 1, 1.0)]
    kept, report = run(tmp_path, rows, drop_uniform_groups=True, min_reward=1.0)
    assert kept == [(0, 1), (0, 2)]
    assert report["dropped"] == {
        "uniform_group": 2,
        "min_reward": 1,
        "max_reward": 0,
        "min_length": 0,
        "max_length": 0,
        "duplicate": 0,
        "predicate": 0,
        "top_k": 0,
    }


def test_top_k_keeps_the_best_and_breaks_ties_by_sample_idx(tmp_path: Path) -> None:
    rows = [row(0, 0, 0.2), row(0, 1, 0.9), row(0, 2, 0.9), row(0, 3, 0.5)]
    rows += [row(1, 2, 0.7), row(1, 0, 0.7), row(1, 1, 0.7)]  # file order is not sample order
    rows += [row(2, 0, 0.0)]
    kept, report = run(tmp_path, rows, top_k_per_prompt=2)
    assert kept == [(0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]  # file order kept
    assert report["dropped"]["top_k"] == 3


def test_best_of_n_is_top_1(tmp_path: Path) -> None:
    rows = [row(0, 0, 0.2), row(0, 1, 0.9), row(0, 2, 0.9), row(1, 1, 0.3), row(1, 0, 0.3)]
    kept, report = run(tmp_path, rows, top_k_per_prompt=1)
    assert kept == [(0, 1), (1, 0)]
    assert report["dropped"]["top_k"] == 3


DEDUP_ROWS = [
    row(0, 0, 1.0, "The answer is 4", prompt="What is 2+2?"),
    row(0, 1, 1.0, "The answer is 4", prompt="What is 2+2?"),  # exact duplicate
    row(0, 2, 1.0, "the  answer is\n4 ", prompt="What is 2+2?"),  # normalised duplicate
    row(0, 3, 0.0, "The answer is 5", prompt="What is 2+2?"),
    row(1, 0, 1.0, "The answer is 4", prompt="What is 2+2?"),  # same prompt text, another index
    row(1, 1, 0.0, "The answer is 5", prompt="What is 2+2?"),
    row(2, 0, 1.0, "The answer is 4", prompt="what is  2+2?"),  # normalised prompt
    row(3, 0, 1.0, "The answer is 4", prompt="What is 3+3?"),  # another prompt: kept
]


def test_exact_dedup_keeps_the_first_of_each_pair(tmp_path: Path) -> None:
    kept, report = run(tmp_path, DEDUP_ROWS, dedup="exact")
    assert kept == [(0, 0), (0, 2), (0, 3), (2, 0), (3, 0)]
    assert report["dropped"]["duplicate"] == 3


def test_normalized_dedup_ignores_whitespace_and_case(tmp_path: Path) -> None:
    kept, report = run(tmp_path, DEDUP_ROWS, dedup="normalized")
    assert kept == [(0, 0), (0, 3), (3, 0)]
    assert report["dropped"]["duplicate"] == 5


def test_dedup_reads_chat_messages_as_the_prompt(tmp_path: Path) -> None:
    def chat(p: int, text: str) -> dict[str, Any]:
        r = row(p, 0, 1.0, "Sure.")
        del r["prompt"]
        r["messages"] = [{"role": "user", "content": text}]
        return r

    rows = [chat(0, "Hi there"), chat(1, "hi  THERE "), chat(2, "Bye")]
    assert run(tmp_path, rows, dedup="exact")[0] == [(0, 0), (1, 0), (2, 0)]
    assert run(tmp_path, rows, dedup="normalized")[0] == [(0, 0), (2, 0)]


def test_reward_bounds(tmp_path: Path) -> None:
    rows = [row(0, 0, 0.4), row(0, 1, 0.5), row(0, 2, 0.9), row(0, 3, 1.0)]
    kept, report = run(tmp_path, rows, min_reward=0.5, max_reward=0.9)
    assert kept == [(0, 1), (0, 2)]
    assert (report["dropped"]["min_reward"], report["dropped"]["max_reward"]) == (1, 1)


def test_length_bounds_in_characters(tmp_path: Path) -> None:
    rows = [row(0, i, 1.0, c) for i, c in enumerate(["a", "ab", "abcde", "abcdef"])]
    kept, report = run(tmp_path, rows, min_length=2, max_length=5)
    assert kept == [(0, 1), (0, 2)]
    assert (report["dropped"]["min_length"], report["dropped"]["max_length"]) == (1, 1)
    assert report["length_fallback_rows"] == 0


def test_length_bounds_in_tokens_fall_back_to_characters_without_usage(tmp_path: Path) -> None:
    rows = [
        row(0, 0, 1.0, "x", usage={"completion_tokens": 1}),
        row(0, 1, 1.0, "x", usage={"completion_tokens": 10}),
        row(0, 2, 1.0, "a long completion", usage={"completion_tokens": 3}),
        row(0, 3, 1.0, "abcdefgh", usage=None),  # 8 characters: too long
        row(0, 4, 1.0, "ab", usage={}),  # 2 characters: kept
    ]
    kept, report = run(tmp_path, rows, max_length=5, length_unit="tokens")
    assert kept == [(0, 0), (0, 2), (0, 4)]
    assert report["dropped"]["max_length"] == 2
    assert report["length_fallback_rows"] == 2


def test_each_dropped_row_is_counted_once_under_the_first_rule(tmp_path: Path) -> None:
    (tmp_path / "keepers_report_test.py").write_text(
        "def keep(row):\n    return 'bad' not in row['completion']\n"
    )
    long = "a completion far longer than ten characters"
    rows = [
        row(0, 0, 1.0, long),  # uniform group (also too long): uniform_group
        row(0, 1, 1.0, "bad"),  # uniform_group
        row(1, 0, 0.0, long),  # below the bar and too long: min_reward
        row(1, 1, 1.0, long),  # max_length
        row(1, 2, 1.0, "ok"),  # kept
        row(1, 3, 1.0, "ok"),  # duplicate (would also lose top_k)
        row(1, 4, 1.0, "bad"),  # predicate
        row(1, 5, 0.8, "fine"),  # top_k
    ]
    kept, report = run(
        tmp_path,
        rows,
        drop_uniform_groups=True,
        min_reward=0.5,
        max_length=10,
        dedup="exact",
        predicate="keepers_report_test:keep",
        top_k_per_prompt=1,
    )
    assert kept == [(1, 2)]
    stage_dir = tmp_path / "filter"
    assert json.loads((stage_dir / "filter_report.json").read_text()) == report
    timing = {"seconds", "rows_per_s"}
    assert {k: v for k, v in report.items() if k not in timing} == {
        "input": str(tmp_path / "rollouts.jsonl"),
        "output": str(stage_dir / "filtered.jsonl"),
        "rows_in": 8,
        "rows_kept": 1,
        "rows_dropped": 7,
        "dropped": {
            "uniform_group": 2,
            "min_reward": 1,
            "max_reward": 0,
            "min_length": 0,
            "max_length": 1,
            "duplicate": 1,
            "predicate": 1,
            "top_k": 1,
        },
        "rule_order": [
            "uniform_group",
            "min_reward",
            "max_reward",
            "min_length",
            "max_length",
            "duplicate",
            "predicate",
            "top_k",
        ],
        "groups_in": 2,
        "groups_kept": 1,
        "length_unit": "chars",
        "length_fallback_rows": 0,
        "reward_in": {"n": 8, "mean": 0.85, "min": 0.0, "max": 1.0},
        "reward_kept": {"n": 1, "mean": 1.0, "min": 1.0, "max": 1.0},
        "input_contiguous": True,
        "mode": "sequential",
        "partitions": 1,
        "histogram": str(stage_dir / "reward_histogram.png"),
    }
    assert (stage_dir / "reward_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kept_lines_are_copied_byte_for_byte(tmp_path: Path) -> None:
    lines = [
        '{"prompt_idx": 0, "sample_idx": 0, "reward": 1, "completion": "é  x"}',
        "",
        '{"prompt_idx":1,"sample_idx":0,"reward":0.5,"completion":"y"}',
    ]
    src = tmp_path / "rollouts.jsonl"
    src.write_text("\n".join(lines))  # a blank line, and no newline at the end
    stage_dir = tmp_path / "filter"
    stage_dir.mkdir()
    cfg = FilterConfig(input=str(src), output=str(stage_dir / "out.jsonl"))
    ctx = StageContext("filter", "filter", str(stage_dir), str(tmp_path), str(tmp_path))
    report = get_kind("filter").call(cfg, ctx)  # type: ignore[union-attr]
    assert (stage_dir / "out.jsonl").read_text() == lines[0] + "\n" + lines[2] + "\n"
    assert report["rows_kept"] == 2


def test_prompts_out_of_order_are_sorted_first(tmp_path: Path) -> None:
    rows = [row(1, 0, 1.0), row(0, 1, 1.0), row(1, 1, 1.0), row(0, 0, 0.0), row(2, 0, 0.0)]
    kept, report = run(tmp_path, rows, drop_uniform_groups=True)
    assert kept == [(0, 0), (0, 1)]
    assert report["input_contiguous"] is False
    assert report["dropped"]["uniform_group"] == 3
    kept, _ = run(tmp_path, rows, partition_mb=0.0001)  # many sort partitions
    assert kept == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_unreadable_rows_name_the_file_and_byte(tmp_path: Path) -> None:
    first = json.dumps(row(0, 0, 1.0))
    bad = row(0, 1, 1.0)
    bad["reward"] = None
    with pytest.raises(FilterInputError) as exc:
        run(tmp_path, [json.loads(first), bad])
    assert (
        str(exc.value)
        == f"rollouts.jsonl: byte {len(first) + 1}: expected a numeric 'reward', found None"
    )
    (tmp_path / "rollouts.jsonl").write_text('{"prompt_idx": 0\n')
    stage_dir = tmp_path / "filter"
    cfg = FilterConfig(input=str(tmp_path / "rollouts.jsonl"), output=str(stage_dir / "o.jsonl"))
    ctx = StageContext("filter", "filter", str(stage_dir), str(tmp_path), str(tmp_path))
    with pytest.raises(FilterInputError, match=r"^rollouts.jsonl: byte 0: not a JSON line: "):
        get_kind("filter").call(cfg, ctx)  # type: ignore[union-attr]
    assert not (stage_dir / "o.jsonl").exists()


def test_missing_predicate_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FilterInputError) as exc:
        run(tmp_path, [row(0, 0, 1.0)], predicate="no_such_module_here:keep")
    assert str(exc.value) == (
        "predicate 'no_such_module_here:keep': cannot import 'no_such_module_here':"
        " No module named 'no_such_module_here'"
    )


def test_a_rerun_clears_what_a_killed_attempt_left(tmp_path: Path) -> None:
    stage_dir = tmp_path / "filter"
    (stage_dir / ".filter-tmp-dead").mkdir(parents=True)
    (stage_dir / ".filter-tmp-dead" / "part-00000.jsonl").write_text("junk\n")
    (stage_dir / "filtered.jsonl.tmp-1234abcd").write_text("half a line")
    kept, _ = run(tmp_path, [row(0, 0, 1.0)])
    assert kept == [(0, 0)]
    assert sorted(p.name for p in stage_dir.iterdir()) == [
        "filter_report.json",
        "filtered.jsonl",
        "reward_histogram.png",
        "track.jsonl",  # kept/dropped by rule for the run's trackers (stages.lib.io.metrics)
    ]
