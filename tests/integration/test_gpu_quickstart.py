"""On a machine with CUDA: the quickstart shrunk, its training on two GPUs (one NCCL job) and
its rollouts from the vLLM backend on a third device, each stage on the devices the
placement gives it. Skipped where fewer than 3 GPUs are visible or vLLM is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu(count=3), pytest.mark.integration, pytest.mark.slow]

PIPELINE = """\
    name: gpu_quickstart
    cluster: {scheduler: local, workers: 1, gpus: 3, gpus_per_node: 3}
    resources: {ratio: {vllm: 1, actor: 2}}
    stages:
      data:
        kind: dataset
        config:
          task: chain_sum
          task_config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}
          size: 256
          test_size: 32
      warmup:
        kind: train
        needs: [data]
        resources: {role: actor}
        config:
          target: answer
          model: {hidden_size: 128, num_layers: 2, num_heads: 2, vocab_size: 512}
          train_batch_size: 32
          micro_train_batch_size: 16
          max_steps: 20
          learning_rate: 0.003
      collect:
        kind: collect
        needs: [data, warmup]
        resources: {role: vllm}
        config:
          input: "@data"
          limit: 32
          num_repeats: 2
          max_output_tokens: 8
          backend: {kind: vllm, model: "@warmup", vllm_gpu_memory_utilization: 0.3}
      rft:
        kind: train
        needs: [collect, warmup]
        resources: {role: actor}
        config: {model: "@warmup", train_batch_size: 32, micro_train_batch_size: 16, max_steps: 4}
      evaluate:
        kind: evaluate
        needs: [data, warmup, rft]
        resources: {gpus: 1}
        config: {input: "@data.test_output", checkpoints: ["@warmup", "@rft"], max_output_tokens: 8}
"""


def test_quickstart_on_three_gpus(tmp_path: Path):
    pytest.importorskip("torch")
    from stages.lib.backends.vllm.server import find_vllm_python

    try:
        find_vllm_python()
    except Exception as exc:
        pytest.skip(f"no vLLM interpreter: {exc}")
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "runs/gpu_quickstart/report.json").read_text())
    stages = report["stages"]
    assert {s["status"] for s in stages.values()} == {"succeeded"}
    train_devices = {d for p in stages["warmup"]["placement"] for d in p["devices"]}
    vllm_devices = {d for p in stages["collect"]["placement"] for d in p["devices"]}
    assert len(train_devices) == 2 and len(vllm_devices) == 1
    assert not train_devices & vllm_devices
    assert stages["warmup"]["metrics"]["device"] == "cuda"
    assert stages["warmup"]["metrics"]["world_size"] == 2
    ranks = tmp_path / "runs/gpu_quickstart/warmup/ranks"
    given = sorted(json.loads(p.read_text())["cuda_visible_devices"] for p in ranks.glob("*.json"))
    assert given == [",".join(map(str, sorted(train_devices)))] * 2
