"""Whether a chat template renders tools, and the plan-time refusal of one that cannot.

Input: a chat template's Jinja text (a family's, a file's, a checkpoint's own). Output:
`renders_tools(template) -> bool`, `tool_family(template)` (the family template that renders
tools in the same format) and `check_tools_template(ctx, path, template, name)` (located
diagnostics for `pipe validate`/`plan`). Light: jinja2 only, no torch or transformers.

A template renders tools when, given a tool schema and a conversation that calls it and
answers, it renders without raising and its text holds the schema's description, the call's
argument and the tool's answer. It is rendered as transformers renders chat templates (a
sandbox, `trim_blocks`/`lstrip_blocks`, `tojson` without HTML escaping, `raise_exception`),
with the calls' arguments as objects (`stages.lib.chat.tool_calls.template_messages`). The
release templates of chatml (Qwen2.5) and llama3 (Llama 3.1) do; gemma's (gemma-2) and
mistral's (v0.2) do not, and their tool-capable variants `gemma_tools` and `mistral_tools`
(`stages/lib/chat/families/README.md`) do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.chat.tool_calls import parser_for

# the family whose template renders tools in each parser's format
TOOL_FAMILY = {
    "hermes": "chatml",
    "llama3_json": "llama3",
    "mistral": "mistral_tools",
    "pythonic": "gemma_tools",
}
_PROBE_ID = "probe0001"  # 9 letters or digits, as Mistral's ids must be
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "pipe_probe_tool",
        "description": "probe_description_7f3a",
        "parameters": {
            "type": "object",
            "properties": {"probe_arg": {"type": "string"}},
            "required": ["probe_arg"],
        },
    },
}
_PROBE_CALL = {"name": "pipe_probe_tool", "arguments": {"probe_arg": "probe_value_5c1e"}}
_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "probe question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": _PROBE_ID, "type": "function", "function": _PROBE_CALL}],
    },
    {
        "role": "tool",
        "tool_call_id": _PROBE_ID,
        "name": "pipe_probe_tool",
        "content": "probe_result_9d2b",
    },
    {"role": "assistant", "content": "probe answer"},
]
_SHOWN = ("probe_description_7f3a", "probe_value_5c1e", "probe_result_9d2b")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' mark of assistant text): its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it on the instance)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """`template` rendered as transformers renders it (module docstring), without a tokenizer:
    `bos_token`/`eos_token` and the like come in `extra`."""
    return _compiled(template).render(messages=list(messages), tools=tools, **extra)


def renders_tools(template: str) -> bool:
    """Whether `template` renders a tool's schema, a call of it and its answer."""
    try:
        text = render(template, _PROBE, [_PROBE_TOOL], bos_token="<s>", eos_token="</s>")
    except Exception:  # a template is user code: any failure means it cannot
        return False
    return all(s in text for s in _SHOWN)


def tool_family(template: str) -> str | None:
    """The family template that renders tools in `template`'s format (None: no known one)."""
    parser = parser_for(template)
    return TOOL_FAMILY[parser] if parser else None


_CHECKED: dict[str, bool] = {}


def require_tools(template: str | None) -> None:
    """At run time, before tools are rendered with `template` (an environment of one's own,
    or rows, that offer tools: not known at validate): ValueError when it cannot render
    them, with the family template that can. Checked once per template."""
    if template is None:
        return
    if template not in _CHECKED:
        _CHECKED[template] = renders_tools(template)
    if not _CHECKED[template]:
        raise ValueError(
            f"the episodes offer tools, and the chat template cannot render them; set the "
            f"stage's chat_template: {_fix(template)}"
        )


def _fix(template: str) -> str:
    """The family template that renders tools in `template`'s format, else the choices."""
    return tool_family(template) or "one of " + ", ".join(sorted(set(TOOL_FAMILY.values())))


def check_tools_template(
    ctx: ResolveContext, path: str, template: str | None, name: str
) -> list[Diagnostic]:
    """A stage that offers tools refused, located at `path`, when the template it renders
    with (`template`, None when it is not known before the run) cannot render them. `name`
    is how the user knows that template, written in quotes: the setting (`gemma`, a file) or
    the checkpoint whose own template it is."""
    if template is None or renders_tools(template):
        return []
    fix = _fix(template)
    return [
        ctx.error(path, f"the chat template '{name}' cannot render tools; use chat_template: {fix}")
    ]
