"""Rollout files: keys, the done bitmap, torn-line repair, failures history, the final sort."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.collect import CollectConfig, io, publish


def line(p: int, s: int, text: str = "x") -> str:
    return f'{{"prompt_idx": {p}, "sample_idx": {s}, "completion": "{text}", "reward": 1.0}}\n'


def test_rollout_key_reads_the_prefix_and_falls_back_to_json():
    assert io.rollout_key(line(12, 3).encode()) == (12, 3)
    assert io.rollout_key(b'{"sample_idx": 1, "prompt_idx": 4}\n') == (4, 1)
    assert io.rollout_key(b'{"prompt_idx": 4, "sample_idx": 1}\n') == (4, 1)
    assert io.rollout_key(b'{"prompt_idx": 4, "sam') is None
    assert io.rollout_key(b"garbage\n") is None


def test_done_set_marks_pairs_in_range_once():
    done = io.DoneSet(start=10, repeats=3)
    assert done.add(10, 0) and done.add(12, 2) and done.add(5000, 1)
    assert not done.add(10, 0)  # already there
    assert not done.add(9, 0) and not done.add(10, 3)  # outside the range
    assert done.count == 3
    bounded = io.DoneSet(start=0, repeats=1, end=5)
    assert bounded.add(4, 0) and not bounded.add(5, 0) and not bounded.has(5, 0)
    assert done.has(12, 2) and not done.has(12, 1) and not done.has(99999, 0)
    for s in range(3):
        done.add(11, s)
    assert done.all_done(11) and not done.all_done(12)


def test_a_torn_last_line_is_cut_off(tmp_path: Path):
    path = tmp_path / "o.partial"
    good = line(0, 0) + line(1, 0) + line(1, 1)
    path.write_bytes(good.encode() + b'{"prompt_idx": 2, "sample_idx": 0, "compl')
    done = io.DoneSet(0, 2)
    assert io.scan_partial(str(path), done) == 3
    assert path.read_text() == good
    assert [done.has(*k) for k in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]] == [
        True,
        False,
        True,
        True,
        False,
    ]
    path.write_bytes(good.encode() + b'{"prompt_idx": 2, "sample_idx": 0}')  # no newline
    assert io.scan_partial(str(path), io.DoneSet(0, 2)) == 3
    assert path.read_text() == good


def test_a_bad_line_inside_is_dropped_and_the_rest_kept(tmp_path: Path):
    path = tmp_path / "o.partial"
    path.write_text(line(0, 0) + "\x00\x00\x00\n" + line(1, 0))
    done = io.DoneSet(0, 1)
    assert io.scan_partial(str(path), done) == 2
    assert path.read_text() == line(0, 0) + line(1, 0)


def test_finalize_sorts_dedupes_filters_and_settles_failures(tmp_path: Path):
    out = str(tmp_path / "r.jsonl")
    Path(io.partial_path(out)).write_text(
        line(3, 1) + line(0, 0) + line(3, 0) + line(0, 0, "dup") + line(9, 0) + line(1, 1)
    )
    failures = [
        {"prompt_idx": 2, "sample_idx": 0, "error": "first", "failed_runs": 1},
        {"prompt_idx": 1, "sample_idx": 1, "error": "later done", "failed_runs": 1},
        {"prompt_idx": 2, "sample_idx": 0, "error": "second", "failed_runs": 2},
        {"prompt_idx": 8, "sample_idx": 0, "error": "out of range", "failed_runs": 1},
    ]
    Path(io.failures_path(out)).write_text("".join(json.dumps(f) + "\n" for f in failures))
    Path(io.meta_path(out)).write_text("{}")
    written, failed = publish.finalize(out, lambda p, s: p < 5 and s < 2)
    assert (written, failed) == (4, 1)
    assert Path(out).read_text() == line(0, 0) + line(1, 1) + line(3, 0) + line(3, 1)
    kept = [json.loads(x) for x in Path(io.failures_path(out)).read_text().splitlines()]
    assert kept == [{"prompt_idx": 2, "sample_idx": 0, "error": "second", "failed_runs": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r.jsonl.failures.jsonl"]


def test_the_final_sort_spills_and_merges_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(publish, "RUN_LINES", 7)
    out = str(tmp_path / "r.jsonl")
    keys = [(p, s) for p in range(20) for s in range(3)]
    shuffled = (
        keys[::7] + keys[1::7] + keys[2::7] + keys[3::7] + keys[4::7] + keys[5::7] + keys[6::7]
    )
    assert sorted(shuffled) == keys
    Path(io.partial_path(out)).write_text("".join(line(*k) for k in shuffled + keys[:5]))
    assert publish.finalize(out, lambda p, s: True) == (60, 0)
    assert Path(out).read_text() == "".join(line(*k) for k in keys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def _cfg(**kw: object) -> CollectConfig:
    base = {
        "input": "/in.jsonl",
        "backend": {"kind": "openai", "base_url": "http://h/v1", "model": "m"},
    }
    return CollectConfig.model_validate({**base, **kw}, strict=False)


def test_resume_key_covers_what_shapes_a_rollout_only():
    assert io.resume_key(_cfg()) == io.resume_key(
        _cfg(num_samples_in_parallel=7, limit=3, shards=2)
    )
    assert io.resume_key(_cfg()) == io.resume_key(
        _cfg(backend={"kind": "openai", "base_url": "http://other:9/v1", "model": "m"})
    )
    for change in ({"temperature": 0.5}, {"num_repeats": 2}, {"seed": 1}, {"input": "/x"}):
        assert io.resume_key(_cfg()) != io.resume_key(_cfg(**change)), change


def test_prepare_keeps_matching_partials_and_clears_others(tmp_path: Path):
    out = str(tmp_path / "r.jsonl")
    assert io.prepare(out, "aaa") is False  # nothing yet: starts fresh, writes the stamp
    Path(io.partial_path(out)).write_text(line(0, 0))
    Path(io.failures_path(out)).write_text("{}\n")
    assert io.prepare(out, "aaa") is True
    assert Path(io.partial_path(out)).exists()
    assert io.prepare(out, "bbb") is False  # other settings: their rollouts are not reused
    assert not Path(io.partial_path(out)).exists()
    assert not Path(io.failures_path(out)).exists()
    assert json.loads(Path(io.meta_path(out)).read_text()) == {"resume_key": "bbb"}
