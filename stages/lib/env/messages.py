"""Chat messages as environments exchange them: OpenAI's shape, tool calls included.

Input: what an environment's `reset` and `step` return, a row's `tools`, and the model's
generated text with the tool-call parser of its chat template. Output: messages checked and
normalised (`messages_of`), tool schemas checked (`tools_of`), and the model's turn as an
assistant message (`Completion`: the text itself, a `str`, carrying the structured message).

The messages are OpenAI's chat format, as NeMo Gym, verifiers, TRL and every chat template
speak it:

- `{"role": "system" | "user", "content": str}`;
- `{"role": "assistant", "content": str, "tool_calls": [...]}`, each call
  `{"id": str, "type": "function", "function": {"name": str, "arguments": <JSON string>}}`
  (`tool_calls` only where the model called a tool; `content` may be "" then);
- `{"role": "tool", "tool_call_id": str, "content": str}` (and optionally `name`), a tool's
  answer to one call.

Tools are OpenAI function schemas: `{"type": "function", "function": {"name", "description",
"parameters": <JSON schema>}}`; the chat template renders them into the prompt.

A text-only environment keeps working unchanged: its `step` gets `completion`, a `str`. It
is a `Completion`, a `str` whose `.message` is the assistant message recorded in the
conversation, with `.tool_calls` (empty when the model called none, or when the episode has
no tools: text is then never parsed) and `.parse_error` (the model wrote a call that does
not parse: the model's mistake, handed to the environment to answer, never a crash).
"""

from __future__ import annotations

import json
from typing import Any

Messages = list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")


class EpisodeFailed(Exception):
    """The environment broke one episode (raised, hung, or answered nonsense)."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _call_of(value: Any, what: str) -> dict[str, Any]:
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise EpisodeFailed(
            f"{what} returned the tool call {_short(value)}: expected "
            "{'id': str, 'type': 'function', 'function': {'name': str, 'arguments': str}}"
        )
    if not isinstance(arguments, str):  # OpenAI's arguments are a JSON string
        arguments = json.dumps(arguments)
    call_id = value.get("id")
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def message_of(value: Any, what: str) -> dict[str, Any]:
    """One message checked and normalised (module docstring); raises EpisodeFailed."""
    role = value.get("role") if isinstance(value, dict) else None
    content = value.get("content") if isinstance(value, dict) else None
    calls = value.get("tool_calls") if isinstance(value, dict) else None
    if content is None and role == "assistant" and calls:
        content = ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise EpisodeFailed(
            f"{what} returned {_short(value)}: expected {{'role': str, 'content': str}} "
            "messages (OpenAI's format: an assistant's 'tool_calls', a tool's 'tool_call_id')"
        )
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise EpisodeFailed(f"{what} returned tool_calls {_short(calls)} on a {role} message")
        out["tool_calls"] = [_call_of(c, what) for c in calls]
    if role == "tool":
        call_id = value.get("tool_call_id")
        if not isinstance(call_id, str):
            raise EpisodeFailed(f"{what} returned a tool message without a 'tool_call_id'")
        out["tool_call_id"] = call_id
        if isinstance(value.get("name"), str):
            out["name"] = value["name"]
    return out


def messages_of(value: Any, what: str) -> Messages:
    """`value` checked as chat messages (a list of them)."""
    if not isinstance(value, list):
        raise EpisodeFailed(f"{what} returned {_short(value)}: expected a list of messages")
    return [message_of(m, what) for m in value]


def tools_of(value: Any, what: str) -> list[dict[str, Any]]:
    """`value` checked as OpenAI function schemas (a bare function is wrapped)."""
    if not isinstance(value, list):
        raise EpisodeFailed(f"{what}: tools {_short(value)} is not a list of function schemas")
    out = []
    for tool in value:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise EpisodeFailed(
                f"{what}: the tool {_short(tool)} is not a function schema "
                "{'type': 'function', 'function': {'name': str, 'parameters': {...}}}"
            )
        function = dict(function)
        function.setdefault("parameters", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": function})
    return out


class Completion(str):
    """The model's turn: its text (a `str`, what text-only environments read) carrying the
    assistant message recorded for it (module docstring)."""

    message: dict[str, Any]
    parse_error: str | None

    def __new__(
        cls, text: str, message: dict[str, Any] | None = None, parse_error: str | None = None
    ) -> Completion:
        self = super().__new__(cls, text)
        self.message = message or {"role": "assistant", "content": text}
        self.parse_error = parse_error
        return self

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls", []))


def completion_of(answer: Any, parser: str | None, turn: int) -> Completion:
    """The model's `answer` as a `Completion`: a server's structured message (an OpenAI
    `message` with `tool_calls`, parsed there) as it is; text parsed by `parser` (the chat
    template's tool-call format) when the episode has tools, else kept as plain text. Call
    ids are the parser's for turn `turn` (`stages.lib.chat.tool_calls.call_id`): unique in
    the conversation, the same on a re-run."""
    if isinstance(answer, dict):
        structured = message_of({"role": "assistant", **answer}, "the model")
        return Completion(structured["content"], structured)
    text = str(answer)
    if parser is None:
        return Completion(text)
    from stages.lib.chat.tool_calls import parse_tool_calls

    parsed = parse_tool_calls(text, parser, turn)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [dict(c) for c in parsed.tool_calls]
    else:
        message["content"] = text
    return Completion(text, message, parsed.error)


def episode_parser(setting: str | None, tokenizer: Any) -> str | None:
    """The tool-call format of episodes a stage plays with `tokenizer`: the setting (the
    environment's `tool_call_parser`), else the one its chat template writes (None: a
    template with no tool-call format; an episode with tools then reads no calls)."""
    if setting is not None:
        return setting
    from stages.lib.chat.tool_calls import parser_for

    template = getattr(tokenizer, "chat_template", None)
    return parser_for(template) if isinstance(template, str) else None
