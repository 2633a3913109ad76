"""Acceptance 4: a backend answering 20% 500, 10% 429, 5% resets, 2% hangs past the timeout.

Every (prompt, sample) pair ends in the output or, after the retry cap, in
the failures sidecar; none lost, none in both, none twice; in bounded time.
The fake server runs in its own process, as a real backend would.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig, io
from stages.collect.run import run_collect
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import ProcessHandle, expected_answer, start_subprocess

pytestmark = pytest.mark.integration

FAULTS = ("--error-500", "0.20", "--error-429", "0.10", "--reset", "0.05", "--hang", "0.02")


@pytest.fixture
def faulty() -> Iterator[ProcessHandle]:
    handle = start_subprocess(32, 5, *FAULTS, "--hang-s", "600", "--seed", "11")
    yield handle
    handle.stop()


def test_every_pair_ends_in_the_output_or_the_failures(tmp_path: Path, faulty: ProcessHandle):
    n, repeats = 250, 2
    rows = [
        {"prompt": f"What is {i} * 3?", "answer": expected_answer(f"What is {i} * 3?")}
        for i in range(n)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(tmp_path / "rollouts.jsonl"),
            "num_samples_in_parallel": 32,
            "num_repeats": repeats,
            "timeout_s": 1.0,
            "max_retries": 3,
            "backoff_s": 0.05,
            "backend": {"kind": "openai", "base_url": faulty.url, "model": "fake"},
            "verifier": {"kind": "exact_match"},
        },
        strict=False,
    )
    ctx = StageContext("collect", "collect", str(tmp_path), str(tmp_path), str(tmp_path))
    started = time.monotonic()
    metrics = run_collect(cfg, ctx)
    took = time.monotonic() - started

    out = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    failures_file = Path(io.failures_path(cfg.output))
    failed = (
        [json.loads(x) for x in failures_file.read_text().splitlines()]
        if failures_file.exists()
        else []
    )
    done = [(r["prompt_idx"], r["sample_idx"]) for r in out]
    lost = [(f["prompt_idx"], f["sample_idx"]) for f in failed]
    everything = {(i, s) for i in range(n) for s in range(repeats)}
    assert len(done) == len(set(done)) and len(lost) == len(set(lost))  # none twice
    assert not set(done) & set(lost)  # none in both
    assert set(done) | set(lost) == everything  # none lost
    assert done == sorted(done)
    assert all(
        r["reward"] == 1.0 and r["completion"] == f"<answer>{r['answer']}</answer>" for r in out
    )
    for f in failed:  # failed for good only after the cap, with what went wrong
        assert f["attempts"] == 4 and f["retryable"] is True
        assert f["error_kind"] in {"server_error", "rate_limited", "connection", "timeout"}
    # 37% of attempts fail: about 1.9% of pairs fail all four
    assert len(lost) <= 0.06 * len(everything)
    errors = metrics["errors"]
    assert set(errors) <= {"server_error", "rate_limited", "connection", "timeout"}
    assert errors["server_error"] > 0 and errors["rate_limited"] > 0
    assert errors["connection"] > 0 and errors["timeout"] > 0
    assert metrics["written"] == len(done) and metrics["failed"] == len(lost)
    assert took < 90
