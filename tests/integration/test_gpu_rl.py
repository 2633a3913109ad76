"""On a machine with 2+ GPUs: GRPO with the engine on one GPU and the actor on another,
weights over NCCL, 5 steps; the probe checks every sync. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.integration, pytest.mark.slow]

PIPELINE = """\
    name: rl_gpu
    cluster: {{scheduler: local, workers: 1, gpus: 2, gpus_per_node: 2}}
    resources: {{ratio: {{vllm: 1, actor: 1}}, colocate: {colocate}}}
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
          vllm_sync_backend: {sync}
          num_repeats: 4
          rollout_batch_size: 16
          train_batch_size: 64
          micro_train_batch_size: 32
          max_steps: 5
          max_output_tokens: 6
          eval_every: 5
"""


@pytest.mark.parametrize(("colocate", "sync"), [("none", "nccl"), ("all", "gloo")])
def test_grpo_on_gpus(tmp_path: Path, colocate: str, sync: str):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE.format(colocate=colocate, sync=sync)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stage = tmp_path / "runs/rl_gpu/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["probe_diff"] <= 1e-4 for r in rows if r["updates"])
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["vllm_sync_backend"]["status"] == "applied"
    report = json.loads((tmp_path / "runs/rl_gpu/report.json").read_text())
    roles = {p["role"]: p["devices"] for p in report["stages"]["rl"]["placement"]}
    if colocate == "none":
        assert set(roles["vllm"]).isdisjoint(roles["actor"])
    else:
        assert roles["vllm"] == roles["actor"]


VLLM_PIPELINE = PIPELINE.replace(
    "          vllm_sync_backend: {sync}\n",
    "          vllm_sync_backend: nccl\n          backend: {{kind: vllm, vllm_enable_sleep: "
    "{sleep}}}\n",
).replace("num_heads: 2", "num_heads: 4")


def run_vllm_grpo(tmp_path: Path, text: str) -> str:
    """`pipe run` of `text` (5 GRPO steps on vLLM engines): every sync probed within 1e-4;
    what settings.json says of the backend. Skipped without vLLM's build (the reason its
    finder gives)."""
    from stages.lib.backends.vllm import server as vllm_server

    try:
        vllm_server.find_vllm_python()
    except RuntimeError as err:
        pytest.skip(str(err))
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
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
    stage = tmp_path / "runs/rl_gpu/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["probe_diff"] <= 1e-4 for r in rows if r["updates"])
    return str(json.loads((stage / "settings.json").read_text())["backend"]["how"])


@pytest.mark.vllm
@pytest.mark.parametrize(("colocate", "sleep"), [("none", "false"), ("all", "true")])
def test_grpo_with_vllm_engines_on_gpus_hybrid_and_not(tmp_path: Path, colocate: str, sleep: str):
    """vLLM servers on the engine's GPU (shared with the actor and asleep while it trains in
    the hybrid case); weights reloaded from disk and checked by the probe on every sync."""
    text = VLLM_PIPELINE.format(colocate=colocate, sleep=sleep)
    how = run_vllm_grpo(tmp_path, text)
    assert ("sleep while the actor trains" in how) == (sleep == "true")


@pytest.mark.vllm
def test_grpo_with_one_pipeline_parallel_vllm_engine_over_both_gpus(tmp_path: Path):
    """`vllm_pipeline_parallel_size: 2`: one engine whose two pipeline stages (a layer each)
    hold a GPU each, beside the actor on both; every weight sync reaches both stages' workers
    and the probe checks the engine's log-probs after each."""
    text = VLLM_PIPELINE.format(colocate="all", sleep="false").replace(
        "vllm_enable_sleep: false}", "vllm_enable_sleep: false, vllm_pipeline_parallel_size: 2}"
    )
    assert "vllm_pipeline_parallel_size: 2" in text
    how = run_vllm_grpo(tmp_path, text)
    assert "1 vLLM server(s) started" in how and "pipeline-parallel 2" in how
