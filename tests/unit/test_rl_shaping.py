"""A reward model's scores made rewards: the running moments against the whole history's
mean and sample deviation, the clip, the mix with the verifier's; and `score` in micro
batches against the model's own pooled logits."""

from __future__ import annotations

import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.rl.algo.shaping import RunningMoments, mix, shape
from stages.rl.settings.scoring import RewardWeights


def settings(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(
        **{"normalize_reward": False, "reward_clip": None, "reward_weights": None, **kw}
    )


def test_running_moments_batch_by_batch_equal_the_whole_historys():
    batches = [[1.0, 4.0, -2.0], [10.0], [0.5, 0.25, 3.0, 7.0]]
    moments = RunningMoments()
    seen: list[float] = []
    for batch in batches:
        moments.update(batch)
        seen += batch
        assert moments.mean == pytest.approx(statistics.fmean(seen))
        if len(seen) > 1:
            assert moments.std == pytest.approx(statistics.stdev(seen))
    assert RunningMoments(**moments.state()).std == pytest.approx(moments.std)


def test_normalised_then_clipped_then_mixed():
    moments = RunningMoments()
    cfg = settings(normalize_reward=True, reward_clip=1.0)
    shaped = shape([0.0, 2.0, 4.0, 100.0], moments, cfg)
    mean, std = statistics.fmean([0, 2, 4, 100]), statistics.stdev([0, 2, 4, 100])
    assert shaped == pytest.approx([(x - mean) / std for x in (0, 2, 4)] + [1.0])
    weights = RewardWeights(reward_model=2.0, verifier=0.5)
    assert mix(0.25, 1.0, settings(reward_weights=weights)) == pytest.approx(1.0)
    assert mix(0.25, 1.0, settings()) == 0.25  # no weights: the score alone
    assert shape([3.0, -7.0], RunningMoments(), settings()) == [3.0, -7.0]


def test_a_single_score_normalises_against_a_unit_deviation():
    moments = RunningMoments()
    assert shape([5.0], moments, settings(normalize_reward=True)) == [0.0]
    assert moments.std == 1.0


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
