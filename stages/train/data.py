"""Training rows -> tokenized examples: prompts, targets, DPO pairs, response-only labels.

Input: JSONL rows, either rollouts from collect/filter (`messages` or `prompt`,
plus `completion` and `reward`, `prompt_idx`, `sample_idx`) or dataset prompt
rows (`prompt` or `messages`, plus `answer`).
Output: `Example`s, each the token ids of one sequence (prompt, then response,
then the tokenizer's end-of-sequence token) and the prompt's length; the loss
is taken on the response tokens only. For `algorithm: dpo`, `dpo_pairs` names
the (chosen, rejected) rows.

The prompt goes through the shared chat template (`stages.lib.prompt.format_prompt`),
so training sees exactly the text generation will continue from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


class DataError(ValueError):
    """A training row that cannot be used, named by its line in the input file."""


@dataclass(frozen=True)
class Sample:
    """One training text pair before tokenization."""

    prompt: str | list[dict[str, str]]
    target: str


@dataclass(frozen=True)
class Example:
    """One tokenized sequence: prompt tokens, then response tokens ending with EOS."""

    input_ids: tuple[int, ...]
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def labels(self) -> list[int]:
        """Token ids to predict, -100 on the prompt (masked out of the loss)."""
        return [-100] * self.prompt_len + list(self.input_ids[self.prompt_len :])


def read_rows(path: str) -> list[Row]:
    """Every row of a JSONL file (blank lines skipped); a bad line is a `DataError`."""
    from stages.lib.jsonl import read_jsonl

    return list(read_jsonl(path, DataError))


def prompt_of(row: Row) -> str | list[dict[str, str]]:
    """The row's prompt: its chat `messages` (without a trailing assistant turn), or `prompt`."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        if messages[-1].get("role") == "assistant" and "completion" not in row:
            messages = messages[:-1]
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    raise DataError("has neither 'messages' nor a string 'prompt'")


def target_of(row: Row, target: str) -> str:
    """The text to learn: the row's `completion` (or final assistant turn), or its `answer`."""
    if target == "answer":
        if row.get("answer") is None:
            raise DataError("has no 'answer' (target: answer)")
        return str(row["answer"])
    if isinstance(row.get("completion"), str):
        return str(row["completion"])
    messages = row.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
        return str(messages[-1]["content"])
    raise DataError("has no 'completion' (target: completion; use target: answer for gold answers)")


def samples_of(rows: Sequence[Row], target: str, path: str = "input") -> list[Sample]:
    """One `Sample` per row; a row that lacks a field raises `DataError` naming it."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(Sample(prompt_of(row), target_of(row, target)))
        except DataError as e:
            raise DataError(f"{path}: row {i + 1} {e}") from None
    return out


def _group_key(row: Row) -> str:
    if "prompt_idx" in row:
        return f"idx:{row['prompt_idx']}"
    return "prompt:" + json.dumps(prompt_of(row), sort_keys=True)


def dpo_pairs(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """(chosen, rejected) row indices: rollouts of one prompt whose rewards differ.

    Prompts are taken in order of first appearance (grouped by `prompt_idx`, or
    by the prompt itself when absent). Within a prompt the rollouts are ranked by
    reward (highest first, then `sample_idx`, then file order) and every
    higher-rewarded one is paired with every lower-rewarded one; pairs whose two
    completions are the same text, and repeated (chosen, rejected) texts, are skipped.
    """
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row.get("reward"), int | float):
            raise DataError(f"row {i + 1} has no numeric 'reward' (algorithm: dpo)")
        groups.setdefault(_group_key(row), []).append(i)
    pairs: list[tuple[int, int]] = []
    for members in groups.values():
        ranked = sorted(
            members, key=lambda i: (-float(rows[i]["reward"]), rows[i].get("sample_idx", 0), i)
        )
        seen: set[tuple[str, str]] = set()
        for a, chosen in enumerate(ranked):
            for rejected in ranked[a + 1 :]:
                if float(rows[chosen]["reward"]) <= float(rows[rejected]["reward"]):
                    continue
                texts = (str(rows[chosen]["completion"]), str(rows[rejected]["completion"]))
                if texts[0] == texts[1] or texts in seen:
                    continue
                seen.add(texts)
                pairs.append((chosen, rejected))
    return pairs


def tokenize(samples: Sequence[Sample], tokenizer: Any, max_length: int) -> list[Example]:
    """Token ids of `format_prompt(prompt) + target + EOS`, cut to `max_length` tokens.

    A sequence longer than `max_length` loses the end of its response; one whose
    prompt alone fills `max_length` keeps no response token (`response_len == 0`)
    and is left out of training by the caller.
    """
    from stages.lib.prompt import format_prompt

    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no end-of-sequence token")
    eos = int(tokenizer.eos_token_id)
    if not samples:
        return []
    prompts = [format_prompt(tokenizer, s.prompt) for s in samples]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    t_ids = tokenizer([s.target for s in samples], add_special_tokens=False)["input_ids"]
    out = []
    for p, t in zip(p_ids, t_ids, strict=True):
        ids = (list(p) + list(t) + [eos])[:max_length]
        out.append(Example(tuple(ids), min(len(p), len(ids))))
    return out


@dataclass(frozen=True)
class TrainingSet:
    """Tokenized sequences and the units trained on (SFT: one sequence; DPO: chosen, rejected)."""

    examples: list[Example]
    units: list[tuple[int, ...]]
    dropped: int  # rows (SFT) or pairs (DPO) whose prompt alone filled max_length


def training_set(
    rows: Sequence[Row], tokenizer: Any, *, algorithm: str, target: str, max_length: int
) -> TrainingSet:
    """The examples and units of `rows` for `algorithm` (sft or dpo)."""
    if algorithm == "dpo":
        pairs = dpo_pairs(rows)
        if not pairs:
            raise DataError("no DPO pairs: no prompt has rollouts whose rewards differ")
        flat = [rows[i] for pair in pairs for i in pair]
        examples = tokenize(samples_of(flat, "completion"), tokenizer, max_length)
        kept = [
            k
            for k in range(len(pairs))
            if min(examples[2 * k].response_len, examples[2 * k + 1].response_len) > 0
        ]
        seqs = [examples[i] for k in kept for i in (2 * k, 2 * k + 1)]
        units: list[tuple[int, ...]] = [(2 * j, 2 * j + 1) for j in range(len(kept))]
        return TrainingSet(seqs, units, len(pairs) - len(kept))
    examples = tokenize(samples_of(rows, target), tokenizer, max_length)
    seqs = [ex for ex in examples if ex.response_len > 0]
    return TrainingSet(seqs, [(i,) for i in range(len(seqs))], len(examples) - len(seqs))
