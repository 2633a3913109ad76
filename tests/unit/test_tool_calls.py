"""Tool calls read from a model's text in each family's format, written back, and rendered by
the families' templates with their real tokenizers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.stage import ResolveContext
from stages.lib.chat.template import FAMILIES, plain_template, template_text
from stages.lib.chat.tool_calls import (
    TOOL_CALL_PARSERS,
    Parsed,
    format_tool_calls,
    parse_tool_calls,
    parser_for,
    template_messages,
    tool_call,
)
from stages.lib.chat.tool_template import check_tools_template, render, renders_tools

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 12 * 7.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TWO = [
    tool_call("calculator", {"expression": "12 * 7"}, "a1b2c3d4e"),
    tool_call("lookup", {"key": 'é "q" ]', "n": -2, "flags": [True, None, 1.5]}, "f5g6h7i8j"),
]


def _shape(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


GOOD = {
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1 + 2"}}',
    "mistral": '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1 + 2"}}]',
    "pythonic": '[calculator(expression="1 + 2")]',
}


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_each_parser_reads_a_call_with_text_around_it_and_ids_by_turn_and_place(
    parser: str,
) -> None:
    got = parse_tool_calls(f"Let me work it out.\n{GOOD[parser]}\nThen I answer.", parser, turn=3)
    assert got.error is None
    assert got.content == "Let me work it out.\nThen I answer."
    assert _shape(got.tool_calls) == [("calculator", {"expression": "1 + 2"})]
    assert got.tool_calls[0]["type"] == "function"
    assert got.tool_calls[0]["id"] == ("c00030000" if parser == "mistral" else "call_3_0")
    assert parse_tool_calls("The answer is 3 {not a call} [1, 2].", parser) == Parsed(
        "The answer is 3 {not a call} [1, 2]."
    )


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("content", ["", "I will use the tools."])
def test_format_then_parse_gives_back_the_calls_and_the_content(parser: str, content: str) -> None:
    text = format_tool_calls(TWO, parser, content=content)
    got = parse_tool_calls(text, parser)
    assert (got.content, got.error) == (content, None)
    assert _shape(got.tool_calls) == _shape(TWO)
    if parser == "mistral":  # the only format that carries the ids
        assert [c["id"] for c in got.tool_calls] == ["a1b2c3d4e", "f5g6h7i8j"]


@pytest.mark.parametrize(
    ("parser", "text", "error"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
            'a <tool_call> block is not valid JSON (Expecting \',\' delimiter): {"name": "f", "arguments": {"a": 1}',
        ),
        (
            "hermes",
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            'a call has no function name: {"arguments": {}}',
        ),
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
            "call 'f': arguments must be an object, found [1]",
        ),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"a": }}',
            'a Llama 3 call is not valid JSON (Expecting value): {"name": "f", "parameters": {"a": }}',
        ),
        (
            "mistral",
            "[TOOL_CALLS] [{'name': 'f'}]",
            "a [TOOL_CALLS] list is not valid JSON (Expecting property name enclosed in double quotes): [{'name': 'f'}]",
        ),
        (
            "mistral",
            "[TOOL_CALLS] f(1)",
            "[TOOL_CALLS] is followed by neither a list nor a name: f(1)",
        ),
        (
            "pythonic",
            '[f(a="x", b=open("/etc/passwd"))]',
            "call 'f': 'open('/etc/passwd')' is not a literal value",
        ),
        ("pythonic", "[f(1)]", "call 'f': arguments must be given by name (a=1)"),
        ("pythonic", '[f(a="x"', 'a call list that does not parse as Python: [f(a="x"'),
        (
            "pythonic",
            "```tool_code\nimport os\n```",
            "a tool_code block may hold calls only: import os",
        ),
    ],
)
def test_a_call_that_does_not_parse_is_reported_and_leaves_the_text_as_content(
    parser: str, text: str, error: str
) -> None:
    assert parse_tool_calls(f" {text} ", parser) == Parsed(text, [], error)


def test_the_formats_other_spellings() -> None:
    llama = parse_tool_calls(
        '{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}', "llama3_json"
    )
    assert _shape(llama.tool_calls) == [("f", {"a": 1}), ("g", {})]
    mistral = parse_tool_calls('Sure.[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g{"b": "x"}', "mistral")
    assert (mistral.content, _shape(mistral.tool_calls)) == (
        "Sure.",
        [("f", {"a": 1}), ("g", {"b": "x"})],
    )
    block = parse_tool_calls(
        "Sure.\n```tool_code\nf(a=true, b=None)\ng(c=[1, -2])\n```\nDone.", "pythonic"
    )
    assert (block.content, _shape(block.tool_calls)) == (
        "Sure.\nDone.",
        [("f", {"a": True, "b": None}), ("g", {"c": [1, -2]})],
    )
    unclosed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": "1"}}', "hermes")
    assert _shape(unclosed.tool_calls) == [("f", {"a": "1"})]


def test_parser_for_each_family_template() -> None:
    expected = {
        "chatml": "hermes",
        "llama3": "llama3_json",
        "gemma": "pythonic",
        "mistral": "mistral",
        "gemma_tools": "pythonic",
        "mistral_tools": "mistral",
    }
    assert {f: parser_for(template_text(f)) for f in FAMILIES} == expected
    assert parser_for(plain_template("Question: {prompt}\nAnswer:")) is None


def test_which_templates_render_tools_and_the_refusal_names_the_one_that_can() -> None:
    rendering = {f: renders_tools(template_text(f)) for f in FAMILIES}
    assert rendering == {
        "chatml": True,
        "llama3": True,
        "gemma": False,
        "mistral": False,
        "gemma_tools": True,
        "mistral_tools": True,
    }
    ctx = ResolveContext(stage="rl", gpus=0, role=None, roles={}, gpus_per_node=8)
    [gemma] = check_tools_template(ctx, "chat_template", template_text("gemma"), "gemma")
    assert gemma.render() == (
        "stages.rl.config.chat_template: the chat template 'gemma' cannot render tools; "
        "use chat_template: gemma_tools"
    )
    [plain] = check_tools_template(ctx, "chat_template", plain_template("Q: {prompt}"), "plain")
    assert plain.message.endswith(
        "use chat_template: one of chatml, gemma_tools, llama3, mistral_tools"
    )
    assert check_tools_template(ctx, "chat_template", template_text("chatml"), "chatml") == []
    assert check_tools_template(ctx, "model", None, "checkpoints/x") == []


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": " 5 "}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_a_tool_variant_renders_a_conversation_without_tools_as_its_release_does(
    family: str,
) -> None:
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            extra = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": prompt}
            assert render(template_text(f"{family}_tools"), messages, **extra) == render(
                template_text(family), messages, **extra
            )


# the family checkpoint, the template that renders its tools (None: its own) and its end of turn
TOOL_TEMPLATES = {
    "chatml": (None, "<|im_end|>\n"),
    "llama3": (None, "<|eot_id|>"),  # Llama 3.1's template takes one call per turn
    "gemma": ("gemma_tools", "<end_of_turn>\n"),
    "mistral": ("mistral_tools", "</s>"),
}


@pytest.mark.parametrize("family", list(TOOL_TEMPLATES))
def test_the_real_tokenizers_render_tools_calls_and_results_that_parse_back(
    family_checkpoint: Callable[..., Path], family: str
) -> None:
    from tests.families import family_tokenizer

    tokenizer = family_tokenizer(family_checkpoint, family)
    name, end = TOOL_TEMPLATES[family]
    template = template_text(name) if name else None
    parser = parser_for(template or tokenizer.chat_template)
    assert parser is not None
    calls = TWO[:1] if family == "llama3" else TWO
    messages = [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"}
            for i, c in enumerate(calls)
        ),
        {"role": "assistant", "content": "84"},
    ]

    def rendered(turns: list[dict[str, Any]], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            template_messages(turns),
            tools=[CALC],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=prompt,
        )

    whole = rendered(messages)
    assert CALC["function"]["description"] in whole
    assert all(f"result {i}" in whole for i in range(len(calls)))
    prompt, answered = rendered(messages[:1], prompt=True), rendered(messages[:2])
    assert answered.startswith(prompt) and answered.endswith(end)
    turn = answered[len(prompt) : -len(end)]
    assert turn == format_tool_calls(calls, parser)  # what a model must write, the template's
    got = parse_tool_calls(turn, parser)
    assert (got.content, got.error, _shape(got.tool_calls)) == ("", None, _shape(calls))
