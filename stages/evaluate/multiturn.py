"""The evaluate stage's multi-turn path: each checkpoint plays episodes in the environment.

Input: a resolved `EvaluateConfig` with an `environment`, the stage's context (its
devices) and a way to open a checkpoint's HTTP endpoint (vllm, openai), then per
checkpoint its path, display name and the held-out rows.
Output, per checkpoint: whether each episode was solved (per row, per sample: what
pass@k counts), the report fields that differ from the one-turn path (`accuracy`,
`mean_reward`) or add to it (`first_turn_accuracy`, `mean_turns`, `mean_total_reward`,
`failed_episodes`), and one `generations.jsonl` row per episode (`Episode.record()` with
the checkpoint, `prompt_idx`, `sample_idx` and the row's `answer`).

`num_samples` episodes per row (one at temperature 0, as in the one-turn path). The
`local` backend loads the checkpoint once and answers every turn's open conversations in
one batched call (`play_batched`), each rendered with the shared chat template; `vllm` and
`openai` send each conversation to the chat endpoint, every episode on its own,
`environment.concurrency` at once, each request seeded per (row, sample, turn) and retried
with backoff as the one-turn path's are. Another ecosystem's environment (kind `nemo_gym`)
plays each episode itself: its agent's `/run` against the checkpoint served over HTTP (the
`local` backend's by pipe, `stages.lib.backends.local`), `environment.concurrency` runs at
once, scored by the agent's reward (`solved`: the full reward). An episode the environment
breaks is recorded with its reason; above `environment.max_failed_share` of a checkpoint's
episodes the stage fails (`check_failures`).

One name, two sides of one concept (a kind's multi-turn path, episodes against the stage's
environment: collect's; this file: evaluate's; `stages/collect/multiturn.py` the other side).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.lib.env.contract import (
    Episode,
    check_failures,
    close_environments,
    environment_factory,
    max_turns,
    open_episode,
)
from stages.lib.env.message_play import local_answer, play_batched, play_one, summary

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.evaluate import EvaluateConfig
    from stages.lib.api.client import OpenAIClient
    from stages.lib.backends.endpoint import Endpoint
    from stages.lib.env.responses import AgentEpisode

log = logging.getLogger("pipe.stages.evaluate")

MAX_RETRIES, BACKOFF_S = 4, 0.5
OpenEndpoint = Callable[[str], AbstractContextManager["Endpoint"]]
Scored = tuple[list[list[float]], dict[str, Any], list[dict[str, Any]]]


class Play:
    """Plays and scores one checkpoint's episodes; built once per stage run."""

    def __init__(
        self,
        cfg: EvaluateConfig,
        ctx: StageContext | None,
        endpoint: OpenEndpoint,
        dtype: str | None = None,
    ) -> None:
        """`dtype`: the local backend's one precision for every checkpoint."""
        assert cfg.environment is not None
        problem = cfg.backend.conversation_problem()
        if problem is not None:
            raise ValueError(f"evaluate: {problem[0]}: {problem[1]}")
        self.cfg, self.env, self.ctx, self.endpoint = cfg, cfg.environment, ctx, endpoint
        self.dtype = dtype
        self.agent = cfg.environment.agent_plays  # its agent plays each episode
        if not self.agent:
            self.make_env = environment_factory(
                cfg.environment, cfg.verifier, ctx.run_dir if ctx is not None else None
            )
            self.max_turns = max_turns(cfg.environment)
        self.samples = 1 if cfg.temperature == 0 else cfg.num_samples
        if cfg.temperature == 0 and cfg.num_samples > 1:
            log.warning("temperature 0 gives %d identical episodes; playing one", cfg.num_samples)

    def close(self) -> None:
        """Stop the process serving the environment, if one does (an agent's servers stop
        with each checkpoint's episodes)."""
        if not self.agent:
            close_environments(self.make_env)

    def __call__(self, path: str, name: str, rows: list[dict[str, Any]]) -> Scored:
        """Solved per row and sample, the report's episode fields and the generations rows;
        raises above the failed share."""
        local = self.cfg.backend.in_process() is not None
        episodes: list[Any]
        if self.agent:
            episodes = self._agent(path, rows)
        else:
            episodes = self._local(path, rows) if local else self._http(path, rows)
        stats = summary(episodes)
        for reason in stats["failure_reasons"]:
            log.warning("%s: an episode failed: %s", name, reason)
        check_failures(stats["failed"], stats["episodes"], self.env, f"evaluate '{name}'")
        log.info(
            "%s: %d episodes, first turn %.3f, mean turns %.2f, mean total reward %.3f, %d failed",
            name,
            stats["episodes"],
            stats["first_turn_rate"],
            stats["mean_turns"],
            stats["mean_total_reward"],
            stats["failed"],
        )
        solved = [
            [float(e.solved) for e in episodes[i : i + self.samples]]
            for i in range(0, len(episodes), self.samples)
        ]
        return solved, self._fields(episodes, stats), self._records(name, rows, episodes)

    def _local(self, path: str, rows: list[dict[str, Any]]) -> list[Episode]:
        from stages.lib.env.messages import episode_parser

        answer, tokenizer = self._local_answer(path)
        return asyncio.run(
            play_batched(
                self.make_env,
                rows,
                answer,
                max_turns=self.max_turns,
                num_samples=self.samples,
                timeout_s=self.env.timeout_s,
                concurrency=self.env.concurrency,
                parser=episode_parser(self.env.tool_call_parser, tokenizer),
            )
        )

    def _local_answer(self, path: str) -> tuple[Callable[[list[Any]], list[Any]], Any]:
        """The checkpoint, loaded once, answering a turn's conversations in one call; and
        its tokenizer."""
        from stages.lib.devices import torch_device

        cfg, engine = self.cfg, self.cfg.backend.in_process()
        assert engine is not None  # the caller's choice
        model, tokenizer = engine.load(path, torch_device(self.ctx), self.dtype)
        return local_answer(
            model,
            tokenizer,
            temperature=cfg.temperature,
            top_p=1.0,
            max_new_tokens=cfg.max_output_tokens,
            seed=cfg.seed,
            batch_size=engine.batch_size,
        ), tokenizer

    def _http(self, path: str, rows: list[dict[str, Any]]) -> list[Episode]:
        from stages.lib.backends.endpoint import make_client

        with self.endpoint(path) as endpoint:
            client = make_client(self.cfg, endpoint, connections=self.env.concurrency)
            return asyncio.run(self._play_each(client, rows))

    async def _play_each(self, client: OpenAIClient, rows: list[dict[str, Any]]) -> list[Episode]:
        """Every episode on its own (`play_one`), `concurrency` at once: each knows its row
        and sample, so its requests go to its row's engine with their own seeds."""
        from stages.lib.api.client import sample_seed

        gate = asyncio.Semaphore(self.env.concurrency)
        turns = self.max_turns

        async def one(i: int, s: int) -> Episode:
            turn = itertools.count()

            async def answer(prompt: Any) -> Any:
                seed = sample_seed(self.cfg.seed, i, s * turns + next(turn), self.samples * turns)
                return await _ask(client, i, prompt, seed)

            async with gate:
                episode = await open_episode(
                    self.make_env(), rows[i], self.env.timeout_s, self.env.tool_call_parser
                )
                return await play_one(episode, answer, turns, self.env.timeout_s)

        async with client:
            return await asyncio.gather(
                *(one(i, s) for i in range(len(rows)) for s in range(self.samples))
            )

    def _agent(self, path: str, rows: list[dict[str, Any]]) -> list[AgentEpisode]:
        """Every episode played by NeMo Gym's agent against the checkpoint, served for the
        block (the local backend's too), `concurrency` runs at once; a run that fails for
        good fails its episode."""
        import tempfile

        from stages.lib.env.gym import nemo_gym
        from stages.lib.env.responses import run_all

        work_dir = self.ctx.stage_dir if self.ctx is not None else tempfile.mkdtemp()
        sampling = {"temperature": self.cfg.temperature, "top_p": 1.0}
        sampling["max_output_tokens"] = self.cfg.max_output_tokens
        with self.endpoint(path) as endpoint, nemo_gym(self.env, endpoint, work_dir, log) as url:
            return asyncio.run(
                run_all(
                    f"{url}/run",
                    rows,
                    self.samples,
                    sampling,
                    self.env.concurrency,
                    self.env.timeout_s,
                )
            )

    def _fields(self, episodes: list[Any], stats: dict[str, Any]) -> dict[str, Any]:
        """Accuracy: solved within max_turns; mean reward: a model turn's."""
        rewards = [r for e in episodes for r in e.rewards]
        return {
            "accuracy": stats["success_rate"],
            "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "first_turn_accuracy": stats["first_turn_rate"],
            "mean_turns": stats["mean_turns"],
            "mean_total_reward": stats["mean_total_reward"],
            "failed_episodes": stats["failed"],
        }

    def _records(
        self, name: str, rows: list[dict[str, Any]], episodes: list[Any]
    ) -> list[dict[str, Any]]:
        return [
            {
                "checkpoint": name,
                "prompt_idx": k // self.samples,
                "sample_idx": k % self.samples,
                **e.record(),
                "answer": rows[k // self.samples].get("answer"),
            }
            for k, e in enumerate(episodes)
        ]


@dataclass(frozen=True)
class _Conversation:
    """A conversation as the client's `Request`: `idx` picks the engine; `tools` go with it."""

    idx: int
    messages: list[dict[str, Any]] | None
    text: str | None = None
    tools: list[dict[str, Any]] | None = None


async def _ask(client: OpenAIClient, idx: int, prompt: Any, seed: int) -> Any:
    """The model's answer to one conversation (its text, or its message with the calls the
    server parsed), retried with backoff while the failure is retryable (`complete_all`'s
    rule); a request that fails for good fails the stage."""
    from stages.lib.api.client import complete_retrying
    from stages.lib.chat.prompt import as_messages, tools_of

    url, head = client.prepare(_Conversation(idx, as_messages(prompt), tools=tools_of(prompt)))
    body = f"{head}{seed}}}".encode()
    return (await complete_retrying(client, url, body, None, MAX_RETRIES, BACKOFF_S)).answer
