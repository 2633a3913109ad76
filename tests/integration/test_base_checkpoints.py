"""A base model as users bring one (issue 46): a GGUF file with no chat template, trained with
the stage's `chat_template:`, whose output checkpoint carries that template, then evaluated
beside the file it started from. The file is a tiny Llama written with `gguf`'s writer
(`tests.gguf_files`); the stages run as the engine calls them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.lib.chat.template import TEMPLATES
from stages.train.run import run_train
from tests.gguf_files import write_tiny_gguf
from tests.integration.test_train import additions, config, context

pytest.importorskip("torch")
pytest.importorskip("gguf")
pytestmark = pytest.mark.integration


def test_a_family_template_a_stage_trained_with_is_written_into_its_checkpoint(tmp_path: Path):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "base.gguf")
    stage = tmp_path / "train"
    cfg = config(
        additions(tmp_path / "data.jsonl", 8),
        stage,
        model=str(tmp_path / "base.gguf"),
        chat_template="chatml",
        max_steps=1,
        train_batch_size=8,
        micro_train_batch_size=8,
        trainer="torch",
    )
    metrics = run_train(cfg, context(stage))
    assert metrics["steps"] == 1
    out = stage / "checkpoint"
    chatml = (TEMPLATES / "chatml.jinja").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == chatml
    assert AutoTokenizer.from_pretrained(out).chat_template == chatml
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"  # computed in
    converted = list((tmp_path / ".pipe-models").glob("gguf-*-float32"))
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()


def test_plain_trains_and_evaluates_the_gguf_and_its_fine_tune_alike(tmp_path: Path):
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import evaluate_checkpoints
    from stages.lib.backends.local import LocalBackend

    write_tiny_gguf(tmp_path / "base.gguf")
    plain = {"chat_template": "plain", "prompt_template": "Q: {prompt}\nA:"}
    stage = tmp_path / "train"
    cfg = config(
        additions(tmp_path / "data.jsonl", 8),
        stage,
        model=str(tmp_path / "base.gguf"),
        max_steps=1,
        train_batch_size=8,
        micro_train_batch_size=8,
        trainer="torch",
        **plain,
    )
    run_train(cfg, context(stage))
    (tmp_path / "evaluate").mkdir()
    evaluate = EvaluateConfig(
        output=str(tmp_path / "evaluate" / "report.json"),
        max_output_tokens=3,
        backend=LocalBackend(kind="local", batch_size=4),
        **plain,
    )
    rows = [{"prompt": "1 + 2 =", "answer": "3"}, {"prompt": "2 + 2 =", "answer": "4"}]
    paths = [str(tmp_path / "base.gguf"), str(stage / "checkpoint")]
    metrics = evaluate_checkpoints(
        evaluate, paths, None, rows, lambda row, text: 0.0, str(tmp_path)
    )
    assert [r["n"] for r in metrics["results"]] == [2, 2]
    assert list(metrics["checkpoints"].values()) == paths  # as configured, not the folders
    assert metrics["precision"]["dtype"] == "float32"


RL = """\
name: rl
cluster: {workers: 1}
stages:
  data:
    kind: dataset
    config:
      task: chain_sum
      task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}
      size: 32
      test_size: 8
  rl:
    kind: rl
    needs: [data]
    config:
      input: "@data"
      model: base.gguf
      chat_template: plain
      prompt_template: "Q: {prompt}\\nA:"
      verifier: {kind: regex, pattern: "[0-9]"}
      num_repeats: 4
      rollout_batch_size: 4
      train_batch_size: 16
      micro_train_batch_size: 8
      max_steps: 2
      max_output_tokens: 4
      eval_every: 2
"""


@pytest.mark.slow
def test_rl_from_a_gguf_base_model_syncs_and_saves_its_template(tmp_path: Path):
    import os
    import subprocess
    import sys

    from stages.lib.chat.template import template_text
    from tests.conftest import ROOT

    write_tiny_gguf(tmp_path / "base.gguf")
    (tmp_path / "p.yaml").write_text(RL)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    config = json.loads((stage / "checkpoint" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template_text("plain", "Q: {prompt}\nA:")
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["chat_template"]["status"] == "applied"
