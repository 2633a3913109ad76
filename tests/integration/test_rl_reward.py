"""The rl stage with a reward model for real: the reward role's ranks score every sample
(a tiny scalar-head Llama on the policy's tokenizer), and the rewards trained on are those
scores, checked by scoring the logged samples again here; mixed with the verifier's,
normalised by the statistics in the reward model's config and clipped; under GRPO and PPO
(asynchronous steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.reward_models import PROMPTS, build_policy, build_reward_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STATS = {"mean": 2.0, "std": 1.0}  # what normalize_reward divides by
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
PIPELINE = """\
    name: rm
    cluster: {{workers: 1}}
    stages:
      rl:
        kind: rl
        config:
          input: data.jsonl
          model: policy
          reward_model: rm
          num_repeats: 4
          rollout_batch_size: 4
          train_batch_size: 16
          micro_train_batch_size: 8
          learning_rate: 0.001
          max_steps: 2
          max_output_tokens: 4
          log_samples_every: 1
          save_steps: 2
    {extra}
"""


def rl_run(
    tmp_path: Path, extra: str, stats: dict[str, float] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the pipeline with `extra` config lines (the reward model holding `stats`); its
    metrics and logged samples."""
    policy = build_policy(tmp_path / "policy")
    build_reward_model(policy, tmp_path / "rm", stats=stats)
    rows = [{"prompt": p, "answer": str(sum(map(int, p[:-1].split("+"))))} for p in PROMPTS]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = textwrap.indent(textwrap.dedent(extra), " " * 6)
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE).format(extra=extra))
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rm/rl"
    read = lambda name: [json.loads(x) for x in (stage / name).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read("samples.jsonl")


def rescored(tmp_path: Path, samples: list[dict[str, Any]]) -> list[float]:
    """The logged samples scored again, here, by the same reward model, each answer closed
    as the reward role closes it (a cut one with the template's closing token)."""
    from transformers import AutoTokenizer

    from stages.lib.chat.tokens import answer_end, eos_ids
    from stages.lib.model.reward_model import closed, load_reward_model, score

    model = load_reward_model(str(tmp_path / "rm"), False, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    end, stops = answer_end(tokenizer).ids, eos_ids(tokenizer)
    sequences = [closed(s["prompt_ids"] + s["completion_ids"], end, stops) for s in samples]
    return score(model, sequences, 3, model.config.pad_token_id)


def test_grpo_trains_on_the_reward_models_scores_alone(tmp_path: Path):
    rows, samples = rl_run(tmp_path, "verifier: null")
    assert [r["step"] for r in rows] == [1, 2]
    assert samples and {s["step"] for s in samples} == {1, 2}
    rewards = [s["reward"] for s in samples]
    assert rewards == pytest.approx(rescored(tmp_path, samples), abs=1e-4)
    assert len(set(rewards)) > 1  # the random head tells answers apart
    assert all(r["accuracy"] is None and r["rm_score_mean"] is not None for r in rows)
    assert all(r["reward_mean"] == pytest.approx(r["rm_score_mean"]) for r in rows)
    assert any(r["updates"] for r in rows)
    stage = tmp_path / "runs/rm/rl"
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["reward_model"]["status"] == "applied"
    assert settings["verifier"]["status"] == "skipped"
    log = (stage / "reward_log.txt").read_text()
    assert "reward model on node" in log and "rank 0 of 1, reward model, torch.float32" in log
    assert json.loads((stage / "rl_result.json").read_text())["ranks"]["reward"]


def test_ppo_mixes_normalised_clipped_scores_with_the_verifiers_rewards(tmp_path: Path):
    clip, weight = 0.5, 0.25
    rows, samples = rl_run(
        tmp_path,
        f"""\
        algorithm: ppo
        async_train: true
        verifier: {{kind: regex, pattern: "[0-9]"}}
        reward_weights: {{reward_model: 1.0, verifier: {weight}}}
        normalize_reward: true
        reward_clip: {clip}
        """,
        STATS,
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["value_loss"] is not None for r in rows if r["updates"])
    # every step: the reward model's own statistics, as its training stored them
    mean, std = STATS["mean"], STATS["std"]
    every = rescored(tmp_path, samples)
    for sample, raw in zip(samples, every, strict=True):
        shaped = min(max((raw - mean) / std, -clip), clip)
        verified = 1.0 if any(ch.isdigit() for ch in sample["completion"]) else 0.0
        assert sample["reward"] == pytest.approx(shaped + weight * verified, abs=1e-4)
    # the clip acts: every score's share of a reward is within it, some at its bound
    shares = [
        s["reward"] - weight * (1.0 if any(ch.isdigit() for ch in s["completion"]) else 0.0)
        for s in samples
    ]
    assert all(abs(x) <= clip + 1e-6 for x in shares)
    assert max(abs(x - mean) / std for x in every) > clip  # the normalised scores pass it
