"""Drive episodes at the level of messages: the model's turns come as text.

Input: a function making one environment per episode, input rows, the episode bound
(`max_turns`) and a way to get the model's answer to a conversation. Output: one
`Episode` per (row, sample), in row-major order.

Two drivers, one per kind of model access:

- `play_batched`: the model answers many conversations in one call (an in-process
  generator, `local_answer`: the checkpoint renders each conversation with its chat
  template and the generation prompt, as evaluate's and collect's `local` backends both
  do): every turn, the conversations still going are answered together, then the
  environment's calls for all of them run concurrently (at most `concurrency` at once).
- `play_each`: the model answers one conversation per call (an HTTP endpoint): every
  episode runs on its own, up to `concurrency` episodes at once, so an environment that
  waits holds up only its own episode.

The rl stage drives its episodes at the level of tokens (`stages.rl.rollout.token_play`) with the
same environment calls (`open_episode`, `take_turn`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from stages.lib.env.contract import Environment, Episode, open_episode, take_turn

MakeEnv = Callable[[], Environment]
Answer = (
    Any  # a completion's text, or an object with `text` (and token counts) such as a Generation
)


async def _bounded(limit: int, jobs: Sequence[Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(job: Awaitable[Any]) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


async def open_all(
    make_env: MakeEnv,
    rows: Sequence[dict[str, Any]],
    num_samples: int,
    timeout_s: float,
    concurrency: int,
    parser: str | None = None,
) -> list[Episode]:
    """`num_samples` episodes per row, each with its own environment, reset concurrently
    (an environment whose constructor raises fails its episode only); `parser` reads the
    model's tool calls in episodes with tools."""

    async def one(row: dict[str, Any]) -> Episode:
        try:
            env = make_env()
        except Exception as exc:  # a user's class: its constructor fails this episode only
            episode = Episode(row, None)  # type: ignore[arg-type]
            episode.fail(f"building the environment raised {type(exc).__name__}: {exc}")
            return episode
        return await open_episode(env, row, timeout_s, parser)

    return await _bounded(concurrency, [one(row) for row in rows for _ in range(num_samples)])


async def play_batched(
    make_env: MakeEnv,
    rows: Sequence[dict[str, Any]],
    answer: Callable[[list[Any]], Sequence[Answer]],
    *,
    max_turns: int,
    num_samples: int = 1,
    timeout_s: float = 60.0,
    concurrency: int = 64,
    parser: str | None = None,
) -> list[Episode]:
    """Episodes turn by turn: `answer(prompts) -> completions` for all that go on, each
    prompt its episode's conversation (with its tools: `Episode.prompt`); a completion with
    token counts adds them to its episode's `usage`."""
    episodes = await open_all(make_env, rows, num_samples, timeout_s, concurrency, parser)
    for _ in range(max_turns):
        going = [e for e in episodes if not e.done]
        if not going:
            break
        replies = answer([e.prompt for e in going])
        texts = []
        for e, reply in zip(going, replies, strict=True):
            texts.append(reply if isinstance(reply, str) else reply.text)
            e.usage[0] += getattr(reply, "prompt_tokens", 0)
            e.usage[1] += getattr(reply, "completion_tokens", 0)
        await _bounded(
            concurrency,
            [take_turn(e, t, max_turns, timeout_s) for e, t in zip(going, texts, strict=True)],
        )
    return episodes


def local_answer(
    model: Any,
    tokenizer: Any,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
) -> Callable[[list[Any]], list[Any]]:
    """`play_batched`'s `answer` for a model in memory: a turn's conversations in one
    `generate_with` call, each rendered by the chat template with the generation prompt
    (`stages.lib.chat.prompt.format_prompt`); turn k samples with seed `seed + k`. Returns each
    conversation's `Generation` (its text and token counts)."""
    turn = itertools.count()

    def answer(conversations: list[Any]) -> list[Any]:
        from stages.lib.model.generate import generate_with

        gens = generate_with(
            model,
            tokenizer,
            conversations,
            num_samples=1,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed + next(turn),
            batch_size=batch_size,
        )
        return [g[0] for g in gens]

    return answer


async def play_one(
    episode: Episode,
    answer: Callable[[Any], Awaitable[Any]],
    max_turns: int,
    timeout_s: float,
) -> Episode:
    """One opened episode to its end; `answer(prompt)` gives the model's turn, its text or
    a server's structured message (its errors propagate: the caller owns the model's retries
    and failures). The prompt is the conversation with its tools (`Episode.prompt`)."""
    while not episode.done:
        reply = await answer(episode.prompt)
        await take_turn(episode, reply, max_turns, timeout_s)
    return episode


async def play_each(
    make_env: MakeEnv,
    rows: Sequence[dict[str, Any]],
    answer: Callable[[Any], Awaitable[Any]],
    *,
    max_turns: int,
    num_samples: int = 1,
    timeout_s: float = 60.0,
    concurrency: int = 64,
    parser: str | None = None,
) -> list[Episode]:
    """Every episode on its own (reset, then turns until done), `concurrency` at once."""

    async def one(row: dict[str, Any]) -> Episode:
        episode = await open_episode(make_env(), row, timeout_s, parser)
        return await play_one(episode, answer, max_turns, timeout_s)

    return await _bounded(concurrency, [one(r) for r in rows for _ in range(num_samples)])


def summary(episodes: Sequence[Any]) -> dict[str, Any]:
    """What a report says of a set of episodes: solved within the bound, solved at the first
    turn, mean turns, mean total reward, failures (with the first reasons)."""
    n = len(episodes)
    failed = [e for e in episodes if e.error is not None]
    return {
        "episodes": n,
        "success_rate": sum(e.solved for e in episodes) / n if n else 0.0,
        "first_turn_rate": sum(e.first_turn_solved for e in episodes) / n if n else 0.0,
        "mean_turns": sum(e.turns for e in episodes) / n if n else 0.0,
        "mean_total_reward": sum(e.total for e in episodes) / n if n else 0.0,
        "failed": len(failed),
        "failure_reasons": sorted({str(e.error) for e in failed})[:5],
    }
