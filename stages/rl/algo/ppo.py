"""PPO's pieces: per-token rewards with a KL penalty, GAE on the critic's values, the
clipped value loss.

Input: per sample, the completion's per-token values (the critic's), the final reward,
and optionally the per-token log-probabilities of the behaviour policy and the reference.
Output: per-token advantages and returns (GAE with `gamma` and `lambd`), advantages
whitened over the batch, and the critic's clipped value loss.

- The reward of a token is `-kl_coef * (old - ref)` (the KL penalty, when there is a
  reference) plus `-distill_coef * (old - teacher)` (on-policy distillation, when there is
  a teacher: `stages.rl.algo.distill`), and the last token also gets the verifier's reward.
- GAE: `delta_t = r_t + gamma * V_{t+1} - V_t` (V after the last token is 0),
  `A_t = delta_t + gamma * lambd * A_{t+1}`, returns `A_t + V_t`.
- Value loss: `0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)` per token,
  summed and divided by the global batch's token count, like the policy loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def token_rewards(
    final: float,
    length: int,
    old: Sequence[float] | None,
    ref: Sequence[float] | None,
    kl_coef: float,
    mask: Sequence[float] | None = None,
    teacher: Sequence[float] | None = None,
    distill_coef: float = 0.0,
) -> list[float]:
    """Per-token rewards of one completion: `-kl_coef * (old - ref)` at each token (times
    `mask`, where given: REINFORCE++ puts no KL on observation tokens), plus, with a teacher,
    its reverse KL `-distill_coef * (old - teacher)` there too, and the final reward at the
    last token. PPO's GAE and REINFORCE++'s returns both start from it."""
    from stages.rl.algo.distill import distill_terms

    rewards = [0.0] * length
    weights = [1.0] * length if mask is None else mask
    if kl_coef > 0 and old is not None and ref is not None:
        rewards = [-kl_coef * (o - r) * w for o, r, w in zip(old, ref, weights, strict=True)]
    if distill_coef > 0 and old is not None and teacher is not None:
        terms = distill_terms(old, teacher, weights, distill_coef)
        rewards = [r + d for r, d in zip(rewards, terms, strict=True)]
    rewards[-1] += final
    return rewards


def gae(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lambd: float
) -> tuple[list[float], list[float]]:
    """Advantages and returns of one completion."""
    advantages = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * following - values[t]
        last = delta + gamma * lambd * last
        advantages[t] = last
    returns = [a + v for a, v in zip(advantages, values, strict=True)]
    return advantages, returns


def whiten(
    advantages: list[list[float]], masks: Sequence[Sequence[float]] | None = None
) -> list[list[float]]:
    """Advantages over the whole batch shifted to mean 0 and scaled to std 1; with `masks`,
    the statistics over the tokens they cover (1), the others set to 0."""
    covered = masks or [[1.0] * len(seq) for seq in advantages]
    pairs = list(zip(advantages, covered, strict=True))
    flat = torch.tensor(
        [a for seq, m in pairs for a, keep in zip(seq, m, strict=True) if keep],
        dtype=torch.float64,
    )
    if flat.numel() < 2:
        return advantages
    mean, std = flat.mean().item(), flat.std(unbiased=False).item()
    return [
        [(a - mean) / (std + 1e-8) if keep else 0.0 for a, keep in zip(seq, m, strict=True)]
        for seq, m in pairs
    ]


def batch_reference(c: Any, samples: list[Any]) -> list[Any] | None:
    """The reference's log-probabilities of each sample's completion when kl_coef > 0: sent
    with the samples (the ref role's own ranks scored them) or asked of the actor's ranks."""
    from dataclasses import asdict

    if c.cfg.kl_coef <= 0:
        return None
    if all(s.ref_logprobs for s in samples):
        return [s.ref_logprobs for s in samples]
    return list(c.request("ref_logprobs", {"samples": [asdict(s) for s in samples]}))


def value_loss(
    values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, eps_clip: float
) -> torch.Tensor:
    """Per-token clipped value loss."""
    clipped = old + torch.clamp(values - old, -eps_clip, eps_clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def ppo_samples(c: Any, samples: list[Any]) -> list[Any]:
    """The batch with PPO's per-token advantages (whitened), returns and old values: the
    critic's values, the verifier's reward at the last token, the KL to the reference in
    every token's reward when kl_coef > 0 (the reference's log-probabilities come with the
    samples when the ref role has ranks of its own, else from the actor's ranks)."""
    from dataclasses import asdict, replace

    from stages.rl.algo.distill import distill_coef

    cfg = c.cfg
    payload = {"samples": [asdict(s) for s in samples]}
    values = c.critic.request("values", payload, timeout_s=3600, alive=c.actor_alive)
    refs: list[Any] = batch_reference(c, samples) or [None] * len(samples)
    coef = distill_coef(cfg)
    advantages, returns = [], []
    for s, v, ref in zip(samples, values, refs, strict=True):
        rewards = token_rewards(
            s.reward,
            s.completion_len,
            s.old_logprobs,
            ref,
            cfg.kl_coef,
            None,
            s.teacher_logprobs or None,
            coef,
        )
        a, r = gae(rewards, v, cfg.gamma, cfg.lambd)
        advantages.append(a)
        returns.append(r)
    advantages = whiten(advantages)
    return [
        replace(s, advantages=tuple(a), returns=tuple(r), old_values=tuple(v))
        for s, a, r, v in zip(samples, advantages, returns, values, strict=True)
    ]
