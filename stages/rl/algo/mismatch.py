"""The engine against the actor on the sampled tokens: the mismatch figures.

Input: per completion token, the actor's log-probability before any update of the step
(`new`), the engine's that sampled it (`old`, the behaviour policy), the loss mask, and each
sample's token count. Output: sums and a largest value to add up over micro batches and
ranks, and from them the step's figures (`Gap.figures`):

- `logprob_diff_mean`, `logprob_diff_max`: the mean and largest `|new - old|` over the loss's
  tokens, in nats: `exp(new - old)` is the PPO ratio the loss starts from, so a difference of
  d nats is a ratio of e^d before any update, and a small probability that the engine and
  the actor disagree on by a factor of ten counts as what it does to the loss (2.3 nats), not
  as the 0.001 its probability difference would be (verl's `training/rollout_probs_diff_*`
  is that difference, of probabilities). With the same weights and the same arithmetic (the
  local engine in fp32) it is ~1e-6; an engine in another precision, with other kernels, at
  another temperature, or a version behind (async) shows here.
- The figures the field logs, as verl's rollout correction defines them
  (`compute_offpolicy_metrics`), with `r = exp(new - old)` per token (the log-ratio bounded
  to +-20 first, as verl's): `mismatch_k3`, the mean of `r - 1 - log r` over the loss tokens,
  the k3 estimate of KL(engine || actor) on the engine's samples (verl's `k3_kl`; never
  negative); `mismatch_chi2_token`, `E[r^2] - 1` over the loss tokens (`chi2_token`);
  `mismatch_chi2_seq`, the same over sequences with a sequence's ratio the product of its
  tokens' (`chi2_seq`: the variance of sequence-level importance weights; its log bounded to
  +-20); `mismatch_ppl_ratio`, the mean over sequences of the actor's perplexity over the
  engine's, `exp(mean(old) - mean(new))` (verl's `ppl_ratio`: above 1, the actor is less sure
  of the sampled tokens than the engine was).
- `mismatch_masked_token_frac`, `mismatch_masked_seq_frac`: the share of loss tokens a mask
  mode of `tis_mode` took out of the loss, and of sequences with at least one token taken out
  (verl's `rollout_is_seq_masked_fraction`); 0 without a mask mode.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

SAFETY = 20.0  # verl's bound on a log-ratio before exp (e^20 ~ 5e8)


@dataclass
class Gap:
    """The figures' sums over the loss's tokens and sequences, and the largest `|new - old|`,
    as they are added up (the sums add across ranks; `max` is the largest)."""

    total: float = 0.0  # sum of |new - old|
    count: float = 0.0  # loss tokens
    k3: float = 0.0  # sum of r - 1 - log r
    r2: float = 0.0  # sum of r^2
    seqs: float = 0.0  # sequences with a loss token
    seq_r2: float = 0.0  # sum over sequences of (prod r)^2
    ppl: float = 0.0  # sum over sequences of the actor's perplexity over the engine's
    masked: float = 0.0  # loss tokens a mask mode took out
    masked_seqs: float = 0.0  # sequences with a token taken out
    max: float = 0.0

    def add(
        self, new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, lengths: list[int]
    ) -> None:
        """The tokens `mask` covers (1.0) of one micro batch, flat, `lengths` each sample's
        token count in order; no gradient taken."""
        with torch.no_grad():
            mask = mask.float()
            d = new.detach().float() - old.float()
            diff = d.abs() * mask
            self.total += float(diff.sum())
            self.count += float(mask.sum())
            self.max = max(self.max, float(diff.max())) if diff.numel() else self.max
            safe = d.clamp(-SAFETY, SAFETY)
            r = torch.exp(safe)
            self.k3 += float(((r - 1.0 - safe) * mask).sum())
            self.r2 += float((r * r * mask).sum())
            total, count = per_sequence(d * mask, mask, lengths)
            has = count > 0
            self.seqs += float(has.sum())
            seq_log = total[has].clamp(-SAFETY, SAFETY)
            self.seq_r2 += float(torch.exp(2.0 * seq_log).sum())
            self.ppl += float(torch.exp(-total[has] / count[has]).sum())

    def mask_out(self, keep: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> None:
        """Count the loss tokens (`mask`) a mask mode took out (`keep` 0), and their
        sequences."""
        out = (1.0 - keep.float()) * mask.float()
        self.masked += float(out.sum())
        per_seq, _ = per_sequence(out, mask.float(), lengths)
        self.masked_seqs += float((per_seq > 0).sum())

    def figures(self) -> dict[str, float]:
        """The step's figures (see the module docstring); none without a token."""
        if not self.count:
            return {}
        seqs = max(self.seqs, 1.0)
        return {
            "logprob_diff_mean": self.total / self.count,
            "logprob_diff_max": self.max,
            "mismatch_k3": self.k3 / self.count,
            "mismatch_chi2_token": self.r2 / self.count - 1.0,
            "mismatch_chi2_seq": self.seq_r2 / seqs - 1.0,
            "mismatch_ppl_ratio": self.ppl / seqs,
            "mismatch_masked_token_frac": self.masked / self.count,
            "mismatch_masked_seq_frac": self.masked_seqs / seqs,
        }

    def as_sums(self) -> list[float]:
        """Every field but `max`, in order (`of` builds the Gap back)."""
        return list(astuple(self))[:-1]

    @classmethod
    def of(cls, sums: list[float], top: float) -> Gap:
        """The Gap of `as_sums` and a largest difference (the ranks' reduction)."""
        names = [f.name for f in fields(cls) if f.name != "max"]
        return cls(**dict(zip(names, sums, strict=True)), max=top)


def per_sequence(
    values: torch.Tensor, mask: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's sum of `values` and count of `mask` (flat tensors, `lengths` in order)."""
    seg = torch.repeat_interleave(
        torch.arange(len(lengths), device=values.device),
        torch.tensor(lengths, device=values.device),
    )
    total = torch.zeros(len(lengths), dtype=values.dtype, device=values.device)
    count = torch.zeros(len(lengths), dtype=mask.dtype, device=values.device)
    return total.index_add(0, seg, values), count.index_add(0, seg, mask)


def tis_stats(
    weights: torch.Tensor, raw: torch.Tensor, cap: float, mask: torch.Tensor, truncated: bool
) -> dict[str, float]:
    """The importance weights over the loss's tokens that stayed in the loss (`mask`): their
    mean, and for a truncate mode the share whose untruncated ratio `raw` passed `cap`."""
    n = float(mask.sum())
    if not n:
        return {}
    out = {"tis_weight_mean": float((weights * mask).sum()) / n}
    if truncated:
        out["tis_capped_frac"] = float(((raw > cap).float() * mask).sum()) / n
    return out
