"""Collect input: row shapes, carried fields, slicing, repeats, skipping pairs already done."""

from __future__ import annotations

import json
from pathlib import Path

from stages.collect.inputs import iter_lines, parse_row, prompt_from_row, row_range
from stages.collect.io import DoneSet
from stages.collect.ranged import pairs, pending
from stages.lib.io.jsonl import count_lines


def test_prompt_rows_carry_their_other_fields_verbatim():
    p = parse_row(7, b'{"prompt": "2+2?", "answer": "4", "meta": {"t": [1, 2]}}\n')
    assert (p.idx, p.text, p.messages, p.error) == (7, "2+2?", None, None)
    assert p.frag == '"prompt": "2+2?", "answer": "4", "meta": {"t": [1, 2]}, '
    assert json.loads("{" + p.frag + '"x": 1}') == {**p.row, "x": 1}


def test_rollout_fields_in_an_input_row_are_not_carried():
    p = parse_row(0, '{"prompt": "q", "reward": 0.3, "prompt_idx": 9, "answer": "a"}')
    assert p.frag == '"prompt": "q", "answer": "a", '
    assert prompt_from_row(1, {"prompt": "q"}).frag == '"prompt": "q", '


def test_chat_rows_and_content_parts():
    p = parse_row(
        0,
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                ]
            }
        ),
    )
    assert p.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert p.error is None


def test_nemo_gym_responses_create_params_rows():
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "be brief",
        },
        "verifier_metadata": {"x": 1},
    }
    p = parse_row(3, json.dumps(row))
    assert p.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    q = parse_row(4, json.dumps({"responses_create_params": {"input": "plain"}}))
    assert q.messages == [{"role": "user", "content": "plain"}]


def test_unusable_rows_carry_an_error_instead_of_raising():
    assert parse_row(0, b"{not json").error.startswith("bad_row: not valid JSON (")
    assert parse_row(0, b"[1, 2]").error == "bad_row: a row must be a JSON object"
    assert parse_row(0, b'{"answer": "4"}').error == (
        "bad_row: the row has none of 'messages', 'prompt', 'responses_create_params'"
    )
    assert parse_row(0, b'{"prompt": 5}').error == "bad_row: 'prompt' must be a string"
    assert parse_row(0, b'{"messages": []}').error == "bad_row: 'messages' must be a non-empty list"
    assert parse_row(0, b'{"messages": [{"content": "x"}]}').error == (
        "bad_row: each message needs a 'role' and a 'content'"
    )
    assert parse_row(0, b"\xff\xfe").error.startswith("bad_row: not valid JSON")


def _write(path: Path, n: int) -> Path:
    lines = [json.dumps({"prompt": f"q{i}"}) for i in range(n)]
    lines.insert(3, "")  # a blank line is not a row
    path.write_text("\n".join(lines) + "\n")
    return path


def test_slicing_by_start_end_and_limit(tmp_path: Path):
    path = str(_write(tmp_path / "in.jsonl", 10))
    assert count_lines(path) == 10
    assert [i for i, _ in iter_lines(path, 0, None)] == list(range(10))
    assert row_range(2, None, 3) == (2, 5)
    assert row_range(2, 4, 3) == (2, 4)
    assert row_range(2, 9, None) == (2, 9)
    lines = list(iter_lines(path, *row_range(2, None, 3)))
    assert [i for i, _ in lines] == [2, 3, 4]
    assert [json.loads(line)["prompt"] for _, line in lines] == ["q2", "q3", "q4"]
    assert [i for i, _ in iter_lines(path, 8, 20)] == [8, 9]


def test_pending_repeats_each_prompt_and_skips_pairs_done(tmp_path: Path):
    path = str(_write(tmp_path / "in.jsonl", 5))
    fresh = [(p.idx, s) for p, s in pairs(pending(path, 1, 4, 2, DoneSet(1, 2)))]
    assert fresh == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    done = DoneSet(1, 2)
    for key in [(1, 0), (1, 1), (3, 1)]:
        done.add(*key)
    rest = [(p.idx, s) for p, s in pairs(pending(path, 1, 4, 2, done))]
    assert rest == [(2, 0), (2, 1), (3, 0)]
