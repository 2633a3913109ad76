"""A conversation's token ids as its chat template renders it, and where its assistant turns are.

Input: a tokenizer with its chat template, and conversations (chat messages, the assistant's
turns among them). Output: `render_turns(tokenizer, conversations)`, for each a `Turns`: its
ids, exactly `apply_chat_template(messages, tokenize=True)` (the template's text rendered
once, tokenized once), cut after the last assistant turn's closing token (the template's
text after it, ChatML's and Gemma's newline, is never trained: `stages.lib.chat.tokens`);
with `generation_prompt=True`, the whole rendering with the generation prompt, as the next
turn's prompt. And each assistant turn's [start, end) range of those ids: the template's
text of its content and its closing token(s).

The ranges come from the template itself, not from tokenizing pieces: a turn starts where the
ids of the conversation before it (rendered with the generation prompt, what the model was
asked) stop being a prefix of the whole, and ends after the ids of the conversation up to
and including it (less the text after its closing token). So a template that rewrites a
turn's text (Llama 3's and Gemma's `| trim`) trains the rewritten text, earlier turns
included, and a token the tokenizer merges across the start of a turn (a SentencePiece
piece that takes in the turn's first word) is trained with the turn. A turn whose rendering
in the whole conversation is not the one it was answered from (templates that drop earlier
turns' reasoning) has no range: it stays in the ids, outside the loss (a warning says so
once per template).

`follow_ids(tokenizer, messages, closed)` is the other way to go on (the rl stage's
token-in, token-out mode): the ids the template renders after the conversation's last
assistant turn, up to the generation prompt, to be appended to the ids sampled so far.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stages.lib.chat.clock import render
from stages.lib.chat.tokens import answer_end

log = logging.getLogger("pipe.chat")
_warned: set[str] = set()
Messages = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class Turns:
    """A conversation's ids and each assistant turn's [start, end) range (None: the
    template renders that turn differently once the conversation goes on)."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int] | None, ...]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids `a` and `b` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(i) for i in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def render_turns(
    tokenizer: Any,
    conversations: Sequence[Messages],
    *,
    generation_prompt: bool = False,
    tools: Sequence[Sequence[dict[str, Any]] | None] | None = None,
) -> list[Turns]:
    """Each conversation's `Turns` (module docstring); the tokenizer runs once, batched.
    `tools`: each conversation's tools (OpenAI function schemas) the template renders."""
    rest = answer_end(tokenizer).rest
    texts: list[str] = []
    plans: list[list[tuple[int, bool, bool]]] = []
    for n, messages in enumerate(conversations):
        offered = tools[n] if tools is not None else None
        options: dict[str, Any] = {"tools": list(offered)} if offered else {}
        full = render(tokenizer, messages, add_generation_prompt=generation_prompt, **options)
        texts.append(full)
        turns = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            head = render(tokenizer, messages[:i], add_generation_prompt=True, **options)
            last = i == len(messages) - 1 and not generation_prompt
            upto = full if last else render(tokenizer, messages[: i + 1], **options)
            if rest and upto.endswith(rest):
                upto = upto[: len(upto) - len(rest)]
            turns.append((len(texts), full.startswith(head), full.startswith(upto)))
            texts += [head, upto]
        plans.append(turns)
    encoded = _encode(tokenizer, texts) if texts else []
    out = []
    at = 0
    for turns, messages in zip(plans, conversations, strict=True):
        ids = encoded[at]
        at += 1 + 2 * len(turns)
        spans: list[tuple[int, int] | None] = []
        for k, head_ok, upto_ok in turns:
            before, through = encoded[k], encoded[k + 1]
            start, end = common_prefix(before, ids), common_prefix(through, ids)
            if head_ok and upto_ok and end == len(through) and start < end:
                spans.append((start, end))
            else:
                spans.append(None)
                _warn(tokenizer)
        last = messages[-1].get("role") == "assistant" if messages else False
        if last and not generation_prompt and spans and spans[-1] is not None:
            ids = ids[: spans[-1][1]]
        out.append(Turns(tuple(ids), tuple(spans)))
    return out


def _warn(tokenizer: Any) -> None:
    template = str(getattr(tokenizer, "chat_template", ""))
    if template not in _warned:
        _warned.add(template)
        log.warning(
            "the chat template renders an earlier assistant turn differently once the "
            "conversation goes on: that turn is kept in the ids, outside the loss"
        )


_ANSWER = "PIPEANSWERSENTINEL7"


def follow_ids(
    tokenizer: Any,
    messages: Messages,
    closed: bool,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """The template's ids after the last assistant turn of `messages` (the observations that
    follow it, then the generation prompt), for a sequence that holds that turn as sampled.

    As NeMo RL, verl and SkyRL compute an observation's ids: the rendering of the whole
    conversation with the generation prompt, less the rendering up to the assistant turn,
    closing included (`answer_end`), tokenized alone. The turn's content is a fixed text in
    both renderings, so the answer's own text, trimmed or rewritten (Llama 3's and Gemma's
    `| trim`, a template dropping an earlier turn's reasoning), does not move the split.
    `closed`: the sampled ids end with the template's closing ids, so the text after the
    closing token (ChatML's and Gemma's newline) starts the result; otherwise (cut at the
    answer's bound, stopped on another end-of-sequence id) the template's whole closing does.
    A turn that called tools is a fixed text too, its calls left out (the sampled ids hold
    them as the model wrote them); `tools`, the episode's, are rendered as the prompt was.
    Raises ValueError where the rendering up to the turn is not where the whole one starts."""
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    plain = {"role": "assistant", "content": _ANSWER}
    fixed = [*messages[:last], plain, *messages[last + 1 :]]
    options: dict[str, Any] = {"tools": list(tools)} if tools else {}
    full = render(tokenizer, fixed, add_generation_prompt=True, **options)
    upto = render(tokenizer, fixed[: last + 1], **options)
    end = answer_end(tokenizer)
    closing = end.text[: len(end.text) - len(end.rest)]
    head = upto[: len(upto) - len(end.text)] if upto.endswith(end.text) else ""
    if not head.endswith(_ANSWER) or not full.startswith(head):
        raise ValueError(
            "it renders the conversation before the observation differently once it goes on"
        )
    text = full[len(head) :]
    if closed and text.startswith(closing):
        text = text[len(closing) :]
    return _encode(tokenizer, [text])[0] if text else []
