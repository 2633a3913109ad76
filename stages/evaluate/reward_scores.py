"""Every evaluated answer scored by a reward model (`reward_model:`), each checkpoint's mean.

Input: the reward-model checkpoint (`stages.lib.model.reward_model.RewardScorer`: a one-label
`...ForSequenceClassification`, as train with `algorithm: rm` writes it), the held-out rows
and every generated sample's row (`checkpoint`, `prompt_idx`, `completion`). Output: each
sample's `reward_model_score` set in its row, and per checkpoint the mean
(`reward_model_score` in its line of the report) beside the verifier's accuracy: a policy
trained against the reward model that gains score but not accuracy is over-optimising it.

The model is loaded once, after every checkpoint has generated (one model in memory at a
time), on the stage's device, and scores `(prompt, completion)` as training scored its pairs
(`score_ids`). Sequences are not cut: the reward model reads each one whole.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pipe.stages.evaluate")
SCORE = "reward_model_score"


def score_samples(
    path: str, rows: list[dict[str, Any]], samples: list[dict[str, Any]], device: str
) -> dict[str, float]:
    """Set `reward_model_score` in every sample; the mean per checkpoint."""
    from stages.lib.model.reward_model import RewardScorer

    scorer = RewardScorer(path, device=device)
    try:
        prompts = [r["messages"] if "messages" in r else r["prompt"] for r in rows]
        scores = scorer([(prompts[s["prompt_idx"]], s["completion"]) for s in samples])
    finally:
        scorer.close()
    sums: dict[str, list[float]] = {}
    for sample, score in zip(samples, scores, strict=True):
        sample[SCORE] = score
        sums.setdefault(sample["checkpoint"], []).append(score)
    means = {name: sum(v) / len(v) for name, v in sums.items()}
    for name, mean in means.items():
        log.info("%s: mean reward-model score %.4f", name, mean)
    return means
