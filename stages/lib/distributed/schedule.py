"""The learning-rate schedule: a multiplier of the peak rate for each optimizer step.

Input: the step (1-based: the n-th update), the run's total steps, the warm-up
ratio and the schedule's kind. Output: a factor in (0, 1].

Warm-up rises linearly to the peak over `ceil(warmup_ratio x total)` steps
(step s of w uses s/w). After it, `constant` stays at the peak; `cosine` and
`linear` fall from the peak to `MIN_RATIO` of it at the last step (OpenRLHF's
cosine_with_min_lr uses the same floor), so no step is wasted at rate zero.
"""

from __future__ import annotations

import math

MIN_RATIO = 0.1


def warmup_steps(total: int, ratio: float) -> int:
    """Steps spent warming up."""
    return math.ceil(total * ratio)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (1-based)."""
    if warmup and step <= warmup:
        return step / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    if kind == "cosine":
        return MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return MIN_RATIO + (1 - MIN_RATIO) * (1 - progress)
    raise ValueError(f"unknown lr_scheduler '{kind}'")
