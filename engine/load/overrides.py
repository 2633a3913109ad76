"""`--set PATH=VALUE`: overrides applied to the document before validation.

PATH is dotted from the document root (`stages.collect.config.limit`, list items
as `needs[0]`); VALUE is read as a YAML value (`64`, `true`, `[a, b]`,
`{kind: openai}`). An overridden value, and a mapping the override creates on its way
(`--set stages.typo.config.x=1` makes stage `typo`), is located at the override itself,
so an error names it: `--set stages.collect.config.limit=-1: stages.collect.config.limit: ...`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from engine.errors import Diagnostic, Location, PipeError
from engine.load.source import Document, PathT, parse_document

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_path(text: str) -> PathT | None:
    """`stages.a.needs[0]` -> ("stages", "a", "needs", 0); None when malformed."""
    parts: list[str | int] = []
    pos = 0
    for match in _PART.finditer(text):
        gap = text[pos : match.start()]
        if gap not in ("", ".") or (gap == "" and pos > 0 and match.group(1)):
            return None
        parts.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        pos = match.end()
    if pos != len(text) or not parts:
        return None
    return tuple(parts)


def apply_overrides(doc: Document, overrides: Sequence[str]) -> None:
    """Apply each `PATH=VALUE` to `doc` in order; malformed ones are errors naming the override."""
    errors: list[Diagnostic] = []
    for arg in overrides:
        where = Location(f"--set {arg}")
        key, sep, raw = arg.partition("=")
        path = parse_path(key.strip()) if sep else None
        if path is None:
            errors.append(
                Diagnostic(where, "", "expected PATH=VALUE, e.g. stages.collect.config.limit=100")
            )
            continue
        try:
            value = parse_document(raw, f"--set {arg}").data if raw.strip() else ""
        except PipeError as exc:
            errors.extend(exc.diagnostics)
            continue
        problem = _assign(doc, path, value, where)
        if problem:
            errors.append(Diagnostic(where, key.strip(), problem))
    if errors:
        raise PipeError(errors)


def _assign(doc: Document, path: PathT, value: object, where: Location) -> str:
    if not isinstance(doc.data, dict):
        return "the document is not a mapping"
    node: object = doc.data
    created: list[PathT] = []  # mappings this override makes: an error about one names it
    for i, part in enumerate(path[:-1]):
        if isinstance(node, dict) and isinstance(part, str):
            if part not in node:
                created.append(path[: i + 1])
            node = node.setdefault(part, {})
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return f"cannot set a value below '{_render(path[: i + 1])}', which is not a mapping"
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str):  # noqa: SIM114 (mypy narrows each apart)
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    else:
        return f"cannot set '{_render(path)}': its parent is not a mapping"
    for table in (doc.values, doc.keys):
        for stale in [p for p in table if p[: len(path)] == path]:
            del table[stale]
    for made in (*created, path):
        doc.values[made] = where
        doc.keys[made] = where
    return ""


def _render(path: PathT) -> str:
    from engine.load.source import render_path

    return render_path(path)
