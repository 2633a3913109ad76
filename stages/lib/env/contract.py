"""Environments: episodes of several turns between a model and something that answers back.

Input: a `stages.lib.config.EnvironmentConfig` (a built-in name, a user's
`module:Class`, or the `url` of one served over HTTP) and the stage's verifier.
Output: `Environment` objects, one per episode, and `Episode`s that record a
conversation, its per-turn rewards and how it ended.

The contract (docs/rl/environments.md), small on purpose:

- `reset(row) -> messages`: the opening conversation for one input row.
- `step(messages, completion) -> (reward, observation, done)`: the model answered
  `completion` to the conversation `messages` (which does not hold it yet); the
  environment gives that turn's reward (a finite float), the messages it answers
  with (a list of `{"role", "content"}`, or None) and whether the episode is over.

Messages are OpenAI's (`stages.lib.env.messages`): an environment that offers tools declares
them (a `tools` attribute, or `reset` returning `{"messages", "tools"}`; else a row's `tools`
apply), the chat template renders them, the model's text is parsed into `tool_calls` by the
template's format, `completion.tool_calls` holds them (`completion` stays the text, a `str`,
so text-only environments work unchanged) and the environment answers with `tool` messages.

Either method may be a coroutine (an environment that waits on I/O does not hold up
the others) or a plain function (run in a thread). One instance serves one episode;
a user's class is built as `Class(**config)`. The episode also ends at `max_turns`,
and the drivers end it when the conversation reaches the stage's length bound.

An episode is *solved* when one of its turns earns the full reward (1.0), the
verifiers' rule for a correct answer; its total reward is the sum over its turns
(GRPO's advantage is per episode). A `reset` or `step` that raises, runs past
`timeout_s` or returns a malformed value fails that episode: the reason is recorded,
the caller counts it, and only a failed share above `max_failed_share` ends a stage
(`check_failures`).

Built-ins (`stages.lib.env.builtin`): `single_turn` (the verifier as a one-turn
environment: what every stage runs when no environment is named), `retry`, and
`calculator` and `python`, which offer that tool (`stages.lib.env.tools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from stages.lib.config import Verifier
from stages.lib.env.builtin import BUILT_IN, HTTPEnvironment, single_turn
from stages.lib.env.field import EnvironmentConfig
from stages.lib.env.messages import EpisodeFailed as EpisodeFailed  # re-exported: the contract
from stages.lib.env.messages import Messages as Messages
from stages.lib.env.messages import completion_of, messages_of, tools_of

FULL_REWARD = 1.0


class Environment(Protocol):
    """What an environment offers (either method may also be `async def`)."""

    def reset(self, row: dict[str, Any]) -> Any: ...
    def step(self, messages: Messages, completion: str) -> Any: ...


@dataclass
class Episode:
    """One conversation: the row it came from, its messages, one reward per model turn."""

    row: dict[str, Any]
    env: Environment
    messages: Messages = field(default_factory=list)
    opening: int = 0  # how many of `messages` came from reset
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    end: str = ""  # done | max_turns | length | failed
    error: str | None = None
    usage: list[int] = field(default_factory=lambda: [0, 0])  # prompt, completion tokens
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas the template renders
    parser: str | None = None  # the tool-call format model text is parsed with (with tools)
    parse_errors: int = 0  # turns whose tool call did not parse

    @property
    def prompt(self) -> Any:
        """The conversation so far as a prompt: its messages, with its tools when it has any
        (`stages.lib.chat.prompt.ChatPrompt`, which the chat template renders them from)."""
        if not self.tools:
            return list(self.messages)
        from stages.lib.chat.prompt import ChatPrompt

        return ChatPrompt(tuple(self.messages), tuple(self.tools))

    @property
    def turns(self) -> int:
        return len(self.rewards)

    @property
    def total(self) -> float:
        return float(sum(self.rewards))

    @property
    def solved(self) -> bool:
        return any(r >= FULL_REWARD for r in self.rewards)

    @property
    def first_turn_solved(self) -> bool:
        return bool(self.rewards) and self.rewards[0] >= FULL_REWARD

    def fail(self, reason: str) -> None:
        self.done, self.end, self.error = True, "failed", reason

    def record(self) -> dict[str, Any]:
        """The episode as an output row's fields."""
        out: dict[str, Any] = {
            "messages": self.messages,
            "rewards": self.rewards,
            "total_reward": self.total,
            "turns": self.turns,
            "solved": self.solved,
            "end": self.end,
        }
        if self.tools:
            out["tools"] = self.tools
        if self.error is not None:
            out["error"] = self.error
        return out


# -- calling an environment -------------------------------------------------------------


def _in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` in a daemon thread of its own: a plain function that never returns keeps
    its thread but neither a pool's slot nor the process's exit (a pool's threads are
    joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def body() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting episode
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=body, name="pipe-environment", daemon=True).start()
    return future


async def _call(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """`fn(*args)` awaited (a coroutine) or in a daemon thread (a plain function), within
    `timeout_s`; past it the episode fails (a plain function that hangs keeps its thread)."""
    pending = fn(*args) if inspect.iscoroutinefunction(fn) else _in_thread(fn, *args)
    try:
        return await asyncio.wait_for(pending, timeout_s)
    except TimeoutError:
        raise EpisodeFailed(f"{_name(fn)} took longer than {timeout_s:g} s") from None
    except EpisodeFailed:
        raise
    except Exception as exc:  # a user's environment: any error fails the episode
        raise EpisodeFailed(f"{_name(fn)} raised {type(exc).__name__}: {exc}") from None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", "the environment")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_step(value: Any) -> tuple[float, Messages | None, bool]:
    """`step`'s answer checked: a (reward, observation, done) triple, or a dict of them."""
    if isinstance(value, dict):
        value = (value.get("reward"), value.get("observation"), value.get("done"))
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EpisodeFailed(f"step returned {_short(value)}: expected (reward, observation, done)")
    reward, observation, done = value
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise EpisodeFailed(f"step returned the reward {_short(reward)}: expected a number")
    if not math.isfinite(float(reward)):
        raise EpisodeFailed(f"step returned the reward {reward}: expected a finite number")
    if not isinstance(done, bool):
        raise EpisodeFailed(f"step returned done={_short(done)}: expected true or false")
    obs = None if observation is None else messages_of(observation, "step")
    return float(reward), obs or None, done


async def open_episode(
    env: Environment, row: dict[str, Any], timeout_s: float, parser: str | None = None
) -> Episode:
    """A new episode: `reset(row)` called and checked (a failure is recorded, not raised).
    Its tools: those `reset` returned (`{"messages", "tools"}`), else the environment's
    `tools` attribute, else the row's `tools` (OpenAI-format datasets carry them); `parser`
    reads the model's tool calls where there are tools."""
    episode = Episode(row, env)
    try:
        answer = await _call(env.reset, row, timeout_s=timeout_s)
        tools = getattr(env, "tools", None) or row.get("tools")
        if isinstance(answer, dict):
            tools = answer.get("tools") or tools
            answer = answer.get("messages")
        opening = messages_of(answer, "reset")
        if not opening:
            raise EpisodeFailed("reset returned no messages")
        episode.messages, episode.opening = opening, len(opening)
        if tools:
            episode.tools, episode.parser = tools_of(tools, "reset"), parser
    except EpisodeFailed as exc:
        episode.fail(str(exc))
    return episode


async def take_turn(
    episode: Episode, answer: Any, max_turns: int, timeout_s: float
) -> Messages | None:
    """Record the model's `answer` (its text, or a server's structured message) as the
    episode's next turn and ask the environment; returns the observation when the episode
    goes on (None once it ended). The environment's `step` gets a `Completion`: the text,
    carrying the assistant message with its tool calls (`stages.lib.env.messages`)."""
    try:
        completion = completion_of(answer, episode.parser if episode.tools else None, episode.turns)
    except EpisodeFailed as exc:  # a server's malformed message
        episode.fail(str(exc))
        return None
    episode.parse_errors += completion.parse_error is not None
    try:
        reply = await _call(
            episode.env.step, list(episode.messages), completion, timeout_s=timeout_s
        )
        reward, observation, done = parse_step(reply)
    except EpisodeFailed as exc:
        episode.messages.append(completion.message)
        episode.fail(str(exc))
        return None
    episode.messages.append(completion.message)
    episode.rewards.append(reward)
    if done or observation is None:
        episode.done, episode.end = True, "done"
        return None
    if episode.turns >= max_turns:
        episode.done, episode.end = True, "max_turns"
        return None
    episode.messages.extend(observation)
    return observation


# -- which environment ------------------------------------------------------------------


def max_turns(cfg: EnvironmentConfig | None) -> int:
    """The episode bound: the config's, else the built-in's default (one turn without one)."""
    if cfg is None:
        return 1
    if cfg.max_turns is not None:
        return cfg.max_turns
    if cfg.kind in BUILT_IN:
        return BUILT_IN[cfg.kind].max_turns
    raise ValueError("environment: 'max_turns' is required for this environment")


def _no_reward(row: dict[str, Any], completion: str) -> float:
    return 0.0


def environment_factory(
    cfg: EnvironmentConfig | None, verifier: Verifier | None, run_dir: str | None = None
) -> Callable[[], Environment]:
    """A function making one environment per episode; raises ValueError on one that cannot
    be loaded (an unimportable module, a missing class). No verifier (the rl stage's
    `verifier: null`, scored by its reward model): every turn's reward is 0. A judge's cache
    lives in `run_dir`. A kind served by a process (`stages.lib.env.served`) starts it here:
    the function has a `close()` that stops it (`environments` calls it)."""
    from stages.lib.verify import make_verifier

    score = make_verifier(verifier, run_dir) if verifier is not None else _no_reward
    if cfg is None:
        return lambda: single_turn(score)
    if cfg.url:
        url = cfg.url.rstrip("/")
        return lambda: HTTPEnvironment(url, cfg.timeout_s)
    from stages.lib.env.served import served

    process = served(cfg)  # a kind served by a process the stage starts (verifiers)
    if process is not None:
        return process
    assert cfg.kind is not None
    if cfg.kind in BUILT_IN:
        built = BUILT_IN[cfg.kind]
        options = dict(cfg.config)
        built.factory(score, **options)  # a wrong option fails here, before any episode
        return lambda: built.factory(score, **options)
    module_name, _, attr = cfg.kind.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment '{cfg.kind}': cannot load it ({exc})") from exc
    options = dict(cfg.config)
    try:
        cls(**options)
    except Exception as exc:
        raise ValueError(
            f"environment '{cfg.kind}': cannot build it with config {options} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return lambda: cls(**options)  # type: ignore[no-any-return]


@contextlib.contextmanager
def environments(
    cfg: EnvironmentConfig | None, verifier: Verifier | None, run_dir: str | None = None
) -> Iterator[Callable[[], Environment]]:
    """`environment_factory` for the span of a stage's episodes: a process it started
    (a served kind's) is stopped on the way out, whether the body returns, raises or is
    interrupted."""
    make_env = environment_factory(cfg, verifier, run_dir)
    try:
        yield make_env
    finally:
        close_environments(make_env)


def close_environments(make_env: Callable[[], Environment]) -> None:
    """Stop the process behind `make_env`, if one serves it."""
    close = getattr(make_env, "close", None)
    if close is not None:
        close()


def check_failures(failed: int, total: int, cfg: EnvironmentConfig | None, where: str) -> None:
    """Raise when the failed share of `total` episodes is above the config's threshold."""
    limit = cfg.max_failed_share if cfg is not None else 0.0
    if total and failed / total > limit:
        raise RuntimeError(
            f"{where}: {failed} of {total} episodes failed ({failed / total:.0%}), above "
            f"environment.max_failed_share ({limit:.0%}); the first reasons are in the log"
        )
