"""The policy endpoint's wire format: OpenAI chat requests read and checked, answers written
as vLLM's OpenAI server writes them.

Input: a request's JSON body (`/v1/chat/completions` or `/tokenize`). Output: `ChatRequest`
(the prompt as chat templates read it, its tools, the sampling settings, what to return), or
`BadRequest` (a 400 with its message); the bodies of a chat completion and of an error.

Messages are OpenAI's: `system`, `developer` (read as `system`), `user`, `assistant` (its
`content` may be null or absent beside `tool_calls`) and `tool`; content a string or a list
of text parts. Fields a message carries beyond those (NeMo Gym sends an assistant turn's
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs` back in the history)
are dropped from the messages (the ids are read: below), as are request fields that change
nothing here (`metadata`, `store`, `user`, `parallel_tool_calls`...). A setting the
endpoint cannot honour (`n` > 1, `stream`, `stop`, `top_logprobs` > 0, a `response_format`, a
forced `tool_choice`, `chat_template_kwargs`, `continue_final_message`) is refused with a 400
naming it, never ignored.

The answer mirrors vLLM's: `choices[0].message` with `content` and structured `tool_calls`
(finish reason `tool_calls` when there are calls), `choices[0].logprobs.content` (each
token's `logprob`; its `token` the text, or `token_id:<id>` with
`return_tokens_as_token_ids`, which NeMo Gym's `vllm_model` reads the generated ids from),
`usage`, and with `return_token_ids` the prompt's ids (`prompt_token_ids`) and the
completion's (`choices[0].token_ids`).

Token in, token out: when the history's last assistant message carries the ids it was
sampled from and with (`prompt_token_ids` and `generation_token_ids`, as NeMo Gym's
`vllm_model` sends them back), `ChatRequest.prefix` holds them, and the endpoint extends them
rather than rendering the conversation again (`stages.lib.serve.policy`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stages.lib.chat.prompt import ChatPrompt

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("text", "input_text", "output_text")


class BadRequest(Exception):
    """A request the endpoint refuses: answered 400 with this message."""


@dataclass(frozen=True)
class Sampling:
    """How one engine call samples: requests that share these share a batch."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion request, read and checked."""

    prompt: ChatPrompt
    temperature: float
    top_p: float
    max_tokens: int | None  # None: what the context leaves, up to the server's default
    seed: int | None
    logprobs: bool
    token_ids_as_text: bool  # `return_tokens_as_token_ids`
    return_token_ids: bool
    parse_tools: bool  # tools offered and `tool_choice` not "none"
    turn: int  # assistant turns in the history: numbers the new calls' ids
    prefix: Prefix | None = None  # the last assistant turn's ids as sampled (docstring)


@dataclass(frozen=True)
class Prefix:
    """The ids the history's last assistant turn was asked with and answered."""

    prompt: tuple[int, ...]
    generation: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        return [*self.prompt, *self.generation]


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content: expected a string or a list of parts, found {_short(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{where}.content[{j}]: only text parts are served, found {_short(part)}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _call(value: Any, where: str) -> dict[str, Any]:
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"{where}: expected {{'id': str, 'type': 'function', 'function': "
            f"{{'name': str, 'arguments': str}}}}, found {_short(value)}"
        )
    assert isinstance(function, dict)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRequest(f"{where}.function.arguments: not a JSON object: {_short(arguments)}")
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        raise BadRequest(
            f"{where}.function.arguments: expected a JSON string, found {_short(arguments)}"
        )
    call_id = value.get("id")
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": "function",
        "function": {"name": name, "arguments": arguments or "{}"},
    }


def message(value: Any, where: str) -> dict[str, Any]:
    """One OpenAI message as chat templates read it (module docstring)."""
    role = value.get("role") if isinstance(value, dict) else None
    if role not in (*ROLES, "tool"):
        raise BadRequest(
            f"{where}.role: expected one of 'system', 'developer', 'user', 'assistant', 'tool', "
            f"found {_short(role)}"
        )
    assert isinstance(value, dict)
    out: dict[str, Any] = {
        "role": ROLES.get(role, role),
        "content": _text(value.get("content"), where),
    }
    calls = value.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls: a list on an assistant message only")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(value.get("tool_call_id"), str):
            raise BadRequest(f"{where}: a tool message needs its 'tool_call_id'")
        out["tool_call_id"] = value["tool_call_id"]
        if isinstance(value.get("name"), str):
            out["name"] = value["name"]
    return out


def messages(value: Any) -> list[dict[str, Any]]:
    """`messages`, checked: a non-empty list of messages."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"messages: expected a non-empty list of messages, found {_short(value)}")
    return [message(m, f"messages[{i}]") for i, m in enumerate(value)]


def tools(value: Any) -> list[dict[str, Any]]:
    """`tools`, checked: OpenAI function schemas (absent or null: none)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"tools: expected a list of function schemas, found {_short(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise BadRequest(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, "
                f"'parameters': {{...}}}}}}, found {_short(tool)}"
            )
    return [dict(t) for t in value]


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{key}: expected a number in [{lo:g}, {hi:g}], found {_short(value)}")
    return float(value)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequest(f"{key}: expected an integer >= {lo}, found {_short(value)}")
    return value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key}: expected true or false, found {_short(value)}")
    return value


# settings the endpoint cannot honour: (field, whether a value asks for it, what it does)
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("n", lambda v: v not in (None, 1), "one choice per request is served (n: 1)"),
    ("stream", lambda v: bool(v), "streaming is not served"),
    (
        "stop",
        lambda v: bool(v),
        "stop strings are not served (generation stops at the end of turn)",
    ),
    ("top_logprobs", lambda v: v not in (None, 0), "only the chosen token's log-prob is served"),
    (
        "response_format",
        lambda v: v not in (None, {"type": "text"}),
        "structured output is not served",
    ),
    ("tool_choice", lambda v: v not in (None, "auto", "none"), "only 'auto' and 'none' are served"),
    ("chat_template_kwargs", lambda v: bool(v), "the chat template takes no extra arguments here"),
    ("continue_final_message", lambda v: bool(v), "a final assistant message is not continued"),
    (
        "add_generation_prompt",
        lambda v: v is False,
        "a chat completion renders the generation prompt",
    ),
)


def chat_request(body: Any) -> ChatRequest:
    """A `/v1/chat/completions` body read and checked (module docstring)."""
    if not isinstance(body, dict):
        raise BadRequest(f"expected a JSON object, found {_short(body)}")
    for key, asks, why in _REFUSED:
        if asks(body.get(key)):
            raise BadRequest(f"{key}: {_short(body[key])} is not supported: {why}")
    history = messages(body.get("messages"))
    offered = tools(body.get("tools"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) or max_tokens
    return ChatRequest(
        prompt=ChatPrompt(tuple(history), tuple(offered)),
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        max_tokens=max_tokens,
        seed=_int(body, "seed", -(2**63)),
        logprobs=_flag(body, "logprobs"),
        token_ids_as_text=_flag(body, "return_tokens_as_token_ids"),
        return_token_ids=_flag(body, "return_token_ids"),
        parse_tools=bool(offered) and body.get("tool_choice") != "none",
        turn=sum(m["role"] == "assistant" for m in history),
        prefix=_prefix(body["messages"]),
    )


def _ids(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return None
    return tuple(value)


def _prefix(raw: list[Any]) -> Prefix | None:
    """The last assistant message's sampled ids, when it carries them (module docstring)."""
    last = [m for m in raw if isinstance(m, dict) and m.get("role") == "assistant"]
    if not last:
        return None
    prompt = _ids(last[-1].get("prompt_token_ids"))
    generation = _ids(last[-1].get("generation_token_ids"))
    if prompt is None or generation is None:
        return None
    return Prefix(prompt, generation)


def tokenize_request(body: Any) -> tuple[ChatPrompt | str, bool]:
    """A `/tokenize` body (vLLM's): chat messages (with `tools`, `add_generation_prompt`,
    default true) or a `prompt` string (`add_special_tokens`, default true) -> what to
    tokenize and that flag."""
    if not isinstance(body, dict):
        raise BadRequest(f"expected a JSON object, found {_short(body)}")
    if "messages" in body:
        if body.get("chat_template_kwargs"):
            raise BadRequest(
                "chat_template_kwargs: the chat template takes no extra arguments here"
            )
        prompt = ChatPrompt(tuple(messages(body["messages"])), tuple(tools(body.get("tools"))))
        return prompt, body.get("add_generation_prompt") is not False
    if isinstance(body.get("prompt"), str):
        return body["prompt"], body.get("add_special_tokens") is not False
    raise BadRequest("expected 'messages' (a list of chat messages) or 'prompt' (a string)")


def logprobs_content(
    ids: Sequence[int], logprobs: Sequence[float], decode: Callable[[int], str], as_ids: bool
) -> list[dict[str, Any]]:
    """`choices[0].logprobs.content`: one entry per generated token, as vLLM writes it."""
    out = []
    for token_id, lp in zip(ids, logprobs, strict=True):
        text = decode(token_id)
        out.append(
            {
                "token": f"token_id:{token_id}" if as_ids else text,
                "logprob": lp if math.isfinite(lp) else -9999.0,  # vLLM's floor for -inf
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return out


def chat_completion(
    model: str,
    reply: dict[str, Any],
    finish_reason: str,
    usage: tuple[int, int],
    logprobs: list[dict[str, Any]] | None,
    token_ids: tuple[list[int], list[int]] | None,
) -> dict[str, Any]:
    """The body of a chat completion: `reply` the assistant message; `token_ids` (prompt,
    completion) where the request asked for them."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": reply,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": usage[0] + usage[1],
        },
    }
    if token_ids is not None:
        body["prompt_token_ids"] = token_ids[0]
        choice["token_ids"] = token_ids[1]
    return body


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error as OpenAI's servers (vLLM's included) write it."""
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "InternalServerError"),
            "param": None,
            "code": status,
        }
    }
