"""Collect with an environment against the fake OpenAI server scripted to call tools.

- The calculator environment: every episode's messages, per-turn rewards and turns are in
  the output, and each model turn was sent the conversation so far as messages.
- SIGKILL the collector mid-run several times, rerun: no episode lost or written twice.
- Faulty environments of a user's own (`module:Class` below: raises, hangs past timeout_s,
  answers NaN or a string), in threads and as coroutines: those episodes fail with the
  reason and are counted, the others go on; `pipe run` exits 0 under
  `environment.max_failed_share` and fails with a clear error above it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig, io
from stages.collect.run import run_collect
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import ThreadHandle, expected_answer, start_in_thread

from tests.integration.test_collect_kill import written_past

pytestmark = pytest.mark.integration

RUNNER = """
import json, sys
from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect
cfg = CollectConfig.model_validate(json.loads(sys.argv[1]), strict=False)
folder = sys.argv[2]
print(json.dumps(run_collect(cfg, StageContext("collect", "collect", folder, folder, folder))))
"""
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


class Faulty:
    """A user's environment that breaks on rows naming a `fault`; answers 1.0 otherwise."""

    def __init__(self, hang_s: float = 2.0) -> None:
        self.hang_s = hang_s
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[dict[str, str]], completion: str) -> Any:
        fault = self.row.get("fault")
        if fault == "raises":
            raise ValueError("boom")
        if fault == "hangs":
            time.sleep(self.hang_s)  # bounded: the thread it runs in ends soon after
        if fault == "nan":
            return float("nan"), None, True
        if fault == "string":
            return "1.0", None, True
        return 1.0, None, True


class AsyncFaulty(Faulty):
    """The same faults from coroutines (a hang here is cancelled at the timeout)."""

    async def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:  # type: ignore[override]
        return super().reset(row)

    async def step(self, messages: list[dict[str, str]], completion: str) -> Any:
        if self.row.get("fault") == "hangs":
            await asyncio.sleep(3600)
        return super().step(messages, completion)


@pytest.fixture
def server() -> Iterator[ThreadHandle]:
    handle = start_in_thread(capacity=8, latency_ms=2)
    handle.server.tools = True
    yield handle
    handle.stop()


def ctx(folder: Path) -> StageContext:
    return StageContext("collect", "collect", str(folder), str(folder), str(folder))


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def calculator_rows(n: int) -> list[dict[str, Any]]:
    """Questions with an expression (answered through a calc: call) and without (at once)."""
    rows = []
    for i in range(n):
        if i % 3 == 2:
            text = f"Name the number for item {i}."
            rows.append({"prompt": text, "answer": expected_answer(text), "id": i})
        else:
            rows.append({"prompt": f"What is {i} * 7 + 1?", "answer": str(i * 7 + 1), "id": i})
    return rows


def expected_episode(row: dict[str, Any]) -> tuple[list[dict[str, str]], list[float]]:
    question = {"role": "user", "content": row["prompt"]}
    answer = {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"}
    if row["id"] % 3 == 2:
        return [question, answer], [1.0]
    i = row["id"]
    call = {"role": "assistant", "content": f"calc: {i} * 7 + 1"}
    result = {"role": "user", "content": f"result: {i * 7 + 1}"}
    return [question, call, result, answer], [0.0, 1.0]


def test_calculator_episodes_hold_every_turn(tmp_path: Path, server: ThreadHandle):
    rows = calculator_rows(12)
    server.server.record_bodies = True
    cfg = CollectConfig.model_validate(
        {
            "input": write_rows(tmp_path / "in.jsonl", rows),
            "output": str(tmp_path / "episodes.jsonl"),
            "num_samples_in_parallel": "auto",
            "num_repeats": 2,
            "backend": {"kind": "openai", "base_url": server.url, "model": "fake"},
            "verifier": {"kind": "exact_match"},
            "environment": {"kind": "calculator"},
        },
        strict=False,
    )
    metrics = run_collect(cfg, ctx(tmp_path))
    out = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in out] == [
        (i, s) for i in range(12) for s in range(2)
    ]
    for r in out:
        row = rows[r["prompt_idx"]]
        messages, rewards = expected_episode(row)
        assert (r["messages"], r["rewards"], r["turns"]) == (messages, rewards, len(rewards))
        assert (r["total_reward"], r["reward"], r["solved"], r["end"]) == (1.0, 1.0, True, "done")
        assert (r["prompt"], r["answer"], r["id"]) == (row["prompt"], row["answer"], row["id"])
    # each model turn got the conversation so far, as chat messages
    sent = sorted(json.dumps(b["messages"]) for b in server.server.counters.bodies)
    wanted = []
    for r in out:
        for k, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                wanted.append(json.dumps(r["messages"][:k]))
    assert sent == sorted(wanted)
    assert metrics["episodes"]["episodes"] == 24 and metrics["episodes"]["failed"] == 0
    assert metrics["episodes"]["mean_turns"] == pytest.approx((16 * 2 + 8) / 24, abs=1e-3)


def _partial_keys(output: str) -> list[tuple[int, int]]:
    path = Path(io.partial_path(output))
    if not path.exists():
        return []
    keys = []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.endswith(b"}\n"):
            assert json.loads(line)["end"] == "done"  # only finished episodes are written
            key = io.rollout_key(line)
            assert key is not None
            keys.append(key)
    return keys


def test_sigkill_then_resume_loses_and_repeats_no_episode(tmp_path: Path):
    n, repeats = 90, 2
    rows = calculator_rows(n)
    handle = start_in_thread(capacity=2, latency_ms=40)  # ~50 requests/s: ~6 s of work
    handle.server.tools = True
    output = str(tmp_path / "episodes.jsonl")
    cfg = {
        "input": write_rows(tmp_path / "in.jsonl", rows),
        "output": output,
        "num_samples_in_parallel": 4,
        "num_repeats": repeats,
        "backend": {"kind": "openai", "base_url": handle.url, "model": "fake"},
        "verifier": {"kind": "exact_match"},
        "environment": {"kind": "calculator"},
    }
    cmd = [sys.executable, "-c", RUNNER, json.dumps(cfg), str(tmp_path)]
    rng = random.Random(3)
    seen = []
    try:
        for k in range(4):
            proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            delay = rng.uniform(1.5, 2.5)  # start-up (~1 s) included
            if k < 3:
                time.sleep(delay)
            else:  # the last kill after some work, however slow the start-up here
                written_past(output, seen[-1], proc)
            assert proc.poll() is None, "the collector finished before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            keys = _partial_keys(output)
            assert len(keys) == len(set(keys)), "an episode was written twice"
            seen.append(len(keys))
        assert not Path(output).exists()
        assert seen == sorted(seen) and 0 < seen[-1] < n * repeats, seen
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        handle.stop()
    assert proc.returncode == 0
    metrics = json.loads(stdout.decode().splitlines()[-1])
    out = [json.loads(line) for line in Path(output).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in out] == [
        (i, s) for i in range(n) for s in range(repeats)
    ]
    for r in out:
        assert (r["messages"], r["rewards"]) == expected_episode(rows[r["prompt_idx"]])
    assert metrics["skipped_resumed"] == seen[-1]
    assert metrics["written"] == n * repeats - seen[-1]
    assert metrics["episodes"]["episodes"] == n * repeats


FAULTS = ("raises", "hangs", "nan", "string")
REASONS = {
    "raises": "step raised ValueError: boom",
    "hangs": "step took longer than 0.3 s",
    "nan": "step returned the reward nan: expected a finite number",
    "string": "step returned the reward '1.0': expected a number",
}


def faulty_rows(n: int) -> list[dict[str, Any]]:
    """`n` rows, the first four with one fault each."""
    rows: list[dict[str, Any]] = [{"prompt": f"Question {i}."} for i in range(n)]
    for row, fault in zip(rows, FAULTS, strict=False):
        row["fault"] = fault
    return rows


@pytest.mark.parametrize("kind", ["Faulty", "AsyncFaulty"])
def test_faulty_environments_fail_their_episodes_only(
    tmp_path: Path, server: ThreadHandle, kind: str
):
    rows = faulty_rows(20)
    environment = {
        "kind": f"tests.integration.test_collect_env:{kind}",
        "max_turns": 2,
        "timeout_s": 0.3,
        "max_failed_share": 0.25,
        "config": {"hang_s": 1.0},
    }
    cfg = CollectConfig.model_validate(
        {
            "input": write_rows(tmp_path / "in.jsonl", rows),
            "output": str(tmp_path / "episodes.jsonl"),
            "num_samples_in_parallel": 8,
            "backend": {"kind": "openai", "base_url": server.url, "model": "fake"},
            "environment": environment,
        },
        strict=False,
    )
    started = time.monotonic()
    metrics = run_collect(cfg, ctx(tmp_path))
    assert time.monotonic() - started < 30
    out = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    assert len(out) == 20
    for r in out:
        fault = r.get("fault")
        if fault is None:
            assert (r["rewards"], r["end"], "error" in r) == ([1.0], "done", False)
        else:
            assert (r["end"], r["error"], r["rewards"], r["reward"]) == (
                "failed",
                REASONS[fault],
                [],
                0.0,
            )
            assert r["messages"][-1]["role"] == "assistant"  # the turn that failed is kept
    summary = metrics["episodes"]
    assert (summary["episodes"], summary["failed"]) == (20, 4)
    assert sorted(summary["failure_reasons"]) == sorted(REASONS.values())

    stricter = cfg.model_copy(
        update={"environment": cfg.environment.model_copy(update={"max_failed_share": 0.1})}
    )
    with pytest.raises(RuntimeError) as e:  # the same output, a stricter bar
        run_collect(stricter, ctx(tmp_path))
    assert str(e.value) == (
        "collect: 4 of 20 episodes failed (20%), above environment.max_failed_share (10%); "
        "the first reasons are in the log"
    )


PIPELINE = """\
name: p
stages:
  collect:
    kind: collect
    config:
      input: in.jsonl
      backend: {kind: openai, base_url: "URL", model: fake}
      environment:
        kind: tests.integration.test_collect_env:AsyncFaulty
        max_turns: 2
        timeout_s: 0.3
        max_failed_share: SHARE
"""


@pytest.mark.parametrize(("share", "code"), [(0.25, 0), (0.1, 1)])
def test_pipe_run_exit_code_follows_the_failed_share(
    tmp_path: Path, server: ThreadHandle, share: float, code: int
):
    write_rows(tmp_path / "in.jsonl", faulty_rows(20))
    text = PIPELINE.replace("URL", server.url).replace("SHARE", str(share))
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    if code:
        assert (
            "collect: 4 of 20 episodes failed (20%), above environment.max_failed_share (10%)"
            in proc.stderr
        )
