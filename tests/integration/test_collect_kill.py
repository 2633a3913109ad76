"""Acceptance 3: SIGKILL the collector at random points, restart it, lose and repeat nothing.

The collector runs in a subprocess (the stage function, as a Dask worker
would call it) against the fake server; it is killed with SIGKILL at random
moments at least five times, then run to completion. After every kill the
partial file holds each (prompt_idx, sample_idx) at most once; at the end the
output holds exactly N x num_repeats pairs, each once, with the right answers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.collect import io
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import ThreadHandle, expected_answer, start_in_thread

pytestmark = pytest.mark.integration

N, REPEATS, KILLS = 200, 3, 6

RUNNER = """
import json, sys
from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect
cfg = CollectConfig.model_validate(json.loads(sys.argv[1]), strict=False)
folder = sys.argv[2]
print(json.dumps(run_collect(cfg, StageContext("collect", "collect", folder, folder, folder))))
"""


@pytest.fixture
def slow_server() -> Iterator[ThreadHandle]:
    handle = start_in_thread(capacity=2, latency_ms=40)  # ~50 rollouts/s: 12 s of work
    yield handle
    handle.stop()


def _start(cfg: dict[str, object], folder: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", RUNNER, json.dumps(cfg), str(folder)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _partial_keys(output: str) -> list[tuple[int, int]]:
    path = Path(io.partial_path(output))
    if not path.exists():
        return []
    keys = []
    for line in path.read_bytes().splitlines(keepends=True):
        key = io.rollout_key(line) if line.endswith(b"}\n") else None
        if key is not None:
            keys.append(key)
    return keys


def written_past(
    output: str, before: int, proc: subprocess.Popen[bytes], timeout_s: float = 120
) -> None:
    """Wait (bounded) until the partial file holds more than `before` pairs: the last kill
    lands after some work, however long the collector's start-up takes on a loaded machine
    (no fixed delay outlasts it there)."""
    deadline = time.monotonic() + timeout_s
    while len(_partial_keys(output)) <= before and proc.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


def test_sigkill_at_random_points_then_resume(tmp_path: Path, slow_server: ThreadHandle):
    rows = [
        {"prompt": f"Add {i} and 1.", "answer": expected_answer(f"Add {i} and 1.")}
        for i in range(N)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = str(tmp_path / "rollouts.jsonl")
    cfg = {
        "input": str(tmp_path / "in.jsonl"),
        "output": output,
        "num_samples_in_parallel": 8,
        "num_repeats": REPEATS,
        "backend": {"kind": "openai", "base_url": slow_server.url, "model": "fake"},
        "verifier": {"kind": "exact_match"},
    }
    rng = random.Random(5)
    seen = []
    for k in range(KILLS):
        proc = _start(cfg, tmp_path)
        delay = rng.uniform(0.3, 2.0)  # start-up included: some kills land before any write
        if k < KILLS - 1:
            time.sleep(delay)
        else:
            written_past(output, seen[-1], proc)
        assert proc.poll() is None, "the collector finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        keys = _partial_keys(output)
        assert len(keys) == len(set(keys)), "a pair was written twice"
        seen.append(len(keys))
    assert not Path(output).exists()
    assert seen == sorted(seen) and seen[-1] > 0  # work survived the kills
    assert seen[-1] < N * REPEATS

    proc = _start(cfg, tmp_path)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    metrics = json.loads(stdout.decode().splitlines()[-1])
    out = [json.loads(line) for line in Path(output).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in out] == [
        (i, s) for i in range(N) for s in range(REPEATS)
    ]
    assert all(r["reward"] == 1.0 and r["prompt"] == rows[r["prompt_idx"]]["prompt"] for r in out)
    assert metrics["skipped_resumed"] == seen[-1]
    assert metrics["written"] == N * REPEATS - seen[-1]
    assert not Path(io.partial_path(output)).exists()
    assert not Path(io.failures_path(output)).exists()
