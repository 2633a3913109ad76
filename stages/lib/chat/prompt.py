"""The prompt format every stage shares: one chat template for training and generation.

Input: a prompt (a string, or a list of chat messages) and a tokenizer.
Output: the text a model sees before its answer.

The tiny models' chat template is deliberately plain:

    <|bos|><|system|>...<|user|>...<|assistant|>ANSWER<|eos|>

`format_prompt` renders a prompt up to and including the assistant marker
through the tokenizer's own chat template (any Hugging Face checkpoint with
one works the same way); generation continues from it, and training renders the whole
conversation, answers included, through the same template (`stages.lib.chat.turns`).
Tokenize its output with `add_special_tokens=False` (the template already holds the BOS
token). A template that reads the date renders the run's (`stages.lib.chat.clock`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stages.lib.chat.clock import render

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt already as token ids (a multi-turn episode's conversation so far, exactly as
    the model saw and wrote it: no re-tokenisation between turns)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the tools offered to the model (OpenAI function schemas), which
    the chat template renders (`apply_chat_template(..., tools=...)`)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()


Prompt = str | Sequence[dict[str, Any]] | TokenPrompt | ChatPrompt


def as_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string becomes a single user message."""
    if isinstance(prompt, TokenPrompt):
        raise TypeError("a prompt of token ids has no messages")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, ChatPrompt):
        return [dict(m) for m in prompt.messages]
    return [dict(m) for m in prompt]


def tools_of(prompt: Prompt) -> list[dict[str, Any]] | None:
    """The tools a prompt offers (None: none, and the template renders no tool section)."""
    return list(prompt.tools) if isinstance(prompt, ChatPrompt) and prompt.tools else None


def format_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """The text a model sees before its answer, through the tokenizer's chat template (with
    the prompt's tools, where it offers any)."""
    tools = tools_of(prompt)
    options: dict[str, Any] = {"tools": tools} if tools else {}
    return render(tokenizer, as_messages(prompt), add_generation_prompt=True, **options)


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The token ids a model sees before its answer (a `TokenPrompt` as it is)."""
    if isinstance(prompt, TokenPrompt):
        return list(prompt.ids)
    text = format_prompt(tokenizer, prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
