"""One rollout batch: each prompt's group of episodes, scored, with advantages.

Input: the controller (engine, prompts, the environment factory, config, weight version)
and the step. Output: a `Batch` of samples (token ids, loss mask, behaviour
log-probabilities, advantages) for the groups that carry a signal (GRPO drops groups
whose rewards are all equal; PPO and REINFORCE++ keep all unless dynamic sampling is on).

With `dynamic_sampling` (DAPO) the step is refilled from further prompts, round after
round (`dynamic_sampling_max_rounds` at most), until `rollout_batch_size` groups carry a
signal; each refill asks for the groups still wanted over the share kept so far, plus a
quarter, at most `rollout_batch_size` prompts. Each group's rewards are the episodes'
totals plus DAPO's overlong penalty (`overlong_buffer`), and its advantages come from the
`advantage` estimator (`stages.rl.algo.advantage`). With a `reward_model`, the reward role's
ranks score every episode's token ids (one request per round) and the episodes' rewards are
those scores, normalised, clipped and mixed with the verifier's (`stages.rl.algo.shaping`),
before any advantage; the step's metrics take the reward from them, its accuracy from the
verifier. Dynamic sampling judges a group on the verifier's rewards (the reward model's
scores where the verifier is not in the reward: `verifier: null`, or no verifier weight in
`reward_weights`, when it only reports accuracy), as DAPO and verl
(`filter_groups.metric: acc`) do: a group whose answers are all right is dropped however
their lengths differ (without it, such a group trains on its length-shaped advantages).

Every sample is an episode (`stages.rl.rollout.token_play`); without an environment it is the
verifier's one turn (`single_turn`), the same engine call and numbers as a plain rollout.
An episode's reward is its total over turns, and advantages are normalised within the
prompt's group of episodes. An episode the environment broke (raised, hung, answered
nonsense) is left out of its group and counted; the step fails only when the failed
share passes `environment.max_failed_share`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from stages.rl.algo.combinations import refills
from stages.rl.algo.options import per_token_returns
from stages.rl.controller.loop import Batch


@dataclass
class Scored:
    """A group's training rewards (the verifier's, shaped by `overlong_buffer`), their
    advantages under `advantage`, whether the group carries a signal (its training rewards
    differ), whether its verifier's rewards differ (`verified`), and the penalties."""

    advantages: list[float]
    rewards: list[float]
    signal: bool
    penalties: list[float]
    verified: bool = False

    def trains(self, dynamic: bool, every: bool) -> bool:
        """Whether the group trains: with dynamic sampling, when its verifier's rewards
        differ (and so, but for a penalty that evens them out, its training rewards);
        without, when it carries a signal, or always where the estimator trains every group."""
        if dynamic:
            return self.signal and self.verified
        return bool(self.rewards) and (self.signal or every)


def rollout(c: Any, step: int) -> Batch:
    """Batch `step`: see the module docstring."""
    from stages.lib.env.contract import check_failures
    from stages.rl.algo.logprobs import Sample

    cfg = c.cfg
    start = time.perf_counter()
    drawn = list(c.stream.indices(step))
    want, rounds = len(drawn), 1
    groups = _play(c, drawn, step, 0)
    raw: list[float] = []  # the reward model's scores, every round's
    scored = [_score(cfg, g, s) for g, s in zip(groups, _model_scores(c, groups, raw), strict=True)]
    dynamic = refills(cfg)
    # with a teacher every group trains: its term differs token by token (algo.distill)
    every = (per_token_returns(cfg) or cfg.teacher is not None) and not dynamic
    kept = [i for i, s in enumerate(scored) if s.trains(dynamic, every)]
    # DAPO's dynamic sampling: refill from further prompts until `want` groups carry a signal
    while dynamic and len(kept) < want and rounds < cfg.dynamic_sampling_max_rounds:
        more = c.stream.refill(step, rounds, _refill_size(len(kept), want, len(groups)), drawn)
        if not more:
            break
        played = _play(c, more, step, rounds)
        for g, s in zip(played, _model_scores(c, played, raw), strict=True):
            groups.append(g)
            scored.append(_score(cfg, g, s))
            if scored[-1].trains(dynamic, every):
                kept.append(len(groups) - 1)
        drawn += more
        rounds += 1
    kept = kept[:want]
    failed = [t.episode for g in groups for t in g if t.episode.error is not None]
    for e in failed[:3]:
        c.ctx.log.warning("step %d: an episode failed: %s", step, e.error)
    check_failures(len(failed), cfg.num_repeats * len(drawn), cfg.environment, f"rl step {step}")
    samples = []
    for i in kept:
        ok = [t for t in groups[i] if t.episode.error is None]
        for t, a, r in zip(ok, scored[i].advantages, scored[i].rewards, strict=True):
            if len(t.ids) <= t.prompt_len:
                continue
            mask = () if all(t.mask) else tuple(t.mask)
            samples.append(
                Sample(
                    tuple(t.ids), t.prompt_len, tuple(t.logprobs), a, c.version, reward=r, mask=mask
                )
            )
    episodes = [t.episode for g in groups for t in g]
    penalties = [p for s in scored for p in s.penalties]
    return Batch(
        step,
        drawn,
        samples,
        [[t.episode.total for t in g if t.episode.error is None] for g in groups],
        len(kept),
        time.perf_counter() - start,
        c.version,
        sum(t.generated for g in groups for t in g),
        engine=dict(getattr(c.engine, "stats", None) or {}),
        turns=sum(e.turns for e in episodes) / max(len(episodes), 1),
        failed=len(failed),
        solved=sum(e.solved for e in episodes) / max(len(episodes), 1),
        rounds=rounds,
        overlong=sum(penalties) / len(penalties) if cfg.overlong_buffer and penalties else None,
        trained=[s.rewards for s in scored] if c.reward is not None else None,
        scores=raw,
    )


def _refill_size(kept: int, want: int, drawn: int) -> int:
    """Prompts for the next refill: the groups still wanted over the share of groups that
    carried a signal so far, with a quarter more for luck, at most `want` (one round's
    prompts: verl draws a whole generation batch every time, which at the quickstart's
    ~85% kept generates 64 prompts' groups to fill ~10)."""
    rate = max(kept / max(drawn, 1), 1 / want)
    return min(want, math.ceil((want - kept) / rate * 1.25))


def _play(c: Any, indices: list[int], step: int, round_: int) -> list[Any]:
    """The groups of episodes of `indices`' prompts; round 0 the step's own, later rounds
    dynamic sampling's refills (their own sampling seeds)."""
    from stages.lib.env.contract import max_turns
    from stages.lib.env.messages import episode_parser
    from stages.rl.rollout.token_play import PlaySettings, play, play_batch

    cfg, env = c.cfg, c.cfg.environment
    sampling = PlaySettings(
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_output_tokens,
        max_length=cfg.max_length,
        seed=cfg.seed * 1_000_003 + step + round_ * 7_919_001,
        batch_size=play_batch(cfg),
        # an agent ends its own episodes (agent_play reads no bound): 1 stands in
        max_turns=1 if env is not None and env.agent_plays else max_turns(env),
        timeout_s=env.timeout_s if env else 60.0,
        concurrency=env.concurrency if env else 64,
        parser=episode_parser(env.tool_call_parser if env else None, c.engine.tokenizer),
        tokens=cfg.multi_turn_tokens,
    )
    rows = [c.data.rows[i] for i in indices]
    if getattr(c, "agent", None) is not None:  # NeMo Gym's agent plays them (agent_play)
        from stages.rl.rollout.agent_play import play_agent

        return play_agent(c.agent, rows, sampling)
    return play(c.engine, c.engine.tokenizer, c.make_env, rows, sampling)


def _model_scores(c: Any, groups: list[list[Any]], raw: list[float]) -> list[list[float] | None]:
    """Per group, the reward model's shaped scores of its episodes the environment did not
    break (`stages.rl.algo.shaping`), scored in one request to the reward role's ranks (the
    raw scores appended to `raw`); None per group without a reward model."""
    from stages.rl.algo.shaping import shape

    if c.reward is None:
        return [None] * len(groups)
    ok = [[t for t in g if t.episode.error is None] for g in groups]
    traces = [t for g in ok for t in g]
    got = c.reward.score(traces, c.engine.tokenizer) if traces else []
    raw += got
    shaped = shape(got, c.reward.stats, c.cfg)
    out: list[list[float] | None] = []
    for g in ok:
        out.append(shaped[: len(g)])
        shaped = shaped[len(g) :]
    return out


def _score(cfg: Any, group: list[Any], model: list[float] | None = None) -> Scored:
    """A group's rewards (its episodes the environment did not break), shaped and estimated;
    with a reward model, `model` holds its shaped scores, mixed with the verifier's."""
    from stages.rl.algo.advantage import group_estimate, overlong_penalty
    from stages.rl.algo.shaping import mix, verifier_weighs

    ok = [t for t in group if t.episode.error is None]
    penalties = [
        overlong_penalty(
            t.generated, cfg.max_output_tokens, cfg.overlong_buffer, cfg.overlong_penalty
        )
        if cfg.overlong_buffer
        else 0.0
        for t in ok
    ]
    totals = [t.episode.total for t in ok]
    if model is not None:
        totals = [mix(s, v, cfg) for s, v in zip(model, totals, strict=True)]
    rewards = [r + p for r, p in zip(totals, penalties, strict=True)]
    if not rewards:
        return Scored([], [], False, [])
    adv, signal = group_estimate(rewards, cfg.advantage, cfg.std_normalize)
    # dynamic sampling's judge: the verifier's rewards where they are in the reward, else the
    # model's (a verifier that only reports accuracy stays out of the loop); before shaping
    judged = totals  # without a reward model: the verifier's
    if model is not None and verifier_weighs(cfg):
        judged = [t.episode.total for t in ok]
    verified = signal
    if cfg.overlong_buffer or judged is not totals:
        verified = group_estimate(judged, "dr_grpo", False)[1]
    return Scored(adv, rewards, signal, penalties, verified)


def held_out(c: Any) -> float:
    """The share of held-out episodes solved within `max_turns`, greedy (one per prompt);
    the first-turn share goes to `c.first_turn` (the report puts the two side by side).
    Later turns are asked from the template's rendering, as evaluate asks them, whatever
    `multi_turn_tokens` trains with: the two modes' scores compare."""
    from stages.lib.env.contract import check_failures, max_turns
    from stages.lib.env.messages import episode_parser
    from stages.rl.rollout.token_play import PlaySettings, play

    cfg, env = c.cfg, c.cfg.environment
    sampling = PlaySettings(
        num_samples=1,
        temperature=0.0,
        max_new_tokens=cfg.max_output_tokens,
        max_length=cfg.max_length,
        seed=0,
        batch_size=256,
        max_turns=max_turns(env),
        timeout_s=env.timeout_s if env else 60.0,
        concurrency=env.concurrency if env else 64,
        parser=episode_parser(env.tool_call_parser if env else None, c.engine.tokenizer),
        tokens="rerender",
    )
    groups = play(c.engine, c.engine.tokenizer, c.make_env, c.evals.rows, sampling)
    episodes = [g[0].episode for g in groups]
    failed = sum(e.error is not None for e in episodes)
    check_failures(failed, len(episodes), env, "rl held-out evaluation")
    c.first_turn = sum(e.first_turn_solved for e in episodes) / len(episodes)
    return sum(e.solved for e in episodes) / len(episodes)
