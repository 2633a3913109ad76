"""One rollout batch: each prompt's group of episodes, scored, with advantages.

Input: the controller (engine, prompts, the environment factory, config, weight version)
and the step. Output: a `Batch` of samples (token ids, loss mask, behaviour
log-probabilities, advantages) for the groups that carry a signal (GRPO drops groups
whose rewards are all equal; PPO keeps all).

Every sample is an episode (`stages.rl.rollout.play`); without an environment it is the
verifier's one turn (`single_turn`), the same engine call and numbers as a plain rollout.
An episode's reward is its total over turns, and advantages are normalised within the
prompt's group of episodes. An episode the environment broke (raised, hung, answered
nonsense) is left out of its group and counted; the step fails only when the failed
share passes `environment.max_failed_share`.
"""

from __future__ import annotations

import time
from typing import Any

from stages.rl.controller.loop import Batch


def rollout(c: Any, step: int) -> Batch:
    """Batch `step`: see the module docstring."""
    import torch

    from stages.lib.environment import check_failures, max_turns
    from stages.rl.algo.logprobs import Sample
    from stages.rl.algo.loss import group_advantages
    from stages.rl.rollout.play import Sampling, play

    cfg = c.cfg
    env = cfg.environment
    indices = c.stream.indices(step)
    start = time.perf_counter()
    sampling = Sampling(
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_output_tokens,
        max_length=cfg.max_length,
        seed=cfg.seed * 1_000_003 + step,
        batch_size=cfg.backend.batch_size if hasattr(cfg.backend, "batch_size") else 256,
        max_turns=max_turns(env),
        timeout_s=env.timeout_s if env else 60.0,
        concurrency=env.concurrency if env else 64,
    )
    groups = play(
        c.engine, c.engine.tokenizer, c.make_env, [c.data.rows[i] for i in indices], sampling
    )
    failed = [t.episode for g in groups for t in g if t.episode.error is not None]
    for e in failed[:3]:
        c.ctx.log.warning("step %d: an episode failed: %s", step, e.error)
    check_failures(len(failed), cfg.num_repeats * len(indices), env, f"rl step {step}")
    rewards = [[t.episode.total for t in g if t.episode.error is None] for g in groups]
    samples, kept = [], 0
    for group, group_rewards in zip(groups, rewards, strict=True):
        ok = [t for t in group if t.episode.error is None]
        if not ok:
            continue
        adv, keep = group_advantages(
            torch.tensor([group_rewards], dtype=torch.float64), cfg.std_normalize
        )
        if not (keep[0] or cfg.algorithm == "ppo"):  # ppo: the critic's values make them
            continue
        kept += 1
        for s_idx, t in enumerate(ok):
            if len(t.ids) <= t.prompt_len:
                continue
            samples.append(
                Sample(
                    tuple(t.ids),
                    t.prompt_len,
                    tuple(t.logprobs),
                    float(adv[0, s_idx]),
                    c.version,
                    reward=t.episode.total,
                    mask=() if all(t.mask) else tuple(t.mask),
                )
            )
    episodes = [t.episode for g in groups for t in g]
    return Batch(
        step,
        indices,
        samples,
        rewards,
        kept,
        time.perf_counter() - start,
        c.version,
        sum(t.generated for g in groups for t in g),
        engine=dict(getattr(c.engine, "stats", None) or {}),
        turns=sum(e.turns for e in episodes) / max(len(episodes), 1),
        failed=len(failed),
        solved=sum(e.solved for e in episodes) / max(len(episodes), 1),
    )


def held_out(c: Any) -> float:
    """The share of held-out episodes solved within `max_turns`, greedy (one per prompt);
    the first-turn share goes to `c.first_turn` (the report puts the two side by side)."""
    from stages.lib.environment import check_failures, max_turns
    from stages.rl.rollout.play import Sampling, play

    cfg, env = c.cfg, c.cfg.environment
    sampling = Sampling(
        num_samples=1,
        temperature=0.0,
        max_new_tokens=cfg.max_output_tokens,
        max_length=cfg.max_length,
        seed=0,
        batch_size=256,
        max_turns=max_turns(env),
        timeout_s=env.timeout_s if env else 60.0,
        concurrency=env.concurrency if env else 64,
    )
    groups = play(c.engine, c.engine.tokenizer, c.make_env, c.evals.rows, sampling)
    episodes = [g[0].episode for g in groups]
    failed = sum(e.error is not None for e in episodes)
    check_failures(failed, len(episodes), env, "rl held-out evaluation")
    c.first_turn = sum(e.first_turn_solved for e in episodes) / len(episodes)
    return sum(e.solved for e in episodes) / len(episodes)
