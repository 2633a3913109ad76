"""Collect with an environment: episode lines, resume keys, the failure threshold, the
backends refused at validation, and the filter reading episode rows."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig, io
from stages.collect.inputs import parse_row
from stages.collect.multiturn import check_episodes, episode_line
from stages.collect.run import run_collect
from stages.filter import FilterConfig
from stages.filter.rows import completion_text
from stages.filter.rows import parse_row as filter_row
from stages.filter.rules import Counts, Rules
from stages.lib.env.contract import Episode
from stages.lib.env.field import EnvironmentConfig
from tests.conftest import ROOT, run_cli, stub_checkpoint

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import Faults, ThreadHandle, start_in_thread

LOG = logging.getLogger("test")


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadHandle]:
    handle = start_in_thread(capacity=16, latency_ms=1)
    handle.server.tools = True
    yield handle
    handle.stop()


def config(tmp_path: Path, url: str, **kw: Any) -> CollectConfig:
    rows = [{"prompt": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {
        "input": str(tmp_path / "in.jsonl"),
        "output": str(tmp_path / "episodes.jsonl"),
        "num_samples_in_parallel": 4,
        "num_repeats": 2,
        "backoff_s": 0.01,
        "max_retries": 1,
        "backend": {"kind": "openai", "base_url": url, "model": "fake"},
        "verifier": {"kind": "exact_match"},
        "environment": {"kind": "calculator"},
    }
    return CollectConfig.model_validate({**base, **kw}, strict=False)


def ctx(tmp_path: Path) -> StageContext:
    return StageContext("collect", "collect", str(tmp_path), str(tmp_path), str(tmp_path))


def read(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_an_episode_line_starts_with_its_key_and_replaces_the_rows_messages():
    prompt = parse_row(7, b'{"messages": [{"role": "user", "content": "q"}], "answer": "4"}\n')
    episode = Episode(prompt.row, None)  # type: ignore[arg-type]
    episode.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "4"}]
    episode.rewards, episode.done, episode.end = [0.5, 1.0], True, "done"
    line = episode_line(prompt, 2, episode, (10, 3), 0.25)
    assert line.startswith('{"prompt_idx": 7, "sample_idx": 2, "answer": "4", "messages": [')
    assert io.rollout_key(line.encode()) == (7, 2)
    assert json.loads(line) == {
        "prompt_idx": 7,
        "sample_idx": 2,
        "answer": "4",
        "messages": episode.messages,
        "rewards": [0.5, 1.0],
        "total_reward": 1.5,
        "turns": 2,
        "solved": True,
        "end": "done",
        "reward": 1.5,
        "usage": {"prompt_tokens": 10, "completion_tokens": 3},
        "latency_s": 0.25,
    }


def test_calculator_episodes_end_to_end(tmp_path: Path, server: ThreadHandle):
    cfg = config(tmp_path, server.url)
    metrics = run_collect(cfg, ctx(tmp_path))
    rows = read(cfg.output)
    assert [(r["prompt_idx"], r["sample_idx"]) for r in rows] == [
        (i, s) for i in range(4) for s in range(2)
    ]
    for r in rows:
        i = r["prompt_idx"]
        assert r["messages"] == [
            {"role": "user", "content": f"What is {i} * 3?"},
            {"role": "assistant", "content": f"calc: {i} * 3"},
            {"role": "user", "content": f"result: {3 * i}"},
            {"role": "assistant", "content": f"<answer>{3 * i}</answer>"},
        ]
        assert (r["rewards"], r["turns"], r["end"], r["solved"]) == ([0.0, 1.0], 2, "done", True)
        assert r["reward"] == r["total_reward"] == 1.0 and "error" not in r
    assert metrics["episodes"] == {
        "episodes": 8,
        "failed": 0,
        "failure_reasons": [],
        "success_rate": 1.0,
        "mean_turns": 2.0,
        "mean_total_reward": 1.0,
    }


def test_max_turns_ends_an_episode_that_would_go_on(tmp_path: Path, server: ThreadHandle):
    cfg = config(tmp_path, server.url, environment={"kind": "calculator", "max_turns": 1})
    run_collect(cfg, ctx(tmp_path))
    rows = read(cfg.output)
    assert {(r["turns"], r["end"], r["total_reward"]) for r in rows} == {(1, "max_turns", 0.0)}
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "calc: 0 * 3"}


def test_a_model_request_that_fails_for_good_redoes_its_episode_next_run(tmp_path: Path):
    handle = start_in_thread(capacity=8, latency_ms=1, faults=Faults(error_500=1.0))
    handle.server.tools = True
    try:
        cfg = config(tmp_path, handle.url)
        run_collect(cfg, ctx(tmp_path))
        assert read(cfg.output) == []
        failures = read(io.failures_path(cfg.output))
        assert len(failures) == 8 and {f["error_kind"] for f in failures} == {"server_error"}
        Path(cfg.output).unlink()  # a new run of the stage: retry the failed pairs
        handle.server.faults.error_500 = 0.0
        metrics = run_collect(cfg, ctx(tmp_path))
    finally:
        handle.stop()
    assert len(read(cfg.output)) == 8 and metrics["written"] == 8
    assert not Path(io.failures_path(cfg.output)).exists()


def test_the_failed_share_decides_whether_the_stage_fails(tmp_path: Path):
    output = tmp_path / "out.jsonl"
    row = {"prompt_idx": 0, "sample_idx": 0, "turns": 1, "rewards": [1.0], "total_reward": 1.0}
    bad = dict(row, turns=0, rewards=[], total_reward=0.0, end="failed", error="step hung")
    output.write_text("".join(json.dumps(r) + "\n" for r in [row, row, row, bad]))
    loose = EnvironmentConfig(kind="calculator", max_failed_share=0.3)
    summary = check_episodes(str(output), loose, LOG)
    assert (summary["episodes"], summary["failed"], summary["failure_reasons"]) == (
        4,
        1,
        ["step hung"],
    )
    assert summary["mean_turns"] == 0.75
    strict = EnvironmentConfig(kind="calculator", max_failed_share=0.2)
    with pytest.raises(RuntimeError) as e:
        check_episodes(str(output), strict, LOG)
    assert str(e.value) == (
        "collect: 1 of 4 episodes failed (25%), above environment.max_failed_share (20%); "
        "the first reasons are in the log"
    )


def test_the_environment_is_part_of_the_resume_resume_key(tmp_path: Path):
    plain = config(tmp_path, "http://127.0.0.1:9/v1", environment=None)
    calc = config(tmp_path, "http://127.0.0.1:9/v1")
    retry = config(tmp_path, "http://127.0.0.1:9/v1", environment={"kind": "retry"})
    loose = config(
        tmp_path, "http://127.0.0.1:9/v1", environment={"kind": "calculator", "timeout_s": 5}
    )
    assert len({io.resume_key(c) for c in (plain, calc, retry)}) == 3
    assert io.resume_key(loose) == io.resume_key(calc)  # how patient, not what is collected


def test_the_completions_endpoint_cannot_run_episodes_and_local_can(tmp_path: Path):
    stub_checkpoint(tmp_path / "m")
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              c: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, environment: {kind: calculator}}}
              d: {kind: collect, config: {input: x.jsonl, backend: {kind: openai, base_url: u, model: m, endpoint: completions}, environment: {kind: calculator}}}
            """
        )
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "p.yaml:4:104: stages.d.config.backend.endpoint: an environment's episodes are "
        "conversations, sent to the chat endpoint: set it to 'chat', found 'completions'",
    ]


class Guess:
    """A user's environment: 1.0 for the row's answer, else "try again"."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: Any, completion: str) -> tuple[float, Any, bool]:
        if completion.strip() == self.answer:
            return 1.0, None, True
        return 0.0, [{"role": "user", "content": "try again"}], False


def test_local_episodes_are_the_http_paths_lines_and_resume(tmp_path: Path):
    """The `local` backend plays the episodes in the stage's process (evaluate's batched
    driver); a killed run's rerun plays only the episodes not written."""
    pytest.importorskip("torch")
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model

    rows = [{"prompt": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(4)]
    build_tiny_model(
        TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300),
        [f"{r['prompt']} {r['answer']} try again" for r in rows] * 5,
        str(tmp_path / "m"),
        seed=0,
    )
    local = {"kind": "local", "model": str(tmp_path / "m"), "batch_size": 3}
    env = {"kind": f"{__name__}:Guess", "max_turns": 2}
    cfg = config(tmp_path, "", backend=local, environment=env, verifier={}, max_output_tokens=4)
    metrics = run_collect(cfg, ctx(tmp_path))
    lines = Path(cfg.output).read_text().splitlines()
    got = [json.loads(line) for line in lines]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in got] == [
        (i, s) for i in range(4) for s in range(2)
    ]
    keys = ["prompt_idx", "sample_idx", "prompt", "answer", "messages", "rewards",
            "total_reward", "turns", "solved", "end", "reward", "usage", "latency_s"]  # fmt: skip
    for r in got:
        assert list(r) == keys
        assert r["messages"][0] == {"role": "user", "content": rows[r["prompt_idx"]]["prompt"]}
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"][
            : 2 * r["turns"]
        ]
        assert r["end"] in ("done", "max_turns") and len(r["rewards"]) == r["turns"]
        assert r["usage"]["prompt_tokens"] > 0 and 0 < r["usage"]["completion_tokens"] <= 8
    assert metrics["written"] == 8 and metrics["episodes"]["episodes"] == 8
    # a run killed after three episodes: its rerun plays the five others
    Path(cfg.output).unlink()
    Path(io.partial_path(cfg.output)).write_text("".join(f"{line}\n" for line in lines[:3]))
    Path(io.meta_path(cfg.output)).write_text(json.dumps({"resume_key": io.resume_key(cfg)}))
    again = run_collect(cfg, ctx(tmp_path))
    assert again["written"] == 5
    assert Path(cfg.output).read_text().splitlines()[:3] == lines[:3]
    assert len(read(cfg.output)) == 8


def test_the_filter_reads_an_episodes_assistant_turns():
    def episode(sample: int, answer: str) -> dict[str, Any]:
        messages = [
            {"role": "user", "content": "What is 2 * 3?"},
            {"role": "assistant", "content": "calc: 2 * 3"},
            {"role": "user", "content": "result: 6"},
            {"role": "assistant", "content": answer},
        ]
        return {"prompt_idx": 0, "sample_idx": sample, "prompt": "What is 2 * 3?",
                "messages": messages, "turns": 2, "reward": 1.0}  # fmt: skip

    rows = [episode(0, "6"), episode(1, "six"), episode(2, "6")]
    assert completion_text(rows[0]) == "calc: 2 * 3\n6"
    assert completion_text({"completion": "x", "messages": [], "turns": 1}) == "x"
    rules = Rules(FilterConfig(dedup="exact", max_length=14))
    parsed = [filter_row(json.dumps(r).encode(), 0, "f") for r in rows]
    assert [rules.key(r) for r in parsed].count(rules.key(parsed[0])) == 2
    assert rules.key(parsed[1]) != rules.key(parsed[0])
    reasons = [rules.row_reason(r, Counts()) for r in parsed]
    assert reasons == [None, "max_length", None]  # 13 and 15 characters
