"""pipelines/rm_quickstart.yaml end to end through `pipe run`, shrunk with --set: a reward
model trained on the warm-up's own rollout pairs, then GRPO on its scores alone (the verifier
only measuring accuracy), and evaluate scoring the warm-up and the GRPO policy with both.

Every stage runs for real on the CPU; only the sizes are small. A six-step warm-up answers
noise, which the task's verifier scores all wrong: the two collect stages here judge by a
regex (an answer with a digit is 'right') so that each prompt's samples differ and pair.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_quickstart import SHRINK as QUICKSTART_SHRINK
from tests.integration.test_quickstart import _pipe

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHRINK = [
    # the quickstart's data and warm-up, shrunk as its own test shrinks them
    *(s for s in QUICKSTART_SHRINK if s.startswith(("stages.data.", "stages.warmup."))),
    "stages.collect.config.limit=12",
    "stages.collect_heldout.config.limit=8",
    "stages.rm_base.config.max_steps=2",
    "stages.rm_base.config.train_batch_size=16",
    "stages.rm_base.config.micro_train_batch_size=16",
    "stages.rm_base.config.eval_steps=2",
    "stages.rm.config.max_steps=2",
    "stages.rm.config.train_batch_size=8",
    "stages.rm.config.micro_train_batch_size=8",
    "stages.rm.config.eval_steps=1",
    "stages.grpo.config.num_repeats=2",
    "stages.grpo.config.rollout_batch_size=4",
    "stages.grpo.config.train_batch_size=8",
    "stages.grpo.config.micro_train_batch_size=8",
    "stages.grpo.config.max_steps=2",
    "stages.grpo.config.eval_every=1",
    "stages.grpo.config.eval_limit=8",
    "stages.grpo.config.save_steps=2",
] + [
    f"stages.{stage}.config.verifier.{key}={value}"
    for stage in ("collect", "collect_heldout")
    for key, value in (("kind", "regex"), ("pattern", r"\d"))
]


def test_rm_then_grpo_on_the_reward_model_alone_shrunk_end_to_end(tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["run", "pipelines/rm_quickstart.yaml", "--run-dir", str(run_dir)]
    for item in SHRINK:
        args += ["--set", item]
    proc = _pipe(args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    stages = ["data", "warmup", "collect", "pairs", "collect_heldout", "pairs_heldout"]
    stages += ["rm_base", "rm"]
    assert {n: s["status"] for n, s in report["stages"].items()} == dict.fromkeys(
        [*stages, "grpo", "evaluate"], "succeeded"
    )
    # the reward model: its pairwise accuracy on the held-out prompts' pairs
    assert (run_dir / "pairs_heldout" / "filtered.jsonl").read_text().strip()
    rm = json.loads((run_dir / "rm" / "metrics.json").read_text())
    assert rm["algorithm"] == "rm" and 0.0 <= rm["eval_accuracy"] <= 1.0
    headline = next(line for line in proc.stdout.splitlines() if line.startswith("rm:"))
    assert f"held-out pairwise accuracy {rm['eval_accuracy']:.1%}" in headline
    # GRPO trained on its scores alone: the reward is the score, the verifier only reports
    grpo = run_dir / "grpo"
    rows = [json.loads(x) for x in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rm_score_mean"] is not None
        assert r["reward_mean"] == pytest.approx(r["rm_score_mean"])
        assert r["accuracy"] is not None and r["eval_accuracy"] is not None
    settings = json.loads((grpo / "settings.json").read_text())
    assert settings["reward_weights"]["how"] == "none: the reward is the model's score alone"
    assert "not in the reward" in settings["verifier"]["how"]
    assert (grpo / "rl.png").read_bytes()[:4] == b"\x89PNG"
    start = json.loads((grpo / "rl_result.json").read_text())["eval_accuracy_start"]
    assert f"held-out accuracy before training: {100 * start:.1f}%" in proc.stderr
    # evaluate: each checkpoint's accuracy beside the reward model's mean score
    evaluation = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert [r["checkpoint"] for r in evaluation["results"]] == ["warmup", "grpo"]
    for result in evaluation["results"]:
        assert result["n"] == 24 and 0.0 <= result["accuracy"] <= 1.0
        assert isinstance(result["reward_model_score"], float)
    out = proc.stdout.splitlines()
    assert "rm_score" in out[-3].split()
