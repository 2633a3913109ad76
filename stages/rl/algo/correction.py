"""The corrections for the engine's mismatch with the actor (`tis_mode`): importance weights,
truncated or masked, per token or per sequence.

Input: per completion token of a step's samples, flat: the actor's log-probabilities at the
step's start (pi_old, from `stages.rl.roles.proximal`'s no-grad pass), the engine's that
sampled them (mu), the loss mask and each sample's token count; the `Correction`
(`stages.rl.algo.options.correction_of`). Output: each token's weight on its surrogate loss
(no gradient), which loss tokens stay in the loss, and the untruncated ratio.

The ratio is `r = exp(pi_old - mu)` per token (its log bounded to +-20, as verl's), or per
sequence the geometric mean of its tokens' over its loss tokens, `exp(mean(pi_old - mu))`
(verl's geometric level; GSPO's ratio has the same form, `stages.rl.algo.loss.sequence_log_ratio`),
given to each of its tokens:

- token_truncate, sequence_truncate: weight `min(r, cap)`, every token kept: verl's
  `rollout_is` (its sequence level multiplies the ratios; this one takes their geometric
  mean), slime's TIS, TRL's `*_truncate`;
- token_mask, sequence_mask: weight `r`, and a token (a sequence) whose r is outside
  `[floor, cap]` leaves the loss: NeMo RL's ICE-POP and slime's MIS `tis_mode: mask` (TRL's
  `*_mask` masks above the cap only). A token that leaves the loss leaves its denominator
  too: the actor takes it out of the sample's loss mask (`stages.rl.roles.proximal`), so the
  token counts that divide the loss (`stages.rl.algo.loss.token_scale`) do not count it,
  slime's fix of a masked token that still divided the loss.

The PPO ratio of the update is then taken against pi_old, the decoupled form verl, slime and
TRL use: the weight corrects from the engine to the actor at the step's start, the clip
bounds the update from there.
"""

from __future__ import annotations

import torch

from stages.rl.algo.loss import sequence_log_ratio
from stages.rl.algo.mismatch import SAFETY
from stages.rl.algo.options import Correction


def correct(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    lengths: list[int],
    c: Correction,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the weight (detached), keep (1.0 in the loss, 0.0 masked out) and the
    untruncated ratio, for the flat `proximal` (pi_old) and `behaviour` (mu) log-probabilities,
    `mask` the loss mask and `lengths` each sample's token count in order."""
    with torch.no_grad():
        proximal, behaviour, mask = proximal.float(), behaviour.float(), mask.float()
        if c.per_sequence:
            log_ratio = sequence_log_ratio(proximal, behaviour, mask, lengths)
        else:
            log_ratio = proximal - behaviour
        ratio = torch.exp(log_ratio.clamp(-SAFETY, SAFETY))
        if not c.masks:
            return ratio.clamp(max=c.cap), torch.ones_like(ratio), ratio
        floor = c.floor if c.floor is not None else 1.0 / c.cap
        keep = ((ratio >= floor) & (ratio <= c.cap)).float()
        return ratio * keep, keep, ratio
