"""The rl stage's prompts: rows, their prompts, the batch of each step, and the probe.

Input: a prompt JSONL (rows with `messages` or a `prompt` string, or NeMo Gym's rows with
`responses_create_params`, whose `input` is the prompt; every other field is kept for the
verifier). Output: `Prompts` (rows and prompts), `Stream` (the prompt
indices of step k: each epoch a fresh permutation from the seed, so a resumed run
takes exactly the batches it had not trained on), and the probe sample.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stages.lib.chat.prompt import Prompt
from stages.lib.io.jsonl import read_jsonl


@dataclass(frozen=True)
class Prompts:
    rows: list[dict[str, Any]]
    prompts: list[Prompt]


def load_prompts(path: str, limit: int | None = None) -> Prompts:
    """Rows of `path` (at most `limit`) and the prompt of each."""
    rows: list[dict[str, Any]] = []
    for n, row in enumerate(read_jsonl(path), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not (
            isinstance(row.get("messages"), list)
            or isinstance(row.get("prompt"), str)
            or isinstance(row.get("responses_create_params"), dict)
        ):
            raise ValueError(
                f"{path}:{n}: a row needs 'messages', a string 'prompt' or NeMo Gym's "
                "'responses_create_params'"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompt rows")
    return Prompts(rows, [_prompt(r) for r in rows])


def _prompt(row: dict[str, Any]) -> Prompt:
    if "messages" in row:
        return row["messages"]  # type: ignore[no-any-return]
    if "prompt" in row:
        return row["prompt"]  # type: ignore[no-any-return]
    from stages.lib.env.responses import input_messages

    return input_messages(row["responses_create_params"])


class Stream:
    """Which prompts step k (1-based) uses: `batch` of them, epoch after epoch."""

    def __init__(self, size: int, batch: int, seed: int) -> None:
        self.size, self.batch, self.seed = size, min(batch, size), seed
        self._orders: dict[int, list[int]] = {}

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.batch

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            random.Random(self.seed * 7_919 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        return self._order(epoch)[k * self.batch : (k + 1) * self.batch]

    def refill(self, step: int, round_: int, count: int, exclude: Sequence[int]) -> list[int]:
        """Dynamic sampling's further prompts for step k's round `round_` (>= 1): `count` of
        them (fewer when the prompts run out), none of `exclude`, drawn by a seed of their
        own, so the steps' own prompts (`indices`) stay what they are without refills."""
        taken = set(exclude)
        rest = [i for i in range(self.size) if i not in taken]
        rng = random.Random((self.seed * 7_919 + step) * 104_729 + round_)
        return rng.sample(rest, min(count, len(rest)))


def probe_ids(tokenizer: Any, prompt: Prompt, answer: str) -> tuple[tuple[int, ...], int]:
    """A fixed probe: the first prompt and its reference answer as the chat template renders
    the conversation (the answer closed as the template closes it: a one-turn SFT row's ids,
    `stages.lib.chat.turns.render_turns`), and where the answer starts."""
    from stages.lib.chat.prompt import as_messages
    from stages.lib.chat.turns import render_turns

    messages = [*as_messages(prompt), {"role": "assistant", "content": answer}]
    turns = render_turns(tokenizer, [messages])[0]
    span = turns.spans[-1]
    return turns.ids, span[0] if span is not None else len(turns.ids)
