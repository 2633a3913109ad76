"""The quickstart pipeline end to end through `pipe run`, shrunk with --set to tiny sizes.

Every stage runs for real (reasoning-gym data, a tiny Llama trained through DeepSpeed on
the CPU, local generation, verification, filtering, RFT, evaluation) on the embedded
LocalCluster; only the sizes are small. The filter keeps every rollout here (min_reward
0) so the RFT stage always has data after a warm-up too short to be accurate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHRINK = [
    "stages.data.config.size=96",
    "stages.data.config.test_size=24",
    "stages.data.config.val_size=8",
    "stages.warmup.config.max_steps=6",
    "stages.warmup.config.train_batch_size=16",
    "stages.warmup.config.micro_train_batch_size=16",
    "stages.warmup.config.model.hidden_size=32",
    "stages.warmup.config.model.num_layers=1",
    "stages.warmup.config.model.num_heads=2",
    "stages.warmup.config.model.vocab_size=300",
    "stages.collect.config.limit=12",
    "stages.collect.config.num_repeats=2",
    "stages.filter.config.min_reward=0.0",
    "stages.rft.config.max_steps=2",
    "stages.rft.config.train_batch_size=8",
    "stages.rft.config.micro_train_batch_size=8",
]


def _pipe(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engine.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_quickstart_shrunk_end_to_end(tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["run", "pipelines/quickstart.yaml", "--run-dir", str(run_dir)]
    for item in SHRINK:
        args += ["--set", item]
    proc = _pipe(args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert {n: s["status"] for n, s in report["stages"].items()} == {
        "data": "succeeded",
        "warmup": "succeeded",
        "collect": "succeeded",
        "filter": "succeeded",
        "rft": "succeeded",
        "evaluate": "succeeded",
    }
    rollouts = [
        json.loads(line)
        for line in (run_dir / "collect" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert sorted((r["prompt_idx"], r["sample_idx"]) for r in rollouts) == [
        (p, s) for p in range(12) for s in range(2)
    ]
    evaluation = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert [r["checkpoint"] for r in evaluation["results"]] == ["warmup", "rft"]
    assert evaluation["baseline"] == "warmup"
    for result in evaluation["results"]:
        assert result["n"] == 24
        assert 0.0 <= result["accuracy"] <= 1.0
    assert (run_dir / "warmup" / "loss.png").exists()
    # the run ends with each stage's headline on stdout, evaluate's accuracy table last
    out = proc.stdout.splitlines()
    assert out[-4] == "evaluate:"
    assert out[-3].split() == ["checkpoint", "n", "accuracy", "pass@1", "mean_reward", "delta"]
    assert [line.split()[0] for line in out[-2:]] == ["warmup", "rft"]
    assert "dashboard" not in proc.stderr  # no tracker set: no dashboard, no bokeh import
    # the output is pipe's own: no progress bars of transformers from the workers
    for bar in ("Loading weights", "Writing model shards", "it/s]"):
        assert bar not in proc.stdout + proc.stderr
    assert (run_dir / "evaluate" / "report.md").exists()
    # a second run is all cache hits
    again = _pipe(args, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert {s["status"] for s in report["stages"].values()} == {"cached"}
