"""The collect stage end to end against the bench's fake OpenAI server (in a thread).

Exact outputs: every pair once, rewards from the server's deterministic
answers, bad rows in the failures sidecar, resume that redoes nothing written.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig, io
from stages.collect.measure import LevelResult, measure_level
from stages.collect.run import run_collect
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import Faults, ThreadHandle, expected_answer, start_in_thread


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadHandle]:
    handle = start_in_thread(capacity=32, latency_ms=2)
    yield handle
    handle.stop()


def write_rows(path: Path, rows: list[Any]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def question(i: int) -> str:
    return f"What is {i} + {i}?"


def good_rows(n: int) -> list[dict[str, Any]]:
    """Even rows answered right by the fake server, odd rows wrong."""
    return [
        {"prompt": question(i), "answer": expected_answer(question(i)) if i % 2 == 0 else "no"}
        for i in range(n)
    ]


def config(tmp_path: Path, url: str, **kw: Any) -> CollectConfig:
    base = {
        "input": str(tmp_path / "in.jsonl"),
        "output": str(tmp_path / "stage" / "rollouts.jsonl"),
        "num_samples_in_parallel": 8,
        "backend": {"kind": "openai", "base_url": url, "model": "fake"},
        "verifier": {"kind": "exact_match"},
        "timeout_s": 10.0,
        "backoff_s": 0.01,
    }
    return CollectConfig.model_validate({**base, **kw}, strict=False)


def context(tmp_path: Path) -> StageContext:
    stage = tmp_path / "stage"
    stage.mkdir(exist_ok=True)
    return StageContext("collect", "collect", str(stage), str(tmp_path), str(tmp_path))


def read_jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def expected_rollout(i: int, s: int, row: dict[str, Any]) -> dict[str, Any]:
    answer = expected_answer(row["prompt"])
    return {
        "prompt_idx": i,
        "sample_idx": s,
        **row,
        "completion": f"<answer>{answer}</answer>",
        "reward": 1.0 if row["answer"] == answer else 0.0,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": len(row["prompt"].split()), "completion_tokens": 4},
    }


def without_latency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        assert 0 < row.pop("latency_s") < 10
    return rows


def test_collects_every_pair_once_with_exact_rewards(tmp_path: Path, server: ThreadHandle):
    rows: list[Any] = good_rows(8)
    rows[3] = "{broken json"
    rows[5] = {"answer": "1"}  # no prompt at all
    write_rows(tmp_path / "in.jsonl", rows)
    cfg = config(tmp_path, server.url, num_repeats=3, start_idx=1, limit=6)
    metrics = run_collect(cfg, context(tmp_path))
    out = without_latency(read_jsonl(cfg.output))
    good = [1, 2, 4, 6]
    assert out == [expected_rollout(i, s, rows[i]) for i in good for s in range(3)]
    failures = read_jsonl(io.failures_path(cfg.output))
    assert [(f["prompt_idx"], f["sample_idx"], f["error_kind"]) for f in failures] == [
        (i, s, "bad_row") for i in (3, 5) for s in range(3)
    ]
    assert failures[3]["error"] == (
        "bad_row: the row has none of 'messages', 'prompt', 'responses_create_params'"
    )
    assert failures[3]["answer"] == "1" and failures[3]["attempts"] == 0
    assert (metrics["written"], metrics["failed"], metrics["rows"], metrics["failures"]) == (
        12,
        6,
        12,
        6,
    )
    assert metrics["tokens"] == {"prompt": 12 * 5, "completion": 12 * 4}  # "What is i + i?"
    assert sorted(p.name for p in Path(cfg.output).parent.iterdir()) == [
        "rollouts.jsonl",
        "rollouts.jsonl.done.json",  # what the complete output was made with
        "rollouts.jsonl.failures.jsonl",
        "track.jsonl",  # the progress points for the run's trackers (stages.lib.io.metrics)
    ]


def test_requests_to_an_openai_server_carry_the_configs_values_in_openais_fields_only(
    tmp_path: Path, server: ThreadHandle
):
    """A server the stage did not start (`backend: openai`) is sent the config's temperature
    and top_p and OpenAI's neutral penalties, and no vLLM-only field (OpenAI's API refuses a
    request carrying `top_k`); the metrics record exactly what was sent."""
    write_rows(tmp_path / "in.jsonl", good_rows(2))
    cfg = config(tmp_path, server.url, temperature=0.7, top_p=0.9)
    fake = server.server
    fake.record_bodies = True
    try:
        metrics = run_collect(cfg, context(tmp_path))
    finally:
        fake.record_bodies = False
    asked = {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    keys = {"top_k", "min_p", "repetition_penalty", *asked}
    bodies, fake.counters.bodies, fake.counters.sampled = fake.counters.bodies, [], []
    assert [{k: v for k, v in b.items() if k in keys} for b in bodies] == [asked] * (
        2 * cfg.num_repeats
    )
    assert metrics["sampling"] == asked


def test_a_vllm_server_the_stage_started_samples_what_was_asked_whatever_its_defaults(
    server: ThreadHandle,
):
    """A server with a checkpoint's generation_config as its sampling defaults (vLLM's
    `--generation-config auto`: top_k 20, top_p 0.8, repetition_penalty 1.05) samples each
    request at the config's temperature and top_p, the rest neutral: every field is sent."""
    import asyncio

    from stages.lib.api.client import complete_all
    from stages.lib.backends.endpoint import Endpoint, make_client

    fake = server.server
    fake.record_bodies = True
    fake.defaults = {"top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    settings = SimpleNamespace(temperature=0.7, top_p=0.9, max_output_tokens=8, timeout_s=10.0)
    client = make_client(settings, Endpoint(server.url, "fake", "chat", vllm=True), 4)  # type: ignore[arg-type]
    try:
        asyncio.run(complete_all(client, [question(0), question(1)], num_samples=2, seed=0))
    finally:
        fake.record_bodies, fake.defaults = False, {}
    asked = {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip
    sampled, fake.counters.sampled, fake.counters.bodies = fake.counters.sampled, [], []
    assert sampled == [asked] * 4


def test_chat_rows_and_the_completions_endpoint(tmp_path: Path, server: ThreadHandle):
    rows = [
        {"messages": [{"role": "user", "content": question(0)}], "answer": "x"},
        {"prompt": question(1), "answer": "y"},
    ]
    write_rows(tmp_path / "in.jsonl", rows)
    backend = {"kind": "openai", "base_url": server.url, "model": "fake", "endpoint": "completions"}
    cfg = config(tmp_path, server.url, backend=backend)
    metrics = run_collect(cfg, context(tmp_path))
    assert [r["prompt_idx"] for r in read_jsonl(cfg.output)] == [1]
    (failure,) = read_jsonl(io.failures_path(cfg.output))
    assert failure["error"] == "bad_row: the completions endpoint needs rows with a 'prompt' string"
    assert metrics["failed"] == 1


def test_resume_redoes_nothing_written_and_retries_failures_up_to_the_cap(
    tmp_path: Path, server: ThreadHandle
):
    rows = good_rows(10)
    write_rows(tmp_path / "in.jsonl", rows)
    cfg = config(tmp_path, server.url, num_repeats=2, max_failed_runs=3)
    ctx = context(tmp_path)
    io.prepare(cfg.output, io.resume_key(cfg))  # as a killed earlier run left it
    earlier = [(0, 0), (0, 1), (4, 1), (7, 0)]
    lines = [
        json.dumps({**expected_rollout(i, s, rows[i]), "completion": "EARLIER", "latency_s": 1.0})
        for i, s in earlier
    ]
    torn = '{"prompt_idx": 9, "sample_idx": 0, "prompt": "What'
    Path(io.partial_path(cfg.output)).write_text("\n".join(lines) + "\n" + torn)
    history = [
        {
            "prompt_idx": 2,
            "sample_idx": 0,
            "error_kind": "timeout",
            "failed_runs": 1,
            "retryable": True,
        },
        {
            "prompt_idx": 3,
            "sample_idx": 1,
            "error_kind": "timeout",
            "failed_runs": 3,
            "retryable": True,
        },
        {
            "prompt_idx": 5,
            "sample_idx": 0,
            "error_kind": "http_error",
            "failed_runs": 1,
            "retryable": False,
        },
    ]
    write_rows(Path(io.failures_path(cfg.output)), history)
    before = server.server.counters.requests
    metrics = run_collect(cfg, ctx)
    sent = server.server.counters.requests - before
    assert sent == 20 - len(earlier) - 2  # not the written pairs, not the two given up
    out = read_jsonl(cfg.output)
    given_up = [(3, 1), (5, 0)]
    expected_keys = [(i, s) for i in range(10) for s in range(2) if (i, s) not in given_up]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in out] == expected_keys
    assert [
        (r["prompt_idx"], r["sample_idx"]) for r in out if r["completion"] == "EARLIER"
    ] == earlier
    assert [
        (f["prompt_idx"], f["sample_idx"]) for f in read_jsonl(io.failures_path(cfg.output))
    ] == given_up
    assert (metrics["skipped_resumed"], metrics["skipped_failed"], metrics["written"]) == (4, 2, 14)


def test_a_complete_output_means_nothing_to_do(tmp_path: Path, server: ThreadHandle):
    write_rows(tmp_path / "in.jsonl", good_rows(4))
    cfg = config(tmp_path, server.url)
    run_collect(cfg, context(tmp_path))
    first = Path(cfg.output).read_bytes()
    before = server.server.counters.requests
    metrics = run_collect(cfg, context(tmp_path))
    assert metrics == {"up_to_date": True, "rows": 4, "failures": 0, "written": 0}
    assert server.server.counters.requests == before
    assert Path(cfg.output).read_bytes() == first


def test_a_complete_output_made_with_other_settings_is_collected_again(
    tmp_path: Path, server: ThreadHandle
):
    """The stage runs again when its config changed (the engine's cache key): an output made
    with another verifier, temperature or range is not taken as complete."""
    write_rows(tmp_path / "in.jsonl", good_rows(4))
    cfg = config(tmp_path, server.url)
    run_collect(cfg, context(tmp_path))
    before = server.server.counters.requests
    hotter = cfg.model_copy(update={"temperature": cfg.temperature + 0.5})
    metrics = run_collect(hotter, context(tmp_path))
    assert "up_to_date" not in metrics and metrics["written"] == 4 * cfg.num_repeats
    assert server.server.counters.requests - before == 4 * cfg.num_repeats
    fewer = hotter.model_copy(update={"limit": 2})
    run_collect(fewer, context(tmp_path))
    assert len(read_jsonl(cfg.output)) == 2 * cfg.num_repeats
    assert run_collect(fewer, context(tmp_path))["up_to_date"] is True


def test_changed_sampling_settings_start_over(tmp_path: Path, server: ThreadHandle):
    write_rows(tmp_path / "in.jsonl", good_rows(3))
    cfg = config(tmp_path, server.url, temperature=0.5)
    ctx = context(tmp_path)
    io.prepare(cfg.output, "written-under-other-settings")
    Path(io.partial_path(cfg.output)).write_text(
        json.dumps({"prompt_idx": 0, "sample_idx": 0}) + "\n"
    )
    metrics = run_collect(cfg, ctx)
    assert (metrics["skipped_resumed"], metrics["written"]) == (0, 3)


def test_client_errors_fail_at_once_without_retries(tmp_path: Path, server: ThreadHandle):
    write_rows(tmp_path / "in.jsonl", good_rows(3))
    cfg = config(tmp_path, server.url + "/nope", max_retries=5)
    metrics = run_collect(cfg, context(tmp_path))
    assert Path(cfg.output).read_text() == ""
    failures = read_jsonl(io.failures_path(cfg.output))
    assert [(f["error_kind"], f["attempts"], f["retryable"]) for f in failures] == [
        ("http_error", 1, False)
    ] * 3
    assert failures[0]["error"].startswith("http_error: HTTP 404: ")
    assert (metrics["errors"], metrics["retries"]) == ({"http_error": 3}, 0)


def test_the_api_key_is_sent_and_never_written(
    tmp_path: Path,
    server: ThreadHandle,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    write_rows(tmp_path / "in.jsonl", good_rows(3))
    backend = {
        "kind": "openai",
        "base_url": server.url,
        "model": "fake",
        "api_key_env": "PIPE_T_KEY",
    }
    cfg = config(tmp_path, server.url, backend=backend)
    with pytest.raises(ValueError) as info:
        run_collect(cfg, context(tmp_path))
    assert str(info.value) == (
        "backend.api_key_env names 'PIPE_T_KEY', which is not set in the environment"
    )
    monkeypatch.setenv("PIPE_T_KEY", "sk-secret-123")
    with caplog.at_level(logging.DEBUG):
        metrics = run_collect(cfg, context(tmp_path))
    assert "Bearer sk-secret-123" in server.server.counters.authorizations
    assert "sk-secret-123" not in caplog.text + json.dumps(metrics)
    for path in (tmp_path / "stage").iterdir():
        assert b"sk-secret-123" not in path.read_bytes(), path


def test_retries_ride_out_server_errors(tmp_path: Path):
    flaky = start_in_thread(
        capacity=16, latency_ms=1, faults=Faults(error_500=0.3, error_429=0.1), seed=3
    )
    try:
        write_rows(tmp_path / "in.jsonl", good_rows(30))
        cfg = config(tmp_path, flaky.url, max_retries=12)
        metrics = run_collect(cfg, context(tmp_path))
    finally:
        flaky.stop()
    assert [r["prompt_idx"] for r in read_jsonl(cfg.output)] == list(range(30))
    injected = flaky.server.counters.injected
    assert metrics["errors"] == {
        "rate_limited": injected["error_429"],
        "server_error": injected["error_500"],
    }
    assert metrics["retries"] == sum(injected.values()) and metrics["failed"] == 0


def test_auto_concurrency_collects_everything(tmp_path: Path, server: ThreadHandle):
    write_rows(tmp_path / "in.jsonl", good_rows(200))
    cfg = config(tmp_path, server.url, num_samples_in_parallel="auto")
    metrics = run_collect(cfg, context(tmp_path))
    assert metrics["rows"] == 200 and metrics["concurrency"]["max"] >= 32


def test_measure_level_counts_requests_and_errors(tmp_path: Path, server: ThreadHandle):
    cfg = config(tmp_path, server.url)
    result = measure_level(cfg, good_rows(5), parallelism=4, num_requests=40)
    assert isinstance(result, LevelResult)
    assert (result.parallelism, result.errors, result.timeouts) == (4, 0, 0)
    assert result.rollouts_per_s == pytest.approx(40 / result.wall_s)
    assert 0 < result.p50_s <= result.p95_s < result.wall_s and result.verify_s > 0
    assert not list(tmp_path.iterdir())  # writes nothing
    flaky = start_in_thread(
        capacity=8, latency_ms=1, faults=Faults(error_500=0.25, hang=0.1, hang_s=30), seed=5
    )
    try:
        cfg = config(tmp_path, flaky.url, timeout_s=0.3)
        result = measure_level(cfg, good_rows(5), parallelism=8, num_requests=60)
    finally:
        flaky.stop()
    injected = flaky.server.counters.injected
    assert (result.errors, result.timeouts) == (sum(injected.values()), injected["hang"])
    with pytest.raises(ValueError, match="row 1: bad_row: 'prompt' must be a string"):
        measure_level(cfg, [{"prompt": "a"}, {"prompt": 3}], 1, 1)
