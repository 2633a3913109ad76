"""Python-style tool calls (`pythonic`, Gemma's format): `[f(a=1, b="x"), g()]`.

Input: an assistant turn's text, or (name, arguments) pairs. Output: `parse_pythonic(text)`
-> (the text outside the calls, in parts; the calls as (name, arguments)), raising
`CallError` for calls that do not parse, and `format_pythonic(calls)`, the list a model
writes. `stages.lib.chat.tool_calls` says where the format comes from.

Nothing is evaluated: the calls are read with `ast`, each argument a keyword whose value is a
literal (string, number, list, dict, tuple, set, True/False/None and JSON's
true/false/null). A call list stands bare on its own line(s), or inside a
```` ```tool_code ```` block, where statements `f(a=1)` are calls too.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any


class CallError(ValueError):
    """A tool call that does not parse: the model's mistake, reported, never raised further."""


_BLOCK = re.compile(r"```tool_code[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_LIST = re.compile(r"^[ \t]*\[\s*[A-Za-z_]\w*\s*\(", re.MULTILINE)
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

Call = tuple[str, dict[str, Any]]


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if all(isinstance(k, str | int | float) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    raise CallError(f"'{ast.unparse(node)}' is not a literal value")


def _call(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise CallError(f"'{ast.unparse(node)[:60]}' is not a call of a function by name")
    name = node.func.id
    if node.args or any(k.arg is None for k in node.keywords):
        raise CallError(f"call '{name}': arguments must be given by name (a=1)")
    try:
        return name, {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
    except CallError as e:
        raise CallError(f"call '{name}': {e}") from None


def _calls(node: ast.expr) -> list[Call]:
    return [_call(e) for e in node.elts] if isinstance(node, ast.List) else [_call(node)]


def _parse(code: str, mode: str) -> ast.AST | None:
    try:
        return ast.parse(code.strip(), mode=mode)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _block(code: str) -> list[Call]:
    tree = _parse(code, "exec")
    if not isinstance(tree, ast.Module):
        raise CallError(
            f"a tool_code block that does not parse as Python: {' '.join(code.split())[:60]}"
        )
    calls = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise CallError(f"a tool_code block may hold calls only: {ast.unparse(stmt)[:60]}")
        calls.extend(_calls(stmt.value))
    return calls


def _bare(text: str, start: int) -> tuple[list[Call], int]:
    """The call list starting at `start` and where it ends: the first ']' that closes it."""
    for m in re.finditer(r"\]", text[start:]):
        end = start + m.end()
        tree = _parse(text[start:end], "eval")
        if isinstance(tree, ast.Expression) and isinstance(tree.body, ast.List):
            return _calls(tree.body), end
    raise CallError(
        f"a call list that does not parse as Python: {' '.join(text[start:].split())[:60]}"
    )


def parse_pythonic(text: str) -> tuple[list[str], list[Call]]:
    """(text parts outside the calls, calls) of `text` (module docstring)."""
    if "```tool_code" in text:
        parts, calls, at = [], [], 0
        for block in _BLOCK.finditer(text):
            parts.append(text[at : block.start()])
            at = block.end()
            calls.extend(_block(block.group(1)))
        return [*parts, text[at:]], calls
    bare = _LIST.search(text)
    if bare is None:
        return [text], []
    calls, end = _bare(text, bare.start())
    return [text[: bare.start()], text[end:]], calls


def format_pythonic(calls: Sequence[Call]) -> str:
    """The list a model writes for `calls`, each value as `tojson` writes it."""
    for name, args in calls:
        bad = [k for k in (name, *args) if not k.isidentifier()]
        if bad:
            raise ValueError(f"'{bad[0]}' cannot be written as a Python name")

    def one(name: str, args: dict[str, Any]) -> str:
        written = (f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
        return f"{name}({', '.join(written)})"

    return f"[{', '.join(one(n, a) for n, a in calls)}]"
