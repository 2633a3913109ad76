"""The prompt format every stage shares: one chat template for training and generation.

Input: a prompt (a string, or a list of chat messages) and a tokenizer.
Output: the text a model sees before its answer.

The tiny models' chat template is deliberately plain:

    <|bos|><|system|>...<|user|>...<|assistant|>ANSWER<|eos|>

`format_prompt` renders a prompt up to and including the assistant marker
through the tokenizer's own chat template (any Hugging Face checkpoint with
one works the same way); training appends the target and the end-of-sequence
token, generation continues from it. Tokenize its output with
`add_special_tokens=False` (the template already holds the BOS token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

Prompt = str | Sequence[dict[str, str]]


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages: a string becomes a single user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def format_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """The text a model sees before its answer, through the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        as_messages(prompt), tokenize=False, add_generation_prompt=True
    )
    return str(text)
