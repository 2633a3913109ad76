"""The built-in tools: function tools that any environment can offer and answer.

Input: a tool call (OpenAI's: `{"id", "type": "function", "function": {"name", "arguments"}}`,
its arguments a JSON string) and the names of the tools an environment offers. Output: the
`tool` message answering it (`answer_calls`), and each tool's schema (`TOOLS[name].schema`,
what the chat template renders).

- `calculator({"expression"})`: the value of an arithmetic expression (numbers, + - * / **
  % and parentheses; no names, no calls; exponents up to 100), `result: <value>` or
  `error: ...`.
- `python({"code"})`: the program run in the sandbox (`stages.lib.env.sandbox`: a fresh
  interpreter and folder, no network, CPU, memory, process and output limits); what it
  printed, or its error.

An environment of your own offers them by returning their schemas as its `tools` and
answering the calls its `step` gets with `answer_calls(completion.tool_calls, ("python",))`;
it runs tools of its own in the sandbox with `stages.lib.env.sandbox.run_python`. A call to
a tool not offered, or with arguments that are not the schema's, is answered with an
`error: ...` the model reads: its mistake, never the episode's failure.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression (no names, no calls; exponents up to 100)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    return value(ast.parse(expression, mode="eval").body)  # type: ignore[no-any-return]


def calculator_text(expression: str) -> str:
    """`result: <value>` of `expression`, or `error: ...`."""
    try:
        result = calculate(expression)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {exc}"
    return f"result: {int(result) if float(result).is_integer() else result}"


def _calculator(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        return "error: the calculator takes {'expression': '<arithmetic>'}"
    return calculator_text(expression)


def tool_text(result: Any) -> str:
    """What the model reads back of a sandbox run (`stages.lib.env.sandbox.Result`): what it
    printed, then the error or the traceback's last lines."""
    text = result.stdout
    if result.error is not None:
        text += f"error: {result.error} (the run was stopped)"
    elif result.exit_code != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        text += f"error: exit code {result.exit_code}\n{tail}"
    return text if text.strip() else "(no output)"


def call_python_tool(arguments: dict[str, Any], limits: Any = None) -> str:
    """The text a `tool` message carries for a call `python({"code": ...})`, run in the
    sandbox with `limits` (`stages.lib.env.sandbox.Limits`; default its defaults)."""
    from stages.lib.env.sandbox import Limits, run_python

    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return "error: the python tool takes {'code': '<program>'}"
    return tool_text(run_python(code, limits or Limits()))


def _python(arguments: dict[str, Any]) -> str:
    return call_python_tool(arguments)


def _schema(name: str, description: str, argument: str, about: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string", "description": about}},
                "required": [argument],
            },
        },
    }


@dataclass(frozen=True)
class Tool:
    schema: dict[str, Any]
    run: Callable[[dict[str, Any]], str]


TOOLS: dict[str, Tool] = {
    "calculator": Tool(
        _schema(
            "calculator",
            "The value of an arithmetic expression: numbers, + - * / ** % and parentheses.",
            "expression",
            "for example (12 + 30) * 4",
        ),
        _calculator,
    ),
    "python": Tool(
        _schema(
            "python",
            "Run a Python program in a fresh sandbox (no network, a temporary folder, limited "
            "time and memory) and return what it printed.",
            "code",
            "The program; print the results.",
        ),
        _python,
    ),
}


def answer_calls(
    calls: Sequence[dict[str, Any]],
    offered: Sequence[str],
    run: Callable[[str, dict[str, Any]], str] | None = None,
) -> list[dict[str, Any]]:
    """One `tool` message per call, in order (module docstring); `run(name, arguments)`
    answers an offered tool's call (default: the built-in tool of that name)."""
    run = run or (lambda name, arguments: TOOLS[name].run(arguments))
    out = []
    for call in calls:
        name = call["function"]["name"]
        if name not in offered:
            content = f"error: no tool named {name!r}; the tools are {', '.join(offered)}"
        else:
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError as exc:
                arguments, content = None, f"error: the arguments are not JSON: {exc}"
            if isinstance(arguments, dict):
                content = run(name, arguments)
            elif arguments is not None:
                content = "error: the arguments must be a JSON object"
        out.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})
    return out
