"""Prompt input: a JSONL file read as a stream, one `Prompt` per row.

Input: a JSONL path (local or an fsspec URL) whose rows hold `messages`
(OpenAI chat), `prompt` (a string) or NeMo Gym's
`responses_create_params.input` (a string or a list of messages whose content
may be a list of `input_text` parts). Output: `Prompt` objects in file order,
each with its row index, the messages or text to send, and the row's other
fields pre-serialised once so every sample of the prompt reuses them.

A row that is not valid JSON or holds no prompt becomes a `Prompt` with an
`error`; the collector writes it to the failures sidecar instead of stopping.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from stages.lib.io.jsonl import open_binary

# Fields a rollout adds; an input row's own values for them are not carried through.
ROLLOUT_FIELDS = (
    "prompt_idx",
    "sample_idx",
    "completion",
    "reward",
    "finish_reason",
    "usage",
    "latency_s",
)
_RESERVED = frozenset(ROLLOUT_FIELDS)
# Fields an episode row adds (`stages.collect.multiturn`); `messages` becomes the conversation.
EPISODE_FIELDS = frozenset(
    (*ROLLOUT_FIELDS, "messages", "rewards", "total_reward", "turns", "solved", "end", "error")
)


class Prompt:
    """One input row: what to send, and the fields carried into each rollout."""

    __slots__ = ("error", "frag", "idx", "messages", "parsed", "request", "row", "text")

    def __init__(
        self, idx: int, row: dict[str, Any], error: str | None = None, *, parsed: bool = True
    ) -> None:
        self.idx = idx
        self.row = row
        self.error = error
        self.parsed = parsed  # False: the line is not a JSON object (`row` holds it as "raw")
        self.messages: list[dict[str, str]] | None = None
        self.text: str | None = None
        self.frag = ""
        # (url, body prefix) chosen by the client once per prompt.
        self.request: tuple[str, str] | None = None


def parse_row(idx: int, line: str | bytes) -> Prompt:
    """Parse one JSONL line into a Prompt (with `error` set when unusable)."""
    try:
        text = line.decode() if isinstance(line, bytes) else line
        row = json.loads(text)
    except ValueError as exc:
        raw = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        return Prompt(idx, {"raw": raw[:500]}, f"bad_row: not valid JSON ({exc})", parsed=False)
    if not isinstance(row, dict):
        return Prompt(idx, {"raw": row}, "bad_row: a row must be a JSON object", parsed=False)
    if _RESERVED.isdisjoint(row):
        # the row's own text is its fields' JSON: no need to serialise them again
        inner = text.strip()[1:-1].strip()
        return prompt_from_row(idx, row, frag=f"{inner}, " if inner else "")
    return prompt_from_row(idx, row)


def prompt_from_row(idx: int, row: dict[str, Any], frag: str | None = None) -> Prompt:
    """A Prompt from a parsed row (with `error` set when it holds no usable prompt).

    `frag` is the JSON of the row's carried fields without braces, plus ", "
    (computed here when not given).
    """
    prompt = Prompt(idx, row)
    try:
        _fill(prompt, row)
    except ValueError as exc:
        prompt.error = f"bad_row: {exc}"
    if frag is None:
        carried = {k: v for k, v in row.items() if k not in _RESERVED}
        frag = json.dumps(carried, ensure_ascii=False)[1:-1] + ", " if carried else ""
    prompt.frag = frag
    return prompt


def _fill(prompt: Prompt, row: dict[str, Any]) -> None:
    if "messages" in row:
        prompt.messages = _messages(row["messages"])
    elif "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError("'prompt' must be a string")
        prompt.text = row["prompt"]
    elif isinstance(row.get("responses_create_params"), dict):
        params = row["responses_create_params"]
        given = params.get("input")
        if isinstance(given, str):
            prompt.messages = [{"role": "user", "content": given}]
        else:
            prompt.messages = _messages(given)
        if isinstance(params.get("instructions"), str):
            prompt.messages.insert(0, {"role": "system", "content": params["instructions"]})
    else:
        raise ValueError("the row has none of 'messages', 'prompt', 'responses_create_params'")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ValueError("each message needs a 'role' and a 'content'")
        out.append({"role": item["role"], "content": _content(item.get("content"))})
    return out


def _content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [p.get("text") for p in value if isinstance(p, dict)]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(p for p in parts if isinstance(p, str))
    raise ValueError("a message's 'content' must be a string or a list of text parts")


def iter_lines(path: str, start: int, end: int | None) -> Iterator[tuple[int, bytes]]:
    """(row index, line) for rows start <= index < end; blank lines are not rows."""
    idx = 0
    with open_binary(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            if end is not None and idx >= end:
                return
            if idx >= start:
                yield idx, line
            idx += 1


def row_range(start: int, end: int | None, limit: int | None) -> tuple[int, int | None]:
    """The [start, end) prompt range from start_idx, end_idx and limit."""
    if limit is not None:
        end = start + limit if end is None else min(end, start + limit)
    return start, end
