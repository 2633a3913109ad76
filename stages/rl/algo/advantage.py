"""Advantage estimators of algorithm grpo (`advantage`), and DAPO's overlong reward shaping.

Input: each prompt's group of rewards (one per sample); for REINFORCE++ the batch's
samples with their behaviour and reference log-probabilities. Output: per sample its
advantage and whether its group carries a signal, or (REINFORCE++) per token.

- grpo (Shao et al., 2024, DeepSeekMath eq. 3): `(r_i - mean(r)) / std(r)` in the group,
  `std` the sample one (n - 1), as verl's and TRL's.
- dr_grpo (Liu et al., 2025, "Understanding R1-Zero-like training", eq. 4): `r_i - mean(r)`,
  no std division (which up-weights groups that are nearly all right or all wrong); its
  other change, no per-sequence length normalisation, is our `loss_agg: token_mean`.
- rloo (Ahmadian et al., 2024, "Back to basics", eq. 6; Kool et al., 2019): each sample's
  baseline is the mean of the other k - 1 rewards, `r_i - 1/(k-1) sum_{j != i} r_j`,
  which equals `k/(k-1) (r_i - mean(r))`.
- reinforce_pp (Hu et al., 2025, "REINFORCE++", eqs. 5-8): per-token reward
  `-kl_coef * (log pi_old - log pi_ref)` (k1) plus the verifier's reward at the last token,
  the return the sum of the rewards from each token on (gamma 1), normalised over every
  loss token of the batch: `(G - mean) / std`. No groups: a group whose rewards all agree
  still gets advantages (their sign from the batch's mean), unless dynamic sampling drops it.
  The KL is in the reward, so it is not also in the loss (as OpenRLHF's default).

A group carries a signal when its rewards are not all equal (std > 1e-6); the batch drops
groups without one for grpo, dr_grpo and rloo (their advantages are all 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from stages.rl.algo.loss import group_advantages
from stages.rl.algo.ppo import batch_reference, token_rewards, whiten


def group_estimate(
    rewards: Sequence[float], kind: str, std_normalize: bool
) -> tuple[list[float], bool]:
    """One group's advantages under estimator `kind` and whether it carries a signal
    (reinforce_pp: zeros here, its advantages come from `reinforce_pp_samples`)."""
    r = torch.tensor([list(rewards)], dtype=torch.float64)
    adv, keep = group_advantages(r, std_normalize and kind == "grpo")
    signal = bool(keep[0]) and len(rewards) > 1
    if kind == "rloo":
        k = len(rewards)
        adv = adv * (k / (k - 1)) if k > 1 else adv * 0.0
    if kind == "reinforce_pp":
        return [0.0] * len(rewards), signal
    return adv[0].tolist(), signal


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), times `factor`: 0 up to
    `max_tokens - buffer` tokens, then falling linearly to `-factor` at `max_tokens` (an
    answer cannot be longer: generation stops there)."""
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    return -factor * min(length - free, buffer) / buffer


def reinforce_pp_returns(
    rewards: Sequence[float],
    old: Sequence[Sequence[float]],
    ref: Sequence[Sequence[float]] | None,
    masks: Sequence[Sequence[float]],
    kl_coef: float,
    teacher: Sequence[Sequence[float]] | None = None,
    distill_coef: float = 0.0,
) -> list[list[float]]:
    """Per sample, each token's return: the sum from that token on of `-kl_coef * (old -
    ref)` and, with a teacher, `-distill_coef * (old - teacher)` (on loss tokens) plus the
    final reward at the last token; then normalised over every loss token of the batch
    (mean 0, std 1). Observation tokens get 0."""
    returns: list[list[float]] = []
    for i, final in enumerate(rewards):
        mask = masks[i]
        per = token_rewards(
            final,
            len(mask),
            old[i],
            None if ref is None else ref[i],
            kl_coef,
            mask,
            None if teacher is None else teacher[i],
            distill_coef,
        )
        acc, out = 0.0, [0.0] * len(per)
        for t in reversed(range(len(per))):
            acc += per[t]
            out[t] = acc
        returns.append(out)
    return whiten(returns, masks)


def reinforce_pp_samples(c: Any, samples: list[Any]) -> list[Any]:
    """The batch with REINFORCE++'s per-token advantages (the reference's log-probabilities
    as PPO gets them, `stages.rl.algo.ppo.batch_reference`; the teacher's, with one, as the
    samples carry them)."""
    from stages.rl.algo.distill import distill_coef

    coef = distill_coef(c.cfg)
    adv = reinforce_pp_returns(
        [s.reward for s in samples],
        [s.old_logprobs for s in samples],
        batch_reference(c, samples),
        [s.loss_mask() for s in samples],
        c.cfg.kl_coef,
        [s.teacher_logprobs for s in samples] if coef > 0 else None,
        coef,
    )
    return [replace(s, advantages=tuple(a)) for s, a in zip(samples, adv, strict=True)]
