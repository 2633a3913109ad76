"""One rollout batch: sample each prompt's group from the engine, score it, form advantages.

Input: the controller (engine, prompts, verifier, config, weight version) and the step.
Output: a `Batch` of samples (token ids, behaviour log-probabilities, advantages) for the
groups that carry a signal (GRPO drops groups whose rewards are all equal; PPO keeps all).
"""

from __future__ import annotations

import time
from typing import Any

from stages.rl.loop import Batch


def rollout(c: Any, step: int) -> Batch:
    """Batch `step`: see the module docstring."""
    import torch

    from stages.rl.logprobs import Sample
    from stages.rl.loss import group_advantages

    cfg = c.cfg
    indices = c.stream.indices(step)
    start = time.perf_counter()
    gens = c.engine.generate(
        [c.data.prompts[i] for i in indices],
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_output_tokens,
        seed=cfg.seed * 1_000_003 + step,
        batch_size=cfg.backend.batch_size if hasattr(cfg.backend, "batch_size") else 256,
    )
    rewards = [
        [float(c.verify(c.data.rows[i], g.text)) for g in gs]
        for i, gs in zip(indices, gens, strict=True)
    ]
    adv, keep = group_advantages(torch.tensor(rewards, dtype=torch.float64), cfg.std_normalize)
    if cfg.algorithm == "ppo":  # the critic's values make the advantages: every group counts
        keep = torch.ones_like(keep)
    samples = []
    for g_idx, gs in enumerate(gens):
        if not keep[g_idx]:
            continue
        for s_idx, g in enumerate(gs):
            ids = (g.prompt_ids + g.token_ids)[: cfg.max_length]
            n = len(ids) - len(g.prompt_ids)
            if n <= 0:
                continue
            samples.append(
                Sample(
                    ids,
                    len(g.prompt_ids),
                    g.logprobs[:n],
                    float(adv[g_idx, s_idx]),
                    c.version,
                    reward=rewards[g_idx][s_idx],
                )
            )
    tokens = sum(g.completion_tokens for gs in gens for g in gs)
    return Batch(
        step,
        indices,
        samples,
        rewards,
        int(keep.sum()),
        time.perf_counter() - start,
        c.version,
        tokens,
    )
