"""Preference pairs as files hold them: the row shapes read, checked and split.

Input: JSONL (or parquet, Hugging Face) rows with `chosen` and `rejected`, and optionally a
shared `prompt`. Output: `pair_problem(row)` (what is wrong with a row, or None),
`check_pair_rows` (the first bad row, by number), `pair_parts(row)` (prompt, chosen,
rejected), `pair_prompt_key(row)` (what decides that two pairs ask the same thing) and
`check_pairs_file`, the plan-time check of a file that already exists.

The shapes read, as Anthropic HH, UltraFeedback-binarized, TRL's and OpenRLHF's
preference data come:

- implicit prompt, text: `{"chosen": "Human: ... Assistant: A", "rejected": "... B"}`, each the
  whole text scored as it is (HH);
- implicit prompt, messages: `{"chosen": [user, assistant], "rejected": [user, assistant]}`,
  each a whole conversation ending with an assistant turn;
- explicit prompt: `{"prompt": TEXT or [messages], "chosen": ANSWER, "rejected": ANSWER}`, an
  answer being text or assistant messages; a chosen conversation that starts with a
  non-assistant message already holds its prompt (UltraFeedback-binarized: `prompt` is then
  its first user turn and is not put in front again).

The filter stage's `pairs: true` writes the explicit form (`stages.filter.pairs`). Nothing
heavy is imported: `pipe validate` calls `check_pairs_file`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.errors import Diagnostic
    from engine.stage import ResolveContext

Messages = list[dict[str, str]]
Text = str | Messages
PLAN_ROWS = 1000  # rows of an existing file checked at plan time; the rest at run time


class PairError(ValueError):
    """A pair row that cannot be used, named by its row number."""


def is_pair_row(row: dict[str, Any]) -> bool:
    """A row meant as a preference pair (it has `chosen` or `rejected`)."""
    return "chosen" in row or "rejected" in row


def _messages_problem(value: list[Any], name: str, *, last_assistant: bool) -> str | None:
    if not value:
        return f"'{name}' is an empty list"
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            return f"'{name}[{i}]' is not a message (an object with 'role' and 'content')"
        if not isinstance(m.get("content"), str):
            return f"'{name}[{i}]' has no string 'content'"
    if last_assistant and value[-1]["role"] != "assistant":
        return f"'{name}' does not end with an assistant message (found '{value[-1]['role']}')"
    return None


def pair_problem(row: dict[str, Any]) -> str | None:
    """What keeps `row` from being a preference pair, or None when it is one."""
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        return (
            f"has no {' and no '.join(repr(k) for k in missing)} (a preference pair needs "
            "'chosen' and 'rejected', each text or messages; 'prompt' optional)"
        )
    for name in ("chosen", "rejected"):
        value = row[name]
        if isinstance(value, str):
            if not value and row.get("prompt") is None:  # with a prompt: an empty answer
                return f"'{name}' is empty (and there is no 'prompt' it answers)"
        elif isinstance(value, list):
            problem = _messages_problem(value, name, last_assistant=True)
            if problem:
                return problem
        else:
            return f"'{name}' is {type(value).__name__}, not text or a list of messages"
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        if not isinstance(prompt, list):
            return f"'prompt' is {type(prompt).__name__}, not text or a list of messages"
        return _messages_problem(prompt, "prompt", last_assistant=False)
    return None


def check_pair_rows(rows: Iterable[dict[str, Any]], where: str, limit: int | None = None) -> int:
    """Raise `PairError` naming the first row (1-based) of `rows` that is no pair; the number
    of rows checked (at most `limit`)."""
    n = 0
    for n, row in enumerate(rows, start=1):
        problem = pair_problem(row)
        if problem:
            raise PairError(f"{where}: row {n} {problem}")
        if limit is not None and n >= limit:
            break
    return n


def holds_prompt(response: Text) -> bool:
    """A response that already holds its prompt: a conversation that starts with a
    non-assistant message (a row's `prompt` is then not put in front of it)."""
    return isinstance(response, list) and response[0]["role"] != "assistant"


def pair_parts(row: dict[str, Any]) -> tuple[Text | None, Text, Text]:
    """(prompt, chosen, rejected) of a pair row (checked by `pair_problem`); the prompt None
    for an implicit one (each response whole)."""
    return row.get("prompt"), row["chosen"], row["rejected"]


def pair_prompt_key(row: dict[str, Any]) -> str:
    """What decides that two pairs ask the same thing (a split keeps each on one side): the
    prompt, else what chosen and rejected begin with in common (TRL's implicit prompt)."""
    prompt, chosen, rejected = pair_parts(row)
    if prompt is not None:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        return chosen[:n]
    if isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        return json.dumps(chosen[:n], sort_keys=True)
    return json.dumps([chosen, rejected], sort_keys=True)


def check_pairs_file(
    ctx: ResolveContext, field: str, path: str | None, *, rollouts_too: bool = False
) -> list[Diagnostic]:
    """Plan time: the first `PLAN_ROWS` rows of `path`, when it is a local file that exists
    now (an earlier stage's output is checked when it is read), must be preference pairs
    (`rollouts_too`: or, judged by the first row, rollouts with a numeric `reward`, paired by
    the reader)."""
    from stages.lib.io.jsonl import read_jsonl

    if not path or ctx.is_produced(path) or "://" in path or not os.path.isfile(path):
        return []
    try:
        rows = []
        for row in read_jsonl(path):
            rows.append(row)
            if len(rows) >= PLAN_ROWS:
                break
        if rollouts_too and rows and not is_pair_row(rows[0]):
            if not isinstance(rows[0].get("reward"), int | float):
                return [
                    ctx.error(
                        field,
                        f"'{path}' row 1 is neither a preference pair ('chosen' and "
                        "'rejected') nor a scored rollout (a numeric 'reward')",
                    )
                ]
            return []
        check_pair_rows(rows, f"'{path}'")
    except (PairError, ValueError) as e:
        return [ctx.error(field, str(e))]
    return []
