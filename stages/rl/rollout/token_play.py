"""The rl stage's episodes at the level of tokens: what the engine saw and wrote, turn by turn.

Input: the engine (local, vLLM or the pool of both: `generate(prompts, num_samples, ...)`
with token ids and behaviour log-probabilities), its tokenizer, one environment per
episode, the step's rows and the sampling settings. Output: per row, its group of
`Trace`s: the episode (messages, per-turn rewards) and its token sequence with the loss
mask (1 for the model's own tokens, 0 for an observation's) and the behaviour
log-probabilities (0.0 at observation tokens, which carry no loss).

Turn 1 asks the engine for `num_samples` answers to the row's opening (the group shares
its prompt and the engine's prefix cache), exactly as a one-turn rollout does; a group
whose episodes opened differently asks once per episode. The environment's calls of a
turn run concurrently (`concurrency` at once). An episode ends when the environment says
done, at `max_turns`, or when its tokens reach `max_length` (what is past it is cut, as a
one-turn rollout cuts it).

How each later turn is asked (`multi_turn_tokens`), and so which ids are trained:

- `extend` (the default; token-in, token-out, as NeMo RL requires and verl's and SkyRL's
  agent loops do): the next turn's prompt is the ids so far, the opening's, then each turn's
  ids exactly as sampled (the closing token the engine stopped on included), then the
  template's rendering of only what follows them: the observation messages and the
  generation prompt (`stages.lib.chat.turns.follow_ids`; the text after the closing token,
  ChatML's and Gemma's newline, opens it; an answer cut at `max_new_tokens` or stopped on
  another end-of-sequence id gets the template's closing there). Every turn's prompt begins
  with every id before it; every sampled id is trained with its behaviour log-prob; the
  observation's and template's ids never are. The sequence is what the engine saw, which
  need not be `apply_chat_template(messages)` where the template rewrites an answer (Llama 3's
  and Gemma's `| trim`, text that re-tokenises otherwise).
- `rerender`: the next turn is asked from the chat template's rendering of the conversation
  so far with the generation prompt (`stages.lib.chat.turns.render_turns`): the prompt a chat
  server, evaluate and collect give the model for that conversation, so the sequence up to
  the newest answer is `apply_chat_template(messages)`, whatever whitespace was sampled. The
  newest answer keeps the engine's ids and log-probs; an earlier answer's tokens in the
  rendering are trained, with the log-probs they were sampled with, as far as they are the
  sampled ids (the longest prefix they share: all of it when the template reproduces it;
  its content without the closing when it was cut or stopped on another end-of-sequence id;
  what comes before the first token the template rewrote); the rest of the rendering stays
  in the sequence outside the loss (mask 0, behaviour log-prob 0.0). An episode whose
  answers render as sampled is `apply_chat_template(messages)` token for token, less the
  text after the last closing token.

In both, no token is trained that the engine did not sample in that context, and a one-turn
rollout is the engine's answer, number for number. An observation the template cannot
render (Gemma and Mistral refuse a `system` message after the first turn) fails its episode
with the template's message, as a broken environment does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stages.lib.chat.prompt import TokenPrompt
from stages.lib.chat.tokens import answer_end
from stages.lib.chat.turns import common_prefix, follow_ids, render_turns
from stages.lib.env.contract import Environment, Episode, take_turn
from stages.lib.env.message_play import open_all


@dataclass
class Trace:
    """One episode and its tokens: `ids[:prompt_len]` the opening, then turns and
    observations, `mask` and `logprobs` one per token after the opening."""

    episode: Episode
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generated: int = 0  # tokens the engine produced (an answer cut by max_length included)
    pending: str = ""  # the latest answer's text, for the environment's step
    cut: bool = False  # the latest answer did not fit in max_length
    answers: list[tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=list)

    def add(self, ids: Sequence[int], logprobs: Sequence[float], own: bool) -> None:
        self.ids += ids
        self.mask += [int(own)] * len(ids)
        self.logprobs += list(logprobs) if own else [0.0] * len(ids)


@dataclass(frozen=True)
class PlaySettings:
    """How a step's episodes are played: samples per prompt, sampling temperature, token and
    turn bounds, the seed, and how many play at once."""

    num_samples: int
    temperature: float
    max_new_tokens: int
    max_length: int
    seed: int
    batch_size: int
    max_turns: int
    timeout_s: float
    concurrency: int
    tokens: Literal["extend", "rerender"] = "extend"  # multi_turn_tokens (module docstring)
    parser: str | None = None  # the tool-call format, in episodes with tools


def play_batch(cfg: Any) -> int:
    """The prompts one engine call takes: the backend's `batch_size` (local), else 256."""
    return int(getattr(cfg.backend, "batch_size", 256))


def play(
    engine: Any,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    rows: Sequence[dict[str, Any]],
    s: PlaySettings,
) -> list[list[Trace]]:
    """Every row's group of episodes played to its end (module docstring)."""

    async def episodes() -> list[list[Trace]]:
        opened = await open_all(make_env, rows, s.num_samples, s.timeout_s, s.concurrency, s.parser)
        traces = [Trace(e) for e in opened]
        groups = [traces[i : i + s.num_samples] for i in range(0, len(traces), s.num_samples)]
        await _first_turn(engine, groups, s)
        for turn in range(1, s.max_turns + 1):
            if turn > 1:
                going = [t for t in traces if not t.episode.done]
                if not going:
                    break
                asked = [TokenPrompt(tuple(t.ids)) for t in going]
                gens = await _generate(engine, asked, 1, s, turn)
                for t, g in zip(going, gens, strict=True):
                    _answered(t, g[0], s)
            await _steps(tokenizer, [t for t in traces if not t.episode.done], s)
        return groups

    return asyncio.run(episodes())


async def _generate(
    engine: Any, prompts: list[Any], n: int, s: PlaySettings, turn: int
) -> list[Any]:
    """The engine's answers, in a thread: an engine may run an event loop of its own."""
    return await asyncio.to_thread(  # type: ignore[no-any-return]
        engine.generate,
        prompts,
        num_samples=n,
        temperature=s.temperature,
        max_new_tokens=s.max_new_tokens,
        seed=s.seed + 7_919 * (turn - 1),  # turn 1: the one-turn rollout's seed
        batch_size=s.batch_size,
    )


async def _first_turn(engine: Any, groups: list[list[Trace]], s: PlaySettings) -> None:
    """Turn 1: one request of `num_samples` per group sharing its opening, else one each."""
    shared = [g for g in groups if _same_opening(g)]
    single = [t for g in groups if not _same_opening(g) for t in g if not t.episode.done]
    if shared:
        opening = [g[0].episode.prompt for g in shared]
        answers = await _generate(engine, opening, s.num_samples, s, 1)
        for g, gens in zip(shared, answers, strict=True):
            for t, gen in zip(g, gens, strict=True):
                _answered(t, gen, s, first=True)
    if single:
        gens = await _generate(engine, [t.episode.prompt for t in single], 1, s, 1)
        for t, g in zip(single, gens, strict=True):
            _answered(t, g[0], s, first=True)


def _same_opening(group: list[Trace]) -> bool:
    first = group[0].episode
    return all(not t.episode.done and t.episode.messages == first.messages for t in group)


def _answered(t: Trace, gen: Any, s: PlaySettings, first: bool = False) -> None:
    """The engine's answer joins the trace (cut at `max_length`); the text goes to the step."""
    if first:
        t.ids, t.prompt_len = list(gen.prompt_ids), len(gen.prompt_ids)
    room = max(0, s.max_length - len(t.ids))
    t.add(gen.token_ids[:room], gen.logprobs[:room], own=True)
    t.generated += gen.completion_tokens
    t.pending = gen.text
    t.cut = len(gen.token_ids) > room
    t.answers.append((tuple(gen.token_ids[:room]), tuple(gen.logprobs[:room])))


async def _steps(tokenizer: Any, going: list[Trace], s: PlaySettings) -> None:
    """The environment's step for every episode answered this turn, concurrently; the
    episodes that go on take the observation's ids (`extend`) or become the template's
    rendering of their conversation (`rerender`)."""
    gate = asyncio.Semaphore(s.concurrency)

    async def one(t: Trace) -> None:
        async with gate:
            observation = await take_turn(t.episode, t.pending, s.max_turns, s.timeout_s)
        if observation is None:
            return
        if t.cut:
            t.episode.done, t.episode.end = True, "length"
            return
        go_on = retrace if s.tokens == "rerender" else extend
        try:
            ids, start, mask, logprobs = go_on(tokenizer, t)
        except Exception as exc:  # the template refuses the conversation (a role it lacks)
            t.episode.fail(f"the chat template cannot render the observation: {exc}")
            return
        if len(ids) >= s.max_length:  # no room left for the model's answer
            t.episode.done, t.episode.end = True, "length"
            return
        t.ids, t.prompt_len, t.mask, t.logprobs = ids, start, mask, logprobs

    await asyncio.gather(*(one(t) for t in going))


Tokens = tuple[list[int], int, list[int], list[float]]  # ids, prompt_len, mask, logprobs


def extend(tokenizer: Any, t: Trace) -> Tokens:
    """`t`'s ids so far followed by the template's ids of what follows its newest answer, the
    observation and the generation prompt, outside the loss (`extend`, module docstring)."""
    end = tuple(answer_end(tokenizer).ids)
    closed = bool(end) and t.answers[-1][0][-len(end) :] == end
    follow = follow_ids(tokenizer, t.episode.messages, closed, t.episode.tools)
    return (
        [*t.ids, *follow],
        t.prompt_len,
        [*t.mask, *[0] * len(follow)],
        [*t.logprobs, *[0.0] * len(follow)],
    )


def retrace(tokenizer: Any, t: Trace) -> Tokens:
    """`t` as the template's rendering of its conversation so far with the generation prompt,
    each earlier answer trained on the longest prefix of its tokens there that are the ones
    sampled (`rerender`, module docstring)."""
    turns = render_turns(
        tokenizer, [t.episode.messages], generation_prompt=True, tools=[t.episode.tools]
    )[0]
    ids = list(turns.ids)
    first = turns.spans[0] if turns.spans else None
    start = min(t.prompt_len, first[0]) if first is not None else t.prompt_len
    mask = [0] * (len(ids) - start)
    logprobs = [0.0] * len(mask)
    for span, (sampled, lps) in zip(turns.spans, t.answers, strict=False):
        if span is None:
            continue
        a, b = span
        keep = common_prefix(ids[a:b], sampled)
        for k in range(keep):
            mask[a - start + k], logprobs[a - start + k] = 1, lps[k]
    return ids, start, mask, logprobs
