"""On a machine with one CUDA GPU, the setups most users start from: the whole rl stage on
one device (the local engine and the actor colocated, the high-performance profile), in fp32
at ZeRO-0 and in bf16 at ZeRO-3, and the train stage in bf16 at ZeRO-3 with its held-out
evaluation, followed by an evaluate stage on the same GPU. Skipped without CUDA.

These are the runs that found, on the first H100 run, a colocated stage asking its worker
for GPU=2 (it never started), NCCL refusing the engine and actor rank 0 on one device, and
bf16 weights broadcast into an fp32 engine (NaN probabilities at the first sampling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import pipe_run

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

RL = """\
    name: gpu1
    cluster: {{scheduler: local, workers: 1, gpus: 1, gpus_per_node: 1}}
    profile: high-performance
    resources: {{ratio: {{vllm: 1, actor: 1}}, colocate: all}}
    stages:
      data:
        kind: dataset
        config: {{task: chain_sum, size: 128, test_size: 32}}
      rl:
        kind: rl
        needs: [data]
        config:
          input: "@data"
          eval_input: "@data.test_output"
          model: {{hidden_size: 128, num_layers: 2, num_heads: 2, vocab_size: 512}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          bf16: {bf16}
          zero_stage: {zero}
          num_repeats: 4
          rollout_batch_size: 16
          train_batch_size: 64
          micro_train_batch_size: 32
          max_steps: 5
          max_output_tokens: 6
          eval_every: 5
"""

TRAIN = """\
    name: gpu1
    cluster: {scheduler: local, workers: 1, gpus: 1, gpus_per_node: 1}
    stages:
      data:
        kind: dataset
        config: {task: chain_sum, size: 256, test_size: 32}
      sft:
        kind: train
        needs: [data]
        resources: {gpus: 1}
        config:
          target: answer
          model: {hidden_size: 128, num_layers: 2, num_heads: 2, vocab_size: 512}
          bf16: true
          zero_stage: 3
          train_batch_size: 32
          micro_train_batch_size: 16
          max_steps: 10
          eval_input: "@data.test_output"
          eval_steps: 5
      evaluate:
        kind: evaluate
        needs: [data, sft]
        resources: {gpus: 1}
        config: {input: "@data.test_output", checkpoints: ["@sft"], max_output_tokens: 8}
"""


@pytest.mark.parametrize(("bf16", "zero"), [("false", 0), ("true", 3)])
def test_one_gpu_colocated_high_performance_grpo(tmp_path: Path, bf16: str, zero: int):
    proc = pipe_run(tmp_path, RL.format(bf16=bf16, zero=zero))
    assert proc.returncode == 0, proc.stderr[-4000:]
    stage = tmp_path / "runs/gpu1/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    tolerance = 5e-2 if bf16 == "true" else 1e-4
    assert all(r["probe_diff"] <= tolerance for r in rows if r["updates"]), rows
    settings = json.loads((stage / "settings.json").read_text())
    sync = settings["vllm_sync_backend"]
    # the profile asks for nccl; the engine and actor rank 0 share the GPU, which NCCL refuses
    assert "gloo" in json.dumps(sync), sync
    assert settings["deepspeed_enable_sleep"]["status"] == "applied", settings
    report = json.loads((tmp_path / "runs/gpu1/report.json").read_text())
    roles = {p["role"]: p["devices"] for p in report["stages"]["rl"]["placement"]}
    assert roles["vllm"] == roles["actor"] == [0]


def test_one_gpu_train_bf16_zero3_held_out_then_evaluate(tmp_path: Path):
    proc = pipe_run(tmp_path, TRAIN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "runs/gpu1/sft/train_result.json").read_text())
    assert result["step"] == 10, result
    rows = [json.loads(x) for x in (tmp_path / "runs/gpu1/sft/loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("eval_accuracy") is not None] == [5, 10], rows
    metrics = json.loads((tmp_path / "runs/gpu1/evaluate/metrics.json").read_text())
    assert [r["n"] for r in metrics["results"]] == [32], metrics
