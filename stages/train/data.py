"""Training rows -> tokenized examples: prompts, targets, DPO pairs, response-only labels.

Input: JSONL rows, either rollouts from collect/filter (`messages` or `prompt`,
plus `completion` and `reward`, `prompt_idx`, `sample_idx`), conversations (a
`messages` list ending with an assistant turn and no `completion`: collect's
episode rows, or chat data), or dataset prompt rows (`prompt` or `messages`, plus
`answer`).
Output: `Example`s, each the token ids of one sequence (prompt, then response,
then the token(s) the chat template closes an answer with: `stages.lib.chat.tokens.answer_end`,
`<|im_end|>` for ChatML whatever its `eos_token`) and the prompt's length; the loss
is taken on the response tokens only. A conversation trains on every assistant
turn (its content and closing token); the system, user and environment
messages between them are masked out like a prompt. For `algorithm: dpo`,
`dpo_pairs` names the (chosen, rejected) rows. A failed episode (`end: failed`)
is left out: its conversation broke off. `algorithm: rm` reads its pairs in
`stages.train.pairwise` (rollouts paired as DPO pairs them, with `dpo_pairs`).

A row's sequence is the chat template's rendering of its whole conversation
(`apply_chat_template`, `stages.lib.chat.turns.render_turns`): the prompt as generation
continues from it, each assistant turn as the template writes it (Llama 3's and Gemma's
templates trim an answer's surrounding whitespace: the trimmed text is what is trained), the
messages between turns as the model saw them when it answered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


class DataError(ValueError):
    """A training row that cannot be used, named by its line in the input file."""


Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Sample:
    """One training text pair before tokenization; a conversation's later assistant turns,
    each with the messages before it since the previous one, follow in `later`. A
    conversation with tool calls keeps its messages as they are (`conversation`: assistant
    turns with their `tool_calls`, `tool` messages), and `tools` are the function schemas the
    chat template renders (a row's `tools`, as OpenAI-format datasets carry them)."""

    prompt: str | Messages
    target: str
    later: tuple[tuple[Messages, str], ...] = ()
    conversation: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()

    def texts(self) -> list[str]:
        """Every text in the sample (to train a fresh tokenizer on)."""
        out = [self.prompt] if isinstance(self.prompt, str) else [m["content"] for m in self.prompt]
        out.append(self.target)
        for between, turn in self.later:
            out += [m["content"] for m in between] + [turn]
        out += [json.dumps(m["tool_calls"]) for m in self.conversation if m.get("tool_calls")]
        out += [json.dumps(t) for t in self.tools]
        return out


@dataclass(frozen=True)
class Example:
    """One tokenized sequence: prompt tokens, then response tokens ending with EOS; a
    conversation's trained [start, end) token ranges (its assistant turns) in `spans`."""

    input_ids: tuple[int, ...]
    prompt_len: int
    spans: tuple[tuple[int, int], ...] = ()  # empty: one response, prompt_len to the end

    def trained(self) -> tuple[tuple[int, int], ...]:
        """The [start, end) ranges of tokens the loss is taken on."""
        return self.spans or ((self.prompt_len, len(self.input_ids)),)

    @property
    def response_len(self) -> int:
        return sum(end - start for start, end in self.trained())

    def labels(self) -> list[int]:
        """Token ids to predict, -100 elsewhere (the prompt, a conversation's other turns)."""
        out = [-100] * len(self.input_ids)
        for start, end in self.trained():
            out[start:end] = self.input_ids[start:end]
        return out


def read_rows(path: str) -> list[Row]:
    """Every row of a JSONL file (blank lines skipped); a bad line is a `DataError`."""
    from stages.lib.io.jsonl import read_jsonl

    return list(read_jsonl(path, DataError))


def _messages(value: list[Any]) -> Messages:
    """Chat messages checked, OpenAI's tool calls and tool messages kept
    (`stages.lib.env.messages.message_of`); a malformed one raises DataError."""
    from stages.lib.env.messages import EpisodeFailed, message_of

    def shown(m: Any) -> Any:  # a number as content is its text, as before
        if isinstance(m, dict) and m.get("content") is not None:
            return {**m, "content": str(m["content"])}
        return m

    try:
        return [message_of(shown(m), "the row") for m in value]
    except EpisodeFailed as exc:
        raise DataError(f"has a message that is not OpenAI's: {exc}") from None


def _tools(row: Row) -> tuple[dict[str, Any], ...]:
    """The row's `tools` (OpenAI function schemas), checked; none when it has none."""
    from stages.lib.env.messages import EpisodeFailed, tools_of

    if not row.get("tools"):
        return ()
    try:
        return tuple(tools_of(row["tools"], "the row"))
    except EpisodeFailed as exc:
        raise DataError(f"has tools that are not OpenAI's function schemas: {exc}") from None


def is_conversation(row: Row) -> bool:
    """A row whose `messages` end with an assistant turn and that has no `completion`."""
    messages = row.get("messages")
    return (
        isinstance(messages, list)
        and bool(messages)
        and messages[-1].get("role") == "assistant"
        and "completion" not in row
    )


def failed_episode(row: Row) -> bool:
    """An episode whose environment broke (collect wrote it with `end: failed`)."""
    return row.get("end") == "failed" and "turns" in row


def prompt_of(row: Row) -> str | Messages:
    """The row's prompt: its chat `messages` (without a trailing assistant turn), or `prompt`."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages:
        if is_conversation(row):
            messages = messages[:-1]
        return _messages(messages)
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


def conversation_sample(messages: list[Any], tools: tuple[dict[str, Any], ...] = ()) -> Sample:
    """A conversation as a `Sample`: the messages before its first assistant turn are the
    prompt, that turn the target, and every later assistant turn follows with the messages
    before it since the previous one; one with tools or tool calls keeps its messages whole
    (`Sample.conversation`)."""
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    every = _messages(messages)
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in every):
        plain = [m for m in every if m["role"] == "assistant"]
        return Sample(every[:first], plain[0]["content"], (), tuple(every), tools)
    turns: list[tuple[Messages, str]] = []
    between: Messages = []
    for m in _messages(messages[first + 1 :]):
        if m["role"] == "assistant":
            turns.append((between, m["content"]))
            between = []
        else:
            between.append(m)
    head = _messages(messages[: first + 1])
    return Sample(head[:-1], head[-1]["content"], tuple(turns))


def sample_of(row: Row, target: str) -> Sample:
    """The row as a `Sample` (a conversation, with target completion, with all its turns)."""
    if target == "completion" and is_conversation(row):
        return conversation_sample(row["messages"], _tools(row))
    return Sample(prompt_of(row), target_of(row, target), tools=_tools(row))


def samples_of(rows: Sequence[Row], target: str, path: str = "input") -> list[Sample]:
    """One `Sample` per row, failed episodes left out; a row that lacks a field raises
    `DataError` naming it."""
    out = []
    for i, row in enumerate(rows):
        if failed_episode(row):
            continue
        try:
            out.append(sample_of(row, target))
        except DataError as e:
            raise DataError(f"{path}: row {i + 1} {e}") from None
    return out


def _group_key(row: Row) -> str:
    if "prompt_idx" in row:
        return f"idx:{row['prompt_idx']}"
    return "prompt:" + json.dumps(prompt_of(row), sort_keys=True)


def _answer_text(row: Row) -> str:
    """A rollout's completion, or a conversation's messages (to tell two answers apart)."""
    if isinstance(row.get("completion"), str):
        return str(row["completion"])
    return json.dumps(row.get("messages"), sort_keys=True)


def dpo_pairs(rows: Sequence[Row], algorithm: str = "dpo") -> list[tuple[int, int]]:
    """(chosen, rejected) row indices: rollouts of one prompt whose rewards differ.

    Prompts are taken in order of first appearance (grouped by `prompt_idx`, or
    by the prompt itself when absent). Within a prompt the rollouts are ranked by
    reward (highest first, then `sample_idx`, then file order) and every
    higher-rewarded one is paired with every lower-rewarded one; pairs whose two
    completions are the same text, and repeated (chosen, rejected) texts, are skipped.
    Episodes pair the same way (by total reward; whole conversations compared), failed
    ones left out.
    """
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if failed_episode(row):
            continue
        if not isinstance(row.get("reward"), int | float):
            raise DataError(f"row {i + 1} has no numeric 'reward' (algorithm: {algorithm})")
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
                texts = (_answer_text(rows[chosen]), _answer_text(rows[rejected]))
                if texts[0] == texts[1] or texts in seen:
                    continue
                seen.add(texts)
                pairs.append((chosen, rejected))
    return pairs


def conversation_of(sample: Sample) -> Messages:
    """The sample as the chat messages it trains on: its prompt, the target as an assistant
    turn, then each later turn after the messages before it."""
    from stages.lib.chat.prompt import as_messages

    if sample.conversation:
        return [dict(m) for m in sample.conversation]
    messages = [*as_messages(sample.prompt), {"role": "assistant", "content": sample.target}]
    for between, turn in sample.later:
        messages += [*between, {"role": "assistant", "content": turn}]
    return messages


def tokenize(samples: Sequence[Sample], tokenizer: Any, max_length: int) -> list[Example]:
    """Token ids of each sample's conversation as the chat template renders it
    (`apply_chat_template` of its messages, earlier turns included, cut after the last
    turn's closing token: `stages.lib.chat.turns.render_turns`), trained on each assistant
    turn's range there (the template's text of the turn, trimmed where the template trims,
    and its closing token(s)), cut to `max_length` tokens.

    A sequence longer than `max_length` loses its end; one whose prompt alone fills
    `max_length` keeps no response token (`response_len == 0`) and is left out of
    training by the caller.
    """
    from stages.lib.chat.tokens import answer_end
    from stages.lib.chat.turns import render_turns

    if not answer_end(tokenizer).ids:
        raise DataError(
            "the tokenizer has no end-of-sequence token and its chat template ends no answer"
        )
    if not samples:
        return []
    out = []
    rendered = render_turns(
        tokenizer, [conversation_of(s) for s in samples], tools=[s.tools or None for s in samples]
    )
    for sample, turns in zip(samples, rendered, strict=True):
        ids = turns.ids[:max_length]
        spans = [s for s in turns.spans if s is not None]
        first = spans[0][0] if spans else len(turns.ids)
        if not sample.later and not sample.conversation and len(spans) == 1:
            out.append(Example(ids, min(first, len(ids))))
            continue
        cut = tuple((a, min(b, len(ids))) for a, b in spans if a < len(ids))
        out.append(Example(ids, min(first, len(ids)), cut or ((len(ids), len(ids)),)))
    return out


@dataclass(frozen=True)
class TrainingSet:
    """Tokenized sequences and the units trained on (SFT: one sequence; DPO and RM: chosen,
    rejected)."""

    examples: list[Example]
    units: list[tuple[int, ...]]
    dropped: int  # failed episodes; rows (SFT) or pairs (DPO, RM) their cut left nothing to train
    margins: tuple[float, ...] = ()  # RM: each unit's margin in the loss


def training_set(
    rows: Sequence[Row], tokenizer: Any, *, algorithm: str, target: str, max_length: int
) -> TrainingSet:
    """The examples and units of `rows` for `algorithm` (sft or dpo; rm:
    `stages.train.pairwise.reward_set`)."""
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
    return TrainingSet(seqs, [(i,) for i in range(len(seqs))], len(rows) - len(seqs))
