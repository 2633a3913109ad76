"""Write one value into a pipeline file, keeping every other byte: `pipe tune --write`.

Input: the file's text, a stage name, a config key and a value. Output: the
new text, in which only that value changed (or one line was added).

ruamel.yaml's round-trip composer finds the nodes and where they are in the
text; the edit is made in the text itself at that place, so comments, quoting,
indentation, flow style and line endings elsewhere stay exactly as written,
which a dump of the whole document cannot promise. An absent key is added as
the first entry of the stage's `config` mapping (block or flow), and an absent
`config` as a one-line flow mapping. The result is parsed again and checked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.errors import Location, PipeError
from engine.load.source import parse_document, render_path


def _child(mapping: Any, key: str) -> tuple[Any, Any] | None:
    """The (key node, value node) pair of `key` in a composed mapping node."""
    for key_node, value_node in mapping.value:
        if getattr(key_node, "value", None) == key:
            return key_node, value_node
    return None


def _fail(name: str, node: Any, path: tuple[str, ...], message: str) -> PipeError:
    mark = node.start_mark
    return PipeError.single(
        Location(name, mark.line + 1, mark.column + 1), render_path(path), message
    )


def _insert(text: str, name: str, mapping: Any, path: tuple[str, ...], entry: str) -> str:
    """Add `entry` ("key: value") as the first entry of a mapping node."""
    start = mapping.start_mark.index
    if mapping.flow_style:
        if text[start] != "{":
            raise _fail(name, mapping, path, "cannot find the '{' of this mapping to edit")
        sep = ", " if mapping.value else ""
        return f"{text[: start + 1]}{entry}{sep}{text[start + 1 :]}"
    first = mapping.value[0][0]
    line_start = text.rfind("\n", 0, first.start_mark.index) + 1
    if text[line_start : first.start_mark.index].strip():
        raise _fail(name, mapping, path, "the mapping does not start on its own line; edit by hand")
    newline = "\r\n" if text[line_start:].split("\n", 1)[0].endswith("\r") else "\n"
    return f"{text[:line_start]}{' ' * first.start_mark.column}{entry}{newline}{text[line_start:]}"


def set_stage_config_value(text: str, name: str, stage: str, key: str, value: int) -> str:
    """Return `text` with `stages.<stage>.config.<key>` set to `value`; `name` is for errors."""
    from ruamel.yaml import YAML
    from ruamel.yaml.nodes import MappingNode, ScalarNode

    root = YAML(typ="rt").compose(text)
    found = _child(root, "stages") if isinstance(root, MappingNode) else None
    found = _child(found[1], stage) if found and isinstance(found[1], MappingNode) else None
    if found is None or not isinstance(found[1], MappingNode):
        raise PipeError.single(Location(name), f"stages.{stage}", "no such stage mapping to edit")
    stage_node = found[1]
    config = _child(stage_node, "config")
    path = ("stages", stage, "config")
    if config is None:
        new = _insert(text, name, stage_node, path[:2], f"config: {{{key}: {value}}}")
    elif isinstance(config[1], ScalarNode) and str(config[1].tag).endswith(":null"):
        new = _fill_null(text, config, f"{{{key}: {value}}}")
    elif not isinstance(config[1], MappingNode):
        raise _fail(name, config[1], path, "expected a mapping to edit")
    else:
        new = _set_in_config(text, name, config[1], (*path, key), str(value))
    _check(new, name, (*path, key), value)
    return new


def _fill_null(text: str, pair: tuple[Any, Any], flow: str) -> str:
    """Replace a null value (`key:`, `key: null`, `key: ~`) with a flow mapping."""
    key_node, null = pair
    start, end = null.start_mark.index, null.end_mark.index
    if text[start:end].strip():
        return f"{text[:start]}{flow}{text[end:]}"
    colon = text.index(":", key_node.end_mark.index) + 1
    return f"{text[:colon]} {flow}{text[colon:]}"


def _set_in_config(text: str, name: str, config: Any, path: tuple[str, ...], value: str) -> str:
    from ruamel.yaml.nodes import ScalarNode

    found = _child(config, path[-1])
    if found is None:
        return _insert(text, name, config, path[:-1], f"{path[-1]}: {value}")
    node = found[1]
    if not isinstance(node, ScalarNode) or getattr(node, "anchor", None):
        raise _fail(
            name, node, path, "is not a plain value (an anchor, alias or collection); edit by hand"
        )
    return f"{text[: node.start_mark.index]}{value}{text[node.end_mark.index :]}"


def _check(new: str, name: str, path: tuple[str, ...], value: int) -> None:
    data: Any = parse_document(new, name).data
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    if data != value:
        raise RuntimeError(f"{name}: editing {render_path(path)} failed; found {data!r} after")


def write_stage_config_value(path: Path, stage: str, key: str, value: int) -> None:
    """Set `stages.<stage>.config.<key>` in the file at `path`, atomically, keeping its mode."""
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    new = set_stage_config_value(text, str(path), stage, key, value)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(new.encode("utf-8"))
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
