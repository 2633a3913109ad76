"""A resumed rl run goes on as the uninterrupted run on the same seed does (issue 56 point 7):
in bf16, the steps after the resume sample the same answers, get the same rewards, and show
the same engine-against-actor differences and the same exact probe, with the same threads and
dtype, as the run that was never stopped."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SAME = ("prompts", "reward_mean", "logprob_diff_mean", "logprob_diff_max", "probe_diff", "loss")


class Interrupted(Exception):
    """The run stopped after a step's row, as a kill would stop it."""


def run(stage: Path, data: str, monkeypatch: pytest.MonkeyPatch, stop_after: int = 0) -> None:
    from engine.stage import StageContext
    from stages.rl import RLConfig
    from stages.rl.controller import loop
    from stages.rl.run import run_rl

    write = getattr(loop.append_metrics, "original", loop.append_metrics)

    def append(path: str, row: dict[str, Any]) -> None:
        write(path, row)
        if row["step"] == stop_after:
            raise Interrupted(f"stopped after step {stop_after}")

    append.original = write  # type: ignore[attr-defined]
    monkeypatch.setattr(loop, "append_metrics", append)
    cfg = RLConfig.model_validate(
        {
            "input": data,
            "output": str(stage / "checkpoint"),
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300},
            "verifier": {"kind": "regex", "pattern": "[0-9]"},
            "bf16": True,
            "num_threads": 1,
            "num_repeats": 4,
            "rollout_batch_size": 8,
            "micro_train_batch_size": 8,
            "train_batch_size": 32,
            "learning_rate": 0.01,
            "max_steps": 4,
            "save_steps": 2,
            "max_output_tokens": 4,
        },
        strict=False,
    )
    log = logging.getLogger("test.rl")
    ctx = StageContext("rl", "rl", str(stage), str(stage.parent), str(stage.parent), log=log)
    run_rl(cfg, ctx)


def rows(stage: Path) -> dict[int, dict[str, Any]]:
    lines = (stage / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_a_resumed_bf16_run_goes_on_as_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    data = DatasetConfig(task="chain_sum", size=32, output=str(tmp_path / "train.jsonl"))
    run_dataset(data, StageContext("data", "dataset", str(tmp_path), str(tmp_path), str(tmp_path)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for stage in (straight, resumed):
        stage.mkdir()
    run(straight, data.output, monkeypatch)
    with pytest.raises(Interrupted):
        run(resumed, data.output, monkeypatch, stop_after=3)  # saved at step 2, then killed
    run(resumed, data.output, monkeypatch)  # resumes from step 2: steps 3 and 4 again
    a, b = rows(straight), rows(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in SAME:
            assert a[step].get(key) == b[step].get(key), (step, key, a[step], b[step])
    assert b[4]["probe_diff"] == 0.0  # the engine computes the actor's function, bf16 too
    assert a[4].get("threads") == b[4].get("threads")
