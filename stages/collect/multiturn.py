"""Multi-turn collect: one episode per (prompt, sample) pair, against the stage's environment.

Input: the pairs of the range (`stages.collect.ranged`), an OpenAIClient (every model turn
sends the conversation so far to the chat endpoint as messages), the stage's
`EnvironmentConfig` and the collector's Recorder. Output: one JSONL line per episode in the
Sink: the input row's fields, then the episode's `messages`, per-turn `rewards`,
`total_reward`, `turns`, `solved`, `end`, `reward` (the total, so filter rules on `reward`
keep working), `error` for a failed episode, `usage` summed over the turns and `latency_s`
(the episode's wall time). A model request that fails for good goes to the failures sidecar
as a rollout's would, and the next run redoes that episode from its start.

The worker pool, retries with backoff, adaptive concurrency and resume are the collector's
(`stages.collect.collector`): an episode is a pair that takes several requests and is
written once, when it ends, so a killed run neither loses nor repeats one. An environment
that raises, hangs past `environment.timeout_s` or answers nonsense fails its episode (the
line holds the reason), never the run; `check_episodes` fails the stage when the failed
share of the published output is above `environment.max_failed_share`.

One name, two sides of one concept (a kind's multi-turn path, episodes against the stage's
environment: collect's; `stages/evaluate/multiturn.py`: evaluate's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from stages.collect.collector import Collector
from stages.collect.inputs import EPISODE_FIELDS, Prompt
from stages.lib.api.client import RequestError
from stages.lib.api.client import sample_seed as _seed
from stages.lib.env.contract import Episode, check_failures, max_turns, open_episode, take_turn
from stages.lib.env.field import EnvironmentConfig
from stages.lib.env.message_play import MakeEnv

_dumps = json.JSONEncoder(ensure_ascii=False).encode


@dataclass(frozen=True)
class _Turn:
    """A model turn to request (the client's `Request`): the conversation so far."""

    idx: int
    messages: list[dict[str, Any]] | None
    text: str | None = None
    tools: list[dict[str, Any]] | None = None


def episode_line(
    prompt: Prompt, sample_idx: int, episode: Episode, usage: tuple[int, int], took: float
) -> str:
    """One episode as a JSONL line; it starts with its key, as a rollout line does."""
    return record_line(prompt, sample_idx, episode.record(), episode.total, usage, took)


def record_line(
    prompt: Prompt,
    sample_idx: int,
    record: dict[str, Any],
    total: float,
    usage: tuple[int, int],
    took: float,
) -> str:
    """An episode's `record` (its messages, rewards, turns, end) as a JSONL line."""
    fields = {k: v for k, v in prompt.row.items() if k not in EPISODE_FIELDS}
    fields.update(record)
    fields.update(
        reward=total,
        usage={"prompt_tokens": usage[0], "completion_tokens": usage[1]},
        latency_s=round(took, 4),
    )
    return f'{{"prompt_idx": {prompt.idx}, "sample_idx": {sample_idx}, {_dumps(fields)[1:]}\n'


class EpisodeCollector(Collector):
    """The collector, with an episode (reset, then model turn and environment step until it
    ends) instead of one request per pair."""

    def __init__(
        self, *args: Any, environment: EnvironmentConfig, make_env: MakeEnv, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.make_env = make_env
        self.max_turns = max_turns(environment)
        self.env_timeout = environment.timeout_s
        self.parser = environment.tool_call_parser
        self.env_gate = asyncio.Semaphore(environment.concurrency)
        self.episodes_failed = 0

    async def _one(self, prompt: Prompt, sample_idx: int) -> None:
        if not prompt.parsed:  # not a JSON object: no row to reset with
            self.recorder.bad_row(prompt, sample_idx)
            return
        start = time.perf_counter()
        episode = await self._open(prompt.row)
        seed = _seed(self.seed, prompt.idx, sample_idx, self.num_repeats)
        tokens_in = tokens_out = 0
        while not episode.done:
            url, prefix = self.client.prepare(
                _Turn(prompt.idx, episode.messages, tools=episode.tools)
            )
            out, _, attempts = await self.request(url, f"{prefix}{seed}}}".encode())
            if isinstance(out, RequestError):
                self.recorder.failure(prompt, sample_idx, out, attempts)
                return
            tokens_in += out.prompt_tokens
            tokens_out += out.completion_tokens
            async with self.env_gate:
                await take_turn(episode, out.answer, self.max_turns, self.env_timeout)
        took = time.perf_counter() - start
        self.sink.rollout(episode_line(prompt, sample_idx, episode, (tokens_in, tokens_out), took))
        stats = self.stats
        stats.written += 1
        stats.tokens_in += tokens_in
        stats.tokens_out += tokens_out
        stats.latency.add(took)
        if episode.error is not None:
            self.episodes_failed += 1
            if self.episodes_failed <= 3:
                self.recorder.log.warning(
                    "prompt %d sample %d: episode failed: %s", prompt.idx, sample_idx, episode.error
                )

    async def _open(self, row: dict[str, Any]) -> Episode:
        """A new episode for `row` (failed when the environment cannot even be built)."""
        async with self.env_gate:
            try:
                env = self.make_env()
            except Exception as exc:  # a user's class: its constructor fails this episode only
                episode = Episode(row, None)  # type: ignore[arg-type]
                episode.fail(f"building the environment raised {type(exc).__name__}: {exc}")
                return episode
            return await open_episode(env, row, self.env_timeout, self.parser)


def episode_summary(output: str) -> dict[str, Any]:
    """What the episodes of a published output add up to: how many, failed (with the first
    reasons), solved, mean turns and mean total reward."""
    n = failed = solved = turns = 0
    total = 0.0
    reasons: list[str] = []
    with open(output, "rb") as handle:
        for line in handle:
            row = json.loads(line)
            n += 1
            solved += bool(row.get("solved"))
            turns += int(row.get("turns") or 0)
            total += float(row.get("total_reward") or 0.0)
            if row.get("error") is not None:
                failed += 1
                if len(reasons) < 5 and row["error"] not in reasons:
                    reasons.append(str(row["error"]))
    return {
        "episodes": n,
        "failed": failed,
        "failure_reasons": reasons,
        "success_rate": round(solved / n, 4) if n else 0.0,
        "mean_turns": round(turns / n, 3) if n else 0.0,
        "mean_total_reward": round(total / n, 4) if n else 0.0,
    }


def check_episodes(
    output: str, environment: EnvironmentConfig, log: logging.Logger
) -> dict[str, Any]:
    """The output's episode summary; raises (the stage fails, the output stays) when the
    failed share is above `environment.max_failed_share`."""
    summary = episode_summary(output)
    if summary["failed"]:
        log.warning(
            "collect: %d of %d episodes failed; first reasons: %s",
            summary["failed"],
            summary["episodes"],
            "; ".join(summary["failure_reasons"]),
        )
    check_failures(summary["failed"], summary["episodes"], environment, "collect")
    return summary
