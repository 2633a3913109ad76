"""A rollout row as the filter reads it: one JSONL line in, a `Row` out (or a located error).

Input: a line of a rollout file, its byte offset and the file's name. Output: a `Row` (the
line kept byte for byte, its parsed fields, `prompt_idx`, `sample_idx` and `reward`), and
the texts the rules compare: `completion_text` (what the model wrote, an episode's
assistant turns too) and `prompt_text`.

A row must be a JSON object with an integer `prompt_idx` and `sample_idx` and
a numeric `reward` (collect writes all three); anything else is a
`FilterInputError` naming the file and the byte offset of the line. An episode
row (collect with an environment) is one too: its `reward` is the episode's
total.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class FilterInputError(ValueError):
    """A row the filter cannot read, or a predicate it cannot load."""


@dataclass(slots=True)
class Row:
    """One rollout: where its line starts in its file, the line itself and the parsed fields."""

    offset: int
    line: bytes
    data: dict[str, Any]
    prompt_idx: int
    sample_idx: int
    reward: float


def _int_field(data: dict[str, Any], name: str, where: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FilterInputError(f"{where}: expected an integer '{name}', found {value!r}")
    return value


def parse_row(line: bytes, offset: int, source: str) -> Row:
    """Parse one JSONL line; `source` names the file in errors."""
    where = f"{source}: byte {offset}"
    try:
        data = json.loads(line.decode("utf-8"))  # str: json skips detecting the encoding
    except ValueError as exc:  # UnicodeDecodeError included
        raise FilterInputError(f"{where}: not a JSON line: {exc}") from None
    if not isinstance(data, dict):
        raise FilterInputError(f"{where}: expected a JSON object, found {type(data).__name__}")
    reward = data.get("reward")
    if not isinstance(reward, int | float) or (isinstance(reward, float) and math.isnan(reward)):
        raise FilterInputError(f"{where}: expected a numeric 'reward', found {reward!r}")
    return Row(
        offset,
        line,
        data,
        _int_field(data, "prompt_idx", where),
        _int_field(data, "sample_idx", where),
        float(reward),
    )


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def completion_text(data: dict[str, Any]) -> str:
    """What the model wrote in a row: its `completion`, or an episode's assistant turns one
    after another (collect with an environment writes `messages` and `turns` instead)."""
    messages = data.get("messages")
    if "completion" not in data and "turns" in data and isinstance(messages, list):
        return "\n".join(
            _text(m.get("content"))
            for m in messages
            if isinstance(m, dict) and m.get("role") == "assistant"
        )
    return _text(data.get("completion"))


def prompt_text(data: dict[str, Any]) -> str:
    """The prompt a row answers: `prompt`, else its `messages`, else its `prompt_idx`."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{_text(m.get('role'))}\x1f{_text(m.get('content'))}")
            else:
                parts.append(_text(m))
        return "\x1e".join(parts)
    return f"\x00prompt_idx {data.get('prompt_idx')}"
