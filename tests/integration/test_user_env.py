"""A user's own environment class (`myenv:Guess`, a module in the pipeline's folder, on
PYTHONPATH as a user puts it) through every stage that plays episodes, with `pipe run`:
train warms a tiny model up, collect plays episodes with the `local` backend (no server),
rl trains GRPO on them for two steps, evaluate plays them locally and reports the
first-turn share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

MYENV = '''
class Guess:
    """1.0 for the row's answer; else "try again", up to max_turns."""

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, completion):
        if completion.strip() == self.answer:
            return 1.0, None, True
        return 0.0, [{"role": "user", "content": "try again"}], False
'''

PIPELINE = """\
name: user-env
cluster: {workers: 1}
stages:
  data:
    kind: dataset
    config:
      task: chain_sum
      task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}
      size: 64
      test_size: 8
  warmup:
    kind: train
    needs: [data]
    config:
      target: answer
      model: {hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}
      train_batch_size: 16
      micro_train_batch_size: 16
      max_steps: 4
  collect:
    kind: collect
    needs: [data, warmup]
    config:
      input: "@data"
      limit: 8
      num_repeats: 2
      max_output_tokens: 4
      backend: {kind: local, model: "@warmup"}
      environment: {kind: "myenv:Guess", max_turns: 2}
  rl:
    kind: rl
    needs: [data, warmup]
    config:
      input: "@data"
      model: "@warmup"
      output: final/checkpoint  # labelled rl in the report, not by its folder's name
      environment: {kind: "myenv:Guess", max_turns: 2}
      num_repeats: 4
      rollout_batch_size: 4
      train_batch_size: 16
      micro_train_batch_size: 8
      max_steps: 2
      max_output_tokens: 4
  evaluate:
    kind: evaluate
    needs: [data, warmup, rl]
    config:
      input: "@data.test_output"
      checkpoints: ["@warmup", "@rl"]
      max_output_tokens: 4
      environment: {kind: "myenv:Guess", max_turns: 2}
"""


def test_a_users_environment_in_collect_rl_and_evaluate(tmp_path: Path):
    (tmp_path / "myenv.py").write_text(textwrap.dedent(MYENV))
    (tmp_path / "p.yaml").write_text(PIPELINE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engine.cli", "run", "p.yaml", "--run-dir", "run"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    report = json.loads((run / "report.json").read_text())
    assert {s["status"] for s in report["stages"].values()} == {"succeeded"}
    episodes = [json.loads(x) for x in (run / "collect/rollouts.jsonl").read_text().splitlines()]
    assert [(e["prompt_idx"], e["sample_idx"]) for e in episodes] == [
        (i, s) for i in range(8) for s in range(2)
    ]
    for e in episodes:
        assert 1 <= e["turns"] <= 2 and len(e["messages"]) in (2, 4)
        assert e["messages"][1]["role"] == "assistant" and "error" not in e
        if e["turns"] == 2:
            assert e["messages"][2] == {"role": "user", "content": "try again"}
    assert any(e["turns"] == 2 for e in episodes)  # a wrong first answer got a second turn
    metrics = (run / "rl/metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics] == [1, 2]
    evaluation = json.loads((run / "evaluate/report.json").read_text())
    assert [r["checkpoint"] for r in evaluation["results"]] == ["warmup", "rl"]
    assert evaluation["checkpoints"] == {
        "warmup": str(run / "warmup/checkpoint"),
        "rl": str(run / "rl/final/checkpoint"),
    }
    for r in evaluation["results"]:
        assert 0.0 <= r["first_turn_accuracy"] <= r["accuracy"] <= 1.0
