"""The judge's prompt, and its answer read into a reward.

Input: the verifier's template, score rule (`score_regex`'s first group, or
`score_json_field` of the first JSON object in the answer) and `score_range`; a row and a
completion. Output: the prompt sent to the judge (`render`), and the reward in [0, 1]
(`read_score`: the score mapped linearly from [lo, hi], clipped) or None when the answer holds
no score.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stages.lib.config import Verifier


def question_of(row: dict[str, Any]) -> str:
    """What the policy was asked: the row's `prompt` string, else `question`, else the last
    user message's content."""
    for field in ("prompt", "question"):
        if isinstance(row.get(field), str):
            return str(row[field])
    messages = row.get("messages") or row.get("prompt")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return str(message.get("content") or "")
    return ""


def render(cfg: Verifier, row: dict[str, Any], completion: str) -> str:
    """The judge's prompt for one answer; `{reference}` is the row's `answer_field` ("" when
    the row has none)."""
    assert cfg.template is not None
    reference = row.get(cfg.answer_field)
    return cfg.template.format(
        question=question_of(row),
        answer=completion,
        reference="" if reference is None else str(reference),
    )


def read_score(cfg: Verifier, text: str) -> float | None:
    """The judge's score in its answer, mapped onto [0, 1]; None: no score found."""
    raw = _raw_score(cfg, text)
    if raw is None:
        return None
    lo, hi = cfg.score_range
    return min(1.0, max(0.0, (raw - lo) / (hi - lo)))


def _raw_score(cfg: Verifier, text: str) -> float | None:
    if cfg.score_regex is not None:
        found = re.search(cfg.score_regex, text)
        return _number(found.group(1)) if found else None
    assert cfg.score_json_field is not None
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return _number(value.get(cfg.score_json_field))
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None
