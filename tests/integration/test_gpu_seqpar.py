"""`ring_attn_size: 2` on two CUDA GPUs (skipped with fewer): the train stage's ranks split
every row between them over NCCL (`stages.lib.distributed.seqpar`), and train as one GPU does
on the whole rows: the same batch plan (one data-parallel group), the same losses within
fp32 kernels' rounding (SDPA and GEMMs pick their kernels by shape, and a rank's share is
half the rows' width), at ZeRO-3 with gradient checkpointing (its recomputed attention
exchanges in the backward). Run by `make gpu-check` (`-m gpu`); on the CPU the same
equivalence, over gloo, is tests/unit/test_seqpar.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import pipe_run

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.integration, pytest.mark.slow]

TRAIN = """\
    name: sp
    cluster: {{scheduler: local, workers: 1, gpus: {gpus}, gpus_per_node: {gpus}}}
    stages:
      data:
        kind: dataset
        config: {{task: chain_sum, size: 256, test_size: 32}}
      sft:
        kind: train
        needs: [data]
        resources: {{gpus: {gpus}}}
        config:
          model: {{hidden_size: 128, num_layers: 2, num_heads: 4, vocab_size: 512}}
          target: answer
          packing_samples: false
          gradient_checkpointing: true
          zero_stage: 3
          ring_attn_size: {ring}
          train_batch_size: 32
          micro_train_batch_size: 16
          max_steps: 10
"""


def losses(folder: Path) -> list[float]:
    rows = [json.loads(x) for x in (folder / "runs/sp/sft/loss.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_two_gpus_splitting_each_row_train_as_one_gpu(tmp_path: Path):
    runs = {}
    for gpus, ring in ((1, 1), (2, 2)):
        folder = tmp_path / f"ring{ring}"
        folder.mkdir()
        proc = pipe_run(folder, TRAIN.format(gpus=gpus, ring=ring))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[ring] = losses(folder)
    log = (tmp_path / "ring2/runs/sp/sft/log.txt").read_text()
    assert "each sequence split over 2 ranks (Ulysses attention)" in log
    assert len(runs[1]) == len(runs[2]) == 10
    assert runs[2] == pytest.approx(runs[1], rel=1e-3)
