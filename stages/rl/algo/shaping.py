"""A reward model's scores made into rewards: normalised, clipped, mixed with the verifier's.

Input: the raw scores of a rollout batch (`stages.lib.model.reward_model.score`, from the
reward role's ranks), the running moments kept across steps, and the stage's settings
(`normalize_reward`, `reward_clip`, `reward_weights`). Output: each sample's reward.

In order, as OpenRLHF applies its flags to a reward model's output: with `normalize_reward`
the running moments take in the batch's scores first (every score seen so far, by Chan et
al.'s parallel update: the `RunningMoments` of OpenRLHF and TRL), then each score becomes
`(score - mean) / std` (the sample standard deviation; 1 while it is 0); `reward_clip` c
clips to [-c, c]; then `reward_weights` mix: `w_model * shaped + w_verifier * verifier's`.
Without `reward_weights` the reward is the shaped score alone, and the verifier is out of the
loop (`verifier_weighs`: it then only reports accuracy, and dynamic sampling judges groups on
the model's scores).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class RunningMoments:
    """Mean and variance of every value seen so far, updated a batch at a time."""

    mean: float = 0.0
    var: float = 0.0  # the population variance of the values seen
    count: int = 0

    def update(self, values: Sequence[float]) -> None:
        n = len(values)
        if not n:
            return
        mean = sum(values) / n
        var = sum((v - mean) ** 2 for v in values) / n
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        """The sample standard deviation (1.0 while it is 0: one value, or all equal)."""
        if self.count < 2:
            return 1.0
        std = math.sqrt(self.var * self.count / (self.count - 1))
        return std if std > 0 else 1.0

    def state(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}


def shape(scores: Sequence[float], moments: RunningMoments, cfg: Any) -> list[float]:
    """The scores normalised by the running moments (updated with them first) when
    `normalize_reward`, then clipped to [-reward_clip, reward_clip] when set."""
    out = list(scores)
    if cfg.normalize_reward:
        moments.update(out)
        out = [(s - moments.mean) / moments.std for s in out]
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
