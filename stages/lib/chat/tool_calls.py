"""Tool calls in a model's text, as each family writes them, and back.

Input: an assistant turn's generated text and a parser name (the names of vLLM's
`--tool-call-parser`), or structured calls. Output: `parse_tool_calls(text, parser)` ->
`Parsed(content, tool_calls, error)`, `format_tool_calls(tool_calls, parser)` (the text a
model writes for them, what the family's template renders), `parser_for(template)` (the
format a chat template's markers show) and `template_messages(messages)` (OpenAI messages as
chat templates read them). Light: no torch, no transformers.

A tool call is OpenAI's dict: `{"id": str, "type": "function", "function": {"name": str,
"arguments": str}}`, the arguments a JSON object written as a string. The formats:

- `hermes` (Qwen2.5, Hermes, ChatML templates): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block per call; an unclosed last block (generation stopped at
  the closing tag) is read to the end.
- `llama3_json` (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}` (`arguments` also
  read), after an optional `<|python_tag|>`, several separated by `;`. Without the tag a call
  starts where `{"name"` does, so braces in prose are not read as calls.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]` (v0.3, the id
  optional), and the later `[TOOL_CALLS]name[ARGS]{...}` and `[TOOL_CALLS]name{...}`.
- `pythonic` (Gemma): a Python list of calls with keyword arguments, `[f(a=1, b="x")]`,
  bare (what Google's Gemma 3 function-calling page prompts for, and what vLLM's `pythonic`
  parser reads, so a vLLM server started with it reads the same calls) or inside a
  ```` ```tool_code ```` block (the Gemma cookbook's habit; there `f(a=1)` lines are also
  calls). Gemma has no tool tokens; its tool-capable template (`gemma_tools`) prompts for
  the bare list. Values are literals only (`ast`, never evaluated); JSON's `true`, `false`
  and `null` are read as Python's, since templates write values with `tojson`.

`content` is the text with the call markup removed, parts joined by a newline and stripped.
A call that does not parse (malformed JSON or Python, no name, arguments not an object) is
the model's mistake: `error` says what, `tool_calls` is empty and `content` the whole text
stripped; nothing raises. Ids are fixed by the turn and the call's place: `call_<turn>_<i>`,
and for mistral (whose ids must be 9 letters or digits) the id the model wrote when it is
one, else `c<turn:04d><i:04d>`, so a rendering of the conversation is reproducible.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.lib.chat.pythonic import CallError, format_pythonic, parse_pythonic

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LLAMA_START = re.compile(r'\{\s*"name"\s*:')
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*(?=\{)")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Parsed:
    """An assistant turn read: its text without the calls, the calls, and what did not parse."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def call_id(parser: str, turn: int, index: int) -> str:
    """The id of a turn's `index`th call (module docstring)."""
    return f"c{turn:04d}{index:04d}" if parser == "mistral" else f"call_{turn}_{index}"


def tool_call(name: str, arguments: Mapping[str, Any], id: str) -> dict[str, Any]:
    """One call in OpenAI's shape, its arguments a JSON string."""
    args = json.dumps(dict(arguments), ensure_ascii=False)
    return {"id": id, "type": "function", "function": {"name": name, "arguments": args}}


def _call(obj: Any, keys: Sequence[str] = ("arguments",)) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a decoded call object; `CallError` when it is not one."""
    if not isinstance(obj, dict):
        raise CallError(f"a call must be a JSON object, found {_snippet(json.dumps(obj))}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallError(f"a call has no function name: {_snippet(json.dumps(obj))}")
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise CallError(
                f"call '{name}': arguments are not JSON ({e.msg}): {_snippet(args)}"
            ) from None
    if not isinstance(args, dict):
        raise CallError(f"call '{name}': arguments must be an object, found {json.dumps(args)}")
    return name, args


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _json(text: str, what: str) -> tuple[Any, int]:
    """The JSON value at the start of `text` (after blanks) and where it ends."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        raise CallError(f"{what} is not valid JSON ({e.msg}): {_snippet(text)}") from None


Found = tuple[list[str], list[tuple[str, dict[str, Any], str | None]]]  # text parts, calls
_Calls = list[tuple[str, dict[str, Any], str | None]]


def _hermes(text: str) -> Found:
    parts: list[str] = []
    calls: _Calls = []
    at = 0
    for m in _HERMES.finditer(text):
        parts.append(text[at : m.start()])
        at = m.end()
        body = m.group(1).strip()
        obj, end = _json(body, "a <tool_call> block")
        if body[end:].strip():
            raise CallError(
                f"a <tool_call> block holds more than one JSON object: {_snippet(body)}"
            )
        calls.append((*_call(obj), None))
    return [*parts, text[at:]], calls


def _llama3(text: str) -> Found:
    before, tag, after = text.partition(PYTHON_TAG)
    if not tag:
        m = _LLAMA_START.search(text)
        if m is None:
            return [text], []
        before, after = text[: m.start()], text[m.start() :]
    calls: _Calls = []
    rest = after
    while True:
        obj, end = _json(rest, "a Llama 3 call")
        calls.append((*_call(obj, ("parameters", "arguments")), None))
        rest = rest[end:]
        if not rest.lstrip().startswith(";"):
            return [before, rest], calls
        rest = rest.lstrip()[1:]


def _mistral(text: str) -> Found:
    pieces = text.split(MISTRAL_CALLS)
    parts = [pieces[0]]
    calls: _Calls = []
    for piece in pieces[1:]:
        if piece.lstrip().startswith("["):  # v0.3: a JSON list of calls
            objs, end = _json(piece, "a [TOOL_CALLS] list")
            if not isinstance(objs, list):
                raise CallError("[TOOL_CALLS] must be followed by a list of calls")
            for obj in objs:
                wrote = obj.get("id") if isinstance(obj, dict) else None
                ok = isinstance(wrote, str) and len(wrote) == 9 and wrote.isalnum()
                calls.append((*_call(obj), wrote if ok else None))
        else:  # name[ARGS]{...} or name{...}
            m = _MISTRAL_NAME.match(piece)
            if m is None:
                raise CallError(
                    f"[TOOL_CALLS] is followed by neither a list nor a name: {_snippet(piece)}"
                )
            obj, end = _json(piece[m.end() :], f"call '{m.group(1)}': arguments")
            calls.append((*_call({"name": m.group(1), "arguments": obj}), None))
            end += m.end()
        parts.append(piece[end:])
    return parts, calls


def _pythonic(text: str) -> Found:
    parts, found = parse_pythonic(text)
    calls: _Calls = [(name, args, None) for name, args in found]
    return parts, calls


_PARSERS: dict[str, Callable[[str], Found]] = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "mistral": _mistral,
    "pythonic": _pythonic,
}


def parse_tool_calls(text: str, parser: str, turn: int = 0) -> Parsed:
    """`text` (an assistant turn as generated: special tokens such as `[TOOL_CALLS]` kept, its
    end-of-turn token not) read by `parser` (module docstring); `turn` numbers the episode's
    assistant turns for the ids."""
    if parser not in _PARSERS:
        raise ValueError(
            f"unknown tool-call parser '{parser}'; expected one of {TOOL_CALL_PARSERS}"
        )
    try:
        parts, found = _PARSERS[parser](text)
    except CallError as e:
        return Parsed(text.strip(), [], str(e))
    calls = [
        tool_call(name, args, wrote or call_id(parser, turn, i))
        for i, (name, args, wrote) in enumerate(found)
    ]
    content = "\n".join(p.strip() for p in parts if p.strip())
    return Parsed(content, calls)


def _arguments(call: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return fn["name"], json.loads(args) if isinstance(args, str) else dict(args)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # as templates' `tojson` writes


def format_tool_calls(
    tool_calls: Sequence[Mapping[str, Any]], parser: str, content: str = ""
) -> str:
    """The text a model writes for `content` then `tool_calls` in `parser`'s format: what the
    family's tool-capable template renders for such an assistant turn (its end-of-turn token
    not included; Llama 3.1's template drops the content of a turn with calls, and takes one
    call per turn). The inverse of `parse_tool_calls`; a mistral call without an id gets
    `call_id("mistral", 0, i)`."""
    calls = [_arguments(c) for c in tool_calls]
    if parser == "hermes":
        blocks = [
            f'<tool_call>\n{{"name": {_dumps(n)}, "arguments": {_dumps(a)}}}\n</tool_call>'
            for n, a in calls
        ]
        return "\n".join([content, *blocks] if content else blocks)
    if parser == "llama3_json":
        body = "; ".join(f'{{"name": {_dumps(n)}, "parameters": {_dumps(a)}}}' for n, a in calls)
    elif parser == "mistral":
        ids = [c.get("id") or call_id(parser, 0, i) for i, c in enumerate(tool_calls)]
        objs = (
            f'{{"name": {_dumps(n)}, "arguments": {_dumps(a)}, "id": {_dumps(i)}}}'
            for (n, a), i in zip(calls, ids, strict=True)
        )
        return f"{content}{MISTRAL_CALLS} [{', '.join(objs)}]"
    elif parser == "pythonic":
        body = format_pythonic(calls)
    else:
        raise ValueError(
            f"unknown tool-call parser '{parser}'; expected one of {TOOL_CALL_PARSERS}"
        )
    return f"{content}\n{body}" if content else body


# (marker, parser), strongest first: tool markup, then the family's turn markers
_MARKERS = (
    ("<tool_call>", "hermes"),
    (MISTRAL_CALLS, "mistral"),
    ("```tool_code", "pythonic"),
    (PYTHON_TAG, "llama3_json"),
    ("<|im_start|>", "hermes"),
    ("<|start_header_id|>", "llama3_json"),
    ("<start_of_turn>", "pythonic"),
    ("[INST]", "mistral"),
)


def parser_for(template: str) -> str | None:
    """The tool-call format of the family whose markers `template` holds, as vLLM's
    `--tool-call-parser` is chosen by model; None for a template of no known family. Whether
    the template renders tools at all is `stages.lib.chat.tool_template.renders_tools`."""
    return next((parser for marker, parser in _MARKERS if marker in template), None)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: each call's `function.arguments` an
    object, not a JSON string (Qwen's, Llama's and Mistral's templates write it with
    `tojson`); the rest as it is."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c)[1]}}
                for c in message["tool_calls"]
            ]
        out.append(message)
    return out
