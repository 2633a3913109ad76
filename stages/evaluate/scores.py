"""A checkpoint's figures from its rewards: accuracy, pass@k and mean reward.

Input: one checkpoint's rewards, per prompt, per sample (its first sample the greedy
answer at temperature 0; with an environment, an episode's per prompt). Output: the
checkpoint's line of the report (`{"checkpoint", "n", "accuracy", "mean_reward",
"pass_at_k"}`).

Accuracy is the share of prompts whose first sample earns the full reward; pass@k uses the
unbiased estimator 1 - C(n-c, k) / C(n, k) over the `num_samples` samples per prompt (Chen
et al., 2021); mean reward averages every sample.
"""

from __future__ import annotations

import math
from typing import Any

FULL_REWARD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct), from n samples, c correct."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"need 0 < k <= n and 0 <= c <= n, found n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two below n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return [*ks, n]


def summarize(name: str, rewards: list[list[float]]) -> dict[str, Any]:
    """One checkpoint's line of the report, from its rewards (per prompt, per sample)."""
    n = min((len(r) for r in rewards), default=1)
    correct = [sum(x >= FULL_REWARD for x in r[:n]) for r in rewards]
    flat = [x for r in rewards for x in r]
    count = len(rewards)
    return {
        "checkpoint": name,
        "n": count,
        "accuracy": sum(r[0] >= FULL_REWARD for r in rewards) / count if count else 0.0,
        "mean_reward": sum(flat) / len(flat) if flat else 0.0,
        "pass_at_k": {
            str(k): sum(pass_at_k(n, c, k) for c in correct) / count if count else 0.0
            for k in k_values(n)
        },
    }
