"""A reward model's scores made rewards: normalised by the statistics its training stored,
the clip, the mix with the verifier's; and `score` in micro batches against the model's own
pooled logits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.rl.algo.shaping import mix, shape
from stages.rl.settings.scoring import RewardWeights


def settings(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(
        **{"normalize_reward": False, "reward_clip": None, "reward_weights": None, **kw}
    )


def test_normalised_by_the_models_statistics_then_clipped_then_mixed():
    cfg = settings(normalize_reward=True, reward_clip=1.0)
    # the same score is the same reward whatever else is in the batch
    assert shape([0.0, 2.0, 4.0, 100.0], (2.0, 4.0), cfg) == [-0.5, 0.0, 0.5, 1.0]
    assert shape([4.0], (2.0, 4.0), cfg) == [0.5]
    weights = RewardWeights(reward_model=2.0, verifier=0.5)
    assert mix(0.25, 1.0, settings(reward_weights=weights)) == pytest.approx(1.0)
    assert mix(0.25, 1.0, settings()) == 0.25  # no weights: the score alone
    assert shape([3.0, -7.0], None, settings()) == [3.0, -7.0]


def test_scores_in_micro_batches_equal_the_models_own_pooled_logits(tmp_path: Path):
    import torch

    from stages.lib.model.reward_model import head_problem, load_reward_model, score
    from tests.reward_models import build_policy, build_reward_model

    rm = build_reward_model(build_policy(tmp_path / "policy"), tmp_path / "rm")
    assert head_problem(str(rm)) is None
    assert "names no sequence-classification head" in (head_problem(str(tmp_path / "policy")) or "")
    model = load_reward_model(str(rm), False, "cpu")
    sequences = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    batched = score(model, sequences, 2, model.config.pad_token_id)
    alone = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]
    assert batched == pytest.approx(alone, abs=1e-5)


def test_dynamic_sampling_judges_on_the_verifier_only_where_it_is_in_the_reward():
    """A group the verifier marks all right, which the reward model tells apart: trained on
    the model's scores alone (the verifier only reports accuracy), it keeps its signal; with
    the verifier weighed in, DAPO's judge (the verifier's rewards agree) drops it."""
    from stages.rl import RLConfig
    from stages.rl.controller.batch import _score

    group = [
        SimpleNamespace(episode=SimpleNamespace(error=None, total=1.0), generated=3)
        for _ in range(4)
    ]
    scores = [0.1, 0.9, -0.4, 0.3]
    alone = RLConfig(input="x.jsonl", reward_model="rm", dynamic_sampling=True)
    assert alone.dynamic_sampling and alone.verifier is not None
    assert _score(alone, group, scores).trains(dynamic=True, every=False)
    weighed = RLConfig(
        input="x.jsonl",
        reward_model="rm",
        reward_weights={"reward_model": 1.0, "verifier": 0.5},
        dynamic_sampling=True,
    )
    assert not _score(weighed, group, scores).trains(dynamic=True, every=False)
    assert _score(weighed, group, scores).trains(dynamic=False, every=False)
