"""`deepcompile: true` on one CUDA GPU (skipped without it): the train stage's DeepSpeed engine
compiled with DeepCompile's ZeRO-1 pass (ds_config `compile: {deepcompile: true}`, then
`engine.compile()`), side by side with the same run uncompiled: both finish, and the
compiled run's losses are the uncompiled run's within bf16's rounding. Run by
`make gpu-check` (`-m gpu`); on the CPU the setting is refused at plan
(tests/unit/test_deepcompile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import pipe_run

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

TRAIN = """\
    name: dc
    cluster: {{scheduler: local, workers: 1, gpus: 1, gpus_per_node: 1}}
    stages:
      data:
        kind: dataset
        config: {{task: chain_sum, size: 256, test_size: 32}}
      sft:
        kind: train
        needs: [data]
        resources: {{gpus: 1}}
        config:
          target: answer
          model: {{hidden_size: 128, num_layers: 2, num_heads: 2, vocab_size: 512}}
          bf16: true
          zero_stage: 1
          deepcompile: {deepcompile}
          train_batch_size: 32
          micro_train_batch_size: 16
          max_steps: 10
"""


def losses(folder: Path) -> list[float]:
    rows = [json.loads(x) for x in (folder / "runs/dc/sft/loss.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_deepcompile_trains_as_the_uncompiled_engine(tmp_path: Path):
    runs = {}
    for flag in ("false", "true"):
        folder = tmp_path / flag
        folder.mkdir()
        proc = pipe_run(folder, TRAIN.format(deepcompile=flag))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[flag] = losses(folder)
    ds = json.loads((tmp_path / "true/runs/dc/sft/ds_config.json").read_text())
    assert ds["compile"] == {"deepcompile": True}
    assert len(runs["true"]) == len(runs["false"]) == 10
    assert runs["true"] == pytest.approx(runs["false"], rel=5e-2)
