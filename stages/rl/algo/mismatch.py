"""The engine against the actor on the sampled tokens: the mismatch figure.

Input: per completion token, the actor's log-probability before any update of the step
(`new`), the engine's that sampled it (`old`, the behaviour policy), and the loss mask.
Output: the sum, count and largest of `|new - old|` over the tokens the loss covers, to add
up over micro batches and ranks, and from them `logprob_diff_mean` and `logprob_diff_max`.

The figure is on log-probabilities, in nats: `exp(new - old)` is the PPO ratio the loss
starts from, so a difference of d nats is a ratio of e^d before any update, and a small
probability that the engine and the actor disagree on by a factor of ten counts as what it
does to the loss (2.3 nats), not as the 0.001 its probability difference would be (verl's
`training/rollout_probs_diff_*` is that difference, of probabilities). With the same
weights and the same arithmetic (the local engine in fp32) it is ~1e-6; an engine in
another precision, with other kernels, at another temperature, or a version behind (async)
shows here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Gap:
    """`|new - old|` over the loss's tokens, summed and at most, as it is added up."""

    total: float = 0.0
    count: float = 0.0
    max: float = 0.0

    def add(self, new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> None:
        """The tokens `mask` covers (1.0) of one micro batch, flat; no gradient taken."""
        with torch.no_grad():
            diff = (new.detach().float() - old.float()).abs() * mask
            self.total += float(diff.sum())
            self.count += float(mask.sum())
            self.max = max(self.max, float(diff.max())) if diff.numel() else self.max

    def figures(self) -> dict[str, float]:
        """`logprob_diff_mean` and `logprob_diff_max`; none without a token."""
        if not self.count:
            return {}
        return {"logprob_diff_mean": self.total / self.count, "logprob_diff_max": self.max}


def tis_stats(
    weights: torch.Tensor, raw: torch.Tensor, cap: float, mask: torch.Tensor
) -> dict[str, float]:
    """The truncated importance weights over the loss's tokens: their mean, and the share
    whose untruncated ratio `raw` passed `cap`."""
    n = float(mask.sum())
    if not n:
        return {}
    return {
        "tis_weight_mean": float((weights * mask).sum()) / n,
        "tis_capped_frac": float(((raw > cap).float() * mask).sum()) / n,
    }
