"""The GRPO objective: group advantages, the clipped policy loss per token, k3 KL.

Input: rewards per prompt group, per-token log-probabilities of the completions under
the current policy, the behaviour policy (the engine that sampled them) and the frozen
reference. Output: advantages (and which groups carry a signal), and the loss terms.

- GRPO's advantages are normalised within each prompt's group: `r - mean(r)`, divided by
  the group's sample standard deviation (n - 1, as verl and TRL) unless `std_normalize` is
  off (Dr. GRPO); the other estimators are in `stages.rl.algo.advantage`. A group whose
  samples all scored the same has no signal and is dropped before the update.
- The policy loss per token is PPO's clipped surrogate
  `-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)` with `ratio = exp(new - old)`
  (`eps_high` DAPO's clip-higher, `eps` when unset), or with GSPO's sequence-level ratio
  (`sequence_log_ratio`).
- By default (`loss_agg: token_mean`) per-token losses are summed and divided by the token
  count of the whole global batch (every micro batch of every rank), so micro-batching
  gives exactly the full batch's gradient, and a long answer weighs what its tokens weigh
  (a per-sequence mean would give short answers more weight per token); `token_scale`
  gives the per-sequence aggregations.
- KL to the reference is the k3 estimator `exp(ref - new) - (ref - new) - 1` per token
  (unbiased, never negative), added with `kl_coef`.
- The mismatch corrections (`tis_mode`, optional; `stages.rl.algo.correction`), for engines
  whose log-probabilities differ from the actor's by design: the decoupled form of verl's
  rollout correction, slime's TIS and MIS and TRL's importance sampling modes. The ratio is
  taken against the actor's own log-probabilities at the step's start (`old` = pi_old), and
  each token's loss is weighted by its importance weight from pi_old / mu (mu the engine's),
  truncated or masked, the weight held constant; a masked token is out of the loss mask, so
  out of the token counts `token_scale` divides by.

With one update per batch the ratio is 1 and its gradient is `grad(new)`, so the loss
reduces to REINFORCE with a group-mean baseline (tests/unit/test_rl_loss.py shows it).

One name, two sides of one concept (the loss of a trained model: train's (SFT, DPO); this file:
rl's (the clipped policy loss); `stages/train/loss.py` the other side).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, std_normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantages `[groups, samples]` and which groups carry a signal (`[groups]`
    bool); the other estimators are in `stages.rl.algo.advantage`. The std is the sample
    (unbiased, n - 1) one, as verl's `compute_grpo_outcome_advantage` and TRL's
    GRPOTrainer take it (`torch.std`'s default), so advantages agree with theirs: the
    population std would make them `sqrt((G - 1) / G)` as large (-13% at G = 4)."""
    mean = rewards.mean(dim=1, keepdim=True)
    if rewards.shape[1] > 1:
        std = rewards.std(dim=1, unbiased=True, keepdim=True)
    else:  # one sample: no spread, no signal (and no n - 1 to divide by)
        std = torch.zeros_like(mean)
    keep = std.squeeze(1) > EPS
    adv = rewards - mean
    if std_normalize:
        adv = adv / (std + EPS)
    return adv, keep


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the sampling distribution at each position."""
    logp = torch.log_softmax(logits.float() / max(temperature, EPS), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def clipped_policy_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss, and which tokens the clip bound (float 0/1). The
    ratio is clipped to `[1 - eps_clip, 1 + eps_clip_high]` (DAPO's clip-higher; empty:
    `eps_clip` both ways). `log_ratio`: the log-ratio per token when it is not `new - old`
    (GSPO's sequence-level one, `sequence_log_ratio`)."""
    ratio = torch.exp(new - old if log_ratio is None else log_ratio)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high) * advantages
    loss = -torch.min(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def sequence_log_ratio(
    new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """GSPO's ratio (Zheng et al., 2025, eq. 7), per token: each sequence's
    `log s_i = mean_t (new - old)` over its loss tokens (`mask`), given to each of its
    tokens, with the gradient of that mean: `s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)`,
    clipped as one. `lengths`: each sequence's token count in the flat `new` (in order)."""
    seg = torch.repeat_interleave(
        torch.arange(len(lengths), device=new.device), torch.tensor(lengths, device=new.device)
    )
    diff = (new - old) * mask
    total = torch.zeros(len(lengths), dtype=diff.dtype, device=new.device).index_add(0, seg, diff)
    count = torch.zeros(len(lengths), dtype=mask.dtype, device=new.device).index_add(0, seg, mask)
    return (total / count.clamp(min=1.0))[seg]


def kl_k3(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || reference) per token."""
    delta = ref - new
    return torch.exp(delta) - delta - 1.0


def masked_policy_terms(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tis: torch.Tensor | None = None,
    *,
    eps_clip_high: float | None = None,
    lengths: list[int] | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro batch's summed loss (clipped surrogate plus `kl_coef` x k3 KL to `ref`), its
    summed KL and clipped-token count, over the tokens `mask` covers (1.0): a multi-turn
    episode's observation tokens (0.0) carry no loss, no KL and no gradient. `tis`: each
    token's importance weight on its surrogate loss (`stages.rl.algo.correction`; the KL term
    unweighted, as in verl), `old` then the actor's own log-probabilities at the step's start.
    `lengths` (each sequence's tokens in the flat tensors): GSPO's sequence-level ratio in
    place of the per-token one. `scale`: each token's weight in the returned loss (loss and
    KL), for the per-sequence aggregations of `token_scale`; the KL and clip counts stay sums."""
    log_ratio = None if lengths is None else sequence_log_ratio(new, old, mask, lengths)
    pg, clipped = clipped_policy_loss(new, old, advantages, eps_clip, eps_clip_high, log_ratio)
    if tis is not None:
        pg = pg * tis
    weight = mask if scale is None else mask * scale
    loss = (pg * weight).sum()
    kl = torch.zeros((), device=new.device)
    if ref is not None:
        per_token = kl_k3(new, ref)
        kl = (per_token * mask).sum()
        loss = loss + kl_coef * (kl if scale is None else (per_token * weight).sum())
    return loss, kl, (clipped * mask).sum()


def token_scale(
    agg: str, lengths: list[tuple[int, int]], sequences: int, tokens: int
) -> tuple[list[float] | None, int]:
    """How a step's per-token losses add up to its objective, verl's `agg_loss`: the
    per-token weights of one micro batch (`lengths`: each of its sequences' completion
    tokens and loss tokens; None: one weight for all) and what the micro batch's sum is
    divided by, from the step's `sequences` (those with a loss token) and loss `tokens` (all
    ranks; a token a mask mode of `tis_mode` took out is no loss token). token_mean:
    sum / tokens (every token weighs the same: DAPO, Dr. GRPO, TRL's default);
    seq_mean_token_sum: each sequence's sum, averaged over sequences; seq_mean_token_mean:
    each sequence's mean, averaged over sequences (GRPO's paper: a short answer's tokens
    weigh more)."""
    if agg == "token_mean":
        return None, max(tokens, 1)
    if agg == "seq_mean_token_sum":
        return None, max(sequences, 1)
    weights = [1.0 / max(trained, 1) for n, trained in lengths for _ in range(n)]
    return weights, max(sequences, 1)
