"""A reward model's scores made into rewards: normalised, clipped, mixed with the verifier's.

Input: the raw scores of a rollout batch (`stages.lib.model.reward_model.score`, from the
reward role's ranks), the reward model's statistics (the mean and standard deviation its
training stored in its config.json: `stages.lib.model.reward_model.saved_stats`), and the
stage's settings (`normalize_reward`, `reward_clip`, `reward_weights`). Output: each
sample's reward.

In order, as OpenRLHF applies its flags to a reward model's output: with `normalize_reward`
each score becomes `(score - mean) / std` by the fixed statistics of the reward model (as
OpenRLHF's reward model divides by the `mean` and `std` its training set in its config: the
same score is the same reward at every step); `reward_clip` c clips to [-c, c]; then
`reward_weights` mix: `w_model * shaped + w_verifier * verifier's`. Without `reward_weights`
the reward is the shaped score alone, and the verifier is out of the loop (`verifier_weighs`:
it then only reports accuracy, and dynamic sampling judges groups on the model's scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def shape(scores: Sequence[float], stats: tuple[float, float] | None, cfg: Any) -> list[float]:
    """The scores normalised by the reward model's (mean, std) `stats` when
    `normalize_reward` (the reward role refuses a model without them), then clipped to
    [-reward_clip, reward_clip] when set."""
    out = list(scores)
    if cfg.normalize_reward:
        assert stats is not None, "normalize_reward without the reward model's statistics"
        mean, std = stats
        out = [(s - mean) / std for s in out]
    if cfg.reward_clip is not None:
        out = [min(max(s, -cfg.reward_clip), cfg.reward_clip) for s in out]
    return out


def mix(shaped: float, verified: float, cfg: Any) -> float:
    """A sample's reward: the shaped score alone, or the `reward_weights` mix with the
    verifier's reward."""
    weights = cfg.reward_weights
    if weights is None:
        return shaped
    return float(weights.reward_model * shaped + weights.verifier * verified)


def verifier_weighs(cfg: Any) -> bool:
    """Whether the verifier's reward is in the reward trained on: always without a reward
    model; with one, only by a nonzero `reward_weights.verifier`."""
    if cfg.reward_model is None:
        return True
    weights = cfg.reward_weights
    return weights is not None and weights.verifier != 0
