"""Preference pairs from one prompt's kept rollouts (`pairs: true`): the rows the rules kept in,
pair rows out.

Input: one prompt's group of `Row`s, as the rules left it, and `pairs_per_prompt`. Output:
what the filter writes for the group: its kept lines as they were read, or with `pairs: true`
one JSON line per pair, in the explicit-prompt shape of `stages.lib.io.preference`:
`{"prompt_idx", "prompt" (the rollout's prompt text or messages), "chosen", "rejected"
(completions), "chosen_reward", "rejected_reward", "chosen_sample_idx",
"rejected_sample_idx"}`, plus the rollout's `answer` when it has one. An episode (collect
with an environment) pairs as whole conversations (`chosen` and `rejected` its messages up to
its last assistant turn, no `prompt`).

Pairing: the i-th best-scored row against the i-th worst (ties: lower `sample_idx` first),
for i from 0 while the first scores above the second, so no row is in two pairs; two rows
whose completions are the same text make no pair. A prompt whose rows all scored the same
makes none. With k samples per prompt that is at most k // 2 pairs, `pairs_per_prompt` at
most.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from stages.filter.rows import FilterInputError, Row, completion_text


def _conversation(row: Row) -> list[Any]:
    messages = list(row.data.get("messages") or [])
    while messages and not (
        isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
    ):
        messages.pop()
    if not messages:
        raise FilterInputError(f"byte {row.offset}: an episode with no assistant turn to pair")
    return messages


def _is_episode(row: Row) -> bool:
    return "completion" not in row.data and "turns" in row.data


def pair_row(chosen: Row, rejected: Row) -> dict[str, Any]:
    """The pair row of two rollouts of one prompt (module docstring)."""
    out: dict[str, Any] = {"prompt_idx": chosen.prompt_idx}
    if _is_episode(chosen) and _is_episode(rejected):
        out.update(chosen=_conversation(chosen), rejected=_conversation(rejected))
    else:
        for row in (chosen, rejected):
            if not isinstance(row.data.get("completion"), str):
                raise FilterInputError(f"byte {row.offset}: no string 'completion' to pair")
        data = chosen.data
        prompt = data["prompt"] if "prompt" in data else data.get("messages")
        if prompt is not None:
            out["prompt"] = prompt
        out.update(chosen=data["completion"], rejected=rejected.data["completion"])
    out.update(
        chosen_reward=chosen.reward,
        rejected_reward=rejected.reward,
        chosen_sample_idx=chosen.sample_idx,
        rejected_sample_idx=rejected.sample_idx,
    )
    if "answer" in chosen.data:
        out["answer"] = chosen.data["answer"]
    return out


def make_pairs(group: list[Row], most: int) -> list[dict[str, Any]]:
    """Up to `most` pair rows from one prompt's rows (module docstring)."""
    best = sorted(group, key=lambda r: (-r.reward, r.sample_idx))
    worst = sorted(group, key=lambda r: (r.reward, r.sample_idx))
    out: list[dict[str, Any]] = []
    for i in range(len(group) // 2):
        chosen, rejected = best[i], worst[i]
        if chosen.reward <= rejected.reward or len(out) == most:
            break
        if completion_text(chosen.data) != completion_text(rejected.data):
            out.append(pair_row(chosen, rejected))
    return out


def write_group(out: BinaryIO, kept: list[Row], pairs: int | None) -> int:
    """Write one group's output: its kept lines as read, or (`pairs`: pairs per prompt at
    most) its pair rows; the number of pairs written."""
    if pairs is None:
        for row in kept:
            out.write(row.line if row.line.endswith(b"\n") else row.line + b"\n")
        return 0
    made = make_pairs(kept, pairs)
    for pair in made:
        out.write(json.dumps(pair, ensure_ascii=False).encode() + b"\n")
    return len(made)
