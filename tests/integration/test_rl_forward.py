"""The rl actor's passes go through the model's top-level forward (`tests.forward_rank`):
the same log-probabilities as calling the decoder and the head directly, and ZeRO-3's trace,
which starts at the root module's forward hook (the prefetching it drives never ran on the
old path), is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from stages.lib.launch import free_port
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def forward_rank(device: str, *extra: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    args = [sys.executable, "-m", "tests.forward_rank", device, *extra]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return result


def test_actor_forward_runs_zero3_hooks_with_equal_logprobs():
    pytest.importorskip("deepspeed")
    result = forward_rank("cpu")
    assert result["max_diff"] < 1e-5
    assert result["traces"][-1] is True  # ZeRO-3 recorded the module trace
    old = forward_rank("cpu", "direct")
    assert old["traces"] == [False, False, False]  # the old path never completed one


@pytest.mark.gpu
def test_actor_forward_runs_zero3_hooks_on_cuda():
    result = forward_rank("cuda")
    assert result["max_diff"] < 1e-4
    assert result["traces"][-1] is True
