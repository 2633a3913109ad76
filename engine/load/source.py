"""Load: YAML bytes -> a plain tree of Python values with a location for every node.

`load_document(path)` reads a file; `parse_document(data, name)` parses bytes or
text. The result is a `Document`: `data` holds only dicts, lists, str, int,
float, bool and None, and `value_loc(path)` / `key_loc(path)` give the
`file:line:col` of any node, so every later check can point into the file.

The YAML is composed, never constructed: ruamel.yaml's round-trip parser turns
text into nodes, and this module turns nodes into values itself. Any tag other
than the core ones (`!!python/object/apply:...`, `!foo`, `!!binary`) is an
error, so loading a file can never run code. Aliases are expanded under a node
budget (an alias bomb is an error, not an out-of-memory), duplicate keys are
errors, and `<<` merge keys are supported.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import Diagnostic, Location, PipeError

PathT = tuple[str | int, ...]

MAX_NODES = 200_000
MAX_DEPTH = 64
_CORE = "tag:yaml.org,2002:"


def render_path(path: PathT) -> str:
    """`("stages", "b", "needs", 0)` -> `stages.b.needs[0]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def get_at(data: Any, path: PathT) -> Any:
    """The value at `path` in nested dicts, or None where a key is missing."""
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def set_at(data: dict[str, Any], path: PathT, value: Any) -> None:
    """Set the value at `path`, creating (or replacing non-dict) intermediate dicts."""
    for part in path[:-1]:
        nxt = data.get(str(part))
        if not isinstance(nxt, dict):
            nxt = {}
            data[str(part)] = nxt
        data = nxt
    data[str(path[-1])] = value


@dataclass
class Document:
    """A parsed YAML document: plain values plus where each node was written."""

    name: str
    data: Any
    values: dict[PathT, Location] = field(default_factory=dict)
    keys: dict[PathT, Location] = field(default_factory=dict)

    def value_loc(self, path: PathT) -> Location:
        """Where the value at `path` starts; the nearest enclosing node when it is absent."""
        for i in range(len(path), -1, -1):
            loc = self.values.get(path[:i])
            if loc is not None:
                return loc
        return Location(self.name, 1, 1)

    def key_loc(self, path: PathT) -> Location:
        """Where the key naming `path` was written (falls back to the value)."""
        loc = self.keys.get(path)
        return loc if loc is not None else self.value_loc(path)


def load_document(path: str | Path, display: str | None = None) -> Document:
    """Read and parse a YAML file; an unreadable file is a located error too."""
    name = display if display is not None else str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise PipeError.single(Location(name), "", "no such file") from None
    except IsADirectoryError:
        raise PipeError.single(Location(name), "", "is a directory, expected a YAML file") from None
    except OSError as exc:
        raise PipeError.single(Location(name), "", f"cannot read: {exc.strerror}") from None
    return parse_document(raw, name)


def decode(raw: bytes, name: str) -> str:
    """Decode UTF-8 (a BOM is allowed); an invalid byte is an error at its line and column."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        msg = f"invalid UTF-8 byte 0x{raw[exc.start]:02x}; the file must be UTF-8 text"
        raise PipeError.single(Location(name, line, col), "", msg) from None
    return text


def parse_document(source: bytes | str, name: str) -> Document:
    """Parse YAML text into a `Document`, or raise `PipeError` with located diagnostics."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    text = decode(source, name) if isinstance(source, bytes) else source
    if not text.strip() or all(_is_comment(line) for line in text.splitlines()):
        raise PipeError.single(
            Location(name, 1, 1), "", "the file is empty; expected a pipeline mapping"
        )
    root = _compose_fast(text)
    try:
        if root is None:  # empty, or libyaml refused it: the pure parser words the error
            root = YAML(typ="rt", pure=True).compose(text)
    except MarkedYAMLError as exc:
        raise PipeError([_yaml_error(exc, name)]) from None
    except YAMLError as exc:  # reader errors (control characters) carry a position too
        raise PipeError([_reader_error(exc, name)]) from None
    except RecursionError:
        raise PipeError.single(Location(name, 1, 1), "", "the document nests too deeply") from None
    if root is None:
        raise PipeError.single(
            Location(name, 1, 1), "", "the file is empty; expected a pipeline mapping"
        )
    builder = _Builder(name)
    data = builder.build(root, (), 0)
    if builder.errors:
        raise PipeError(builder.errors)
    return Document(name, data, builder.values, builder.keys)


def _compose_fast(text: str) -> Any:
    """Compose with libyaml (ruamel.yaml.clib): about 8x faster than the pure parser on a
    1,000-stage file, with the same nodes, tags and marks. Any failure returns None and the
    pure parser runs instead, so an error reads the same either way, and a document libyaml
    refuses but YAML 1.2 allows (`{scheduler: http://h:1}`: a ':' inside a flow scalar)
    still loads."""
    from ruamel.yaml import YAML

    try:
        yaml = YAML(typ="safe", pure=False)
        yaml.Resolver = _fast_resolver()
        return yaml.compose(text)
    except Exception:  # any failure: the pure parser below reports it in our words
        return None


@functools.cache
def _fast_resolver() -> type:
    """ruamel's safe resolver with what it redoes on every scalar done once per document:
    it looks the YAML version up (through two AttributeErrors under libyaml) and matches
    every implicit-resolver regex again for each plain scalar, though the tag of a plain
    scalar depends on its text alone (no path resolvers here). Half the compose time of a
    1,000-stage file went there."""
    from ruamel.yaml.nodes import ScalarNode
    from ruamel.yaml.resolver import VersionedResolver

    class FastResolver(VersionedResolver):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._table: Any = None
            self._plain: dict[str, Any] = {}

        @property
        def versioned_resolver(self) -> Any:
            if self._table is None:
                table = VersionedResolver.versioned_resolver
                self._table = table.fget(self)  # type: ignore[attr-defined]
            return self._table

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is not ScalarNode or not implicit[0] or self.yaml_path_resolvers:
                return super().resolve(kind, value, implicit)
            if value not in self._plain:
                self._plain[value] = super().resolve(kind, value, implicit)
            return self._plain[value]

    return FastResolver


def _is_comment(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#") or s in ("---", "...")


def _yaml_error(exc: Any, name: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    loc = (
        Location(name, mark.line + 1, mark.column + 1) if mark is not None else Location(name, 1, 1)
    )
    problem = (exc.problem or exc.context or "invalid YAML").strip()
    if "\\t" in problem or "'\\t'" in problem:
        problem = "a tab character cannot indent YAML; use spaces"
    elif exc.context and exc.problem:
        problem = f"{exc.context.strip()}: {exc.problem.strip()}"
    return Diagnostic(loc, "", f"invalid YAML: {problem}")


def _reader_error(exc: Any, name: str) -> Diagnostic:
    text = str(exc)
    line = getattr(exc, "line", None)
    col = getattr(exc, "column", None)
    pos = getattr(exc, "position", None)
    loc = Location(name, 1, 1)
    if isinstance(line, int) and isinstance(col, int):
        loc = Location(name, line + 1, col + 1)
    elif isinstance(pos, int):
        loc = Location(name, 1, pos + 1)
    reason = getattr(exc, "reason", None) or text.splitlines()[0]
    return Diagnostic(loc, "", f"invalid YAML: {reason}")


def _tag(node: Any) -> str:
    tag = node.tag
    value = getattr(tag, "value", tag)
    return str(value) if value is not None else ""


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_CORE) :] if tag.startswith(_CORE) else tag


class _Builder:
    """Turns composed nodes into plain values, recording locations and errors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: dict[PathT, Location] = {}
        self.keys: dict[PathT, Location] = {}
        self.errors: list[Diagnostic] = []
        self.budget = MAX_NODES
        self.bombed = False
        self.merged: set[int] = set()

    def loc(self, node: Any) -> Location:
        mark = node.start_mark
        return Location(self.name, mark.line + 1, mark.column + 1)

    def error(self, node: Any, path: PathT, message: str) -> None:
        self.errors.append(Diagnostic(self.loc(node), render_path(path), message))

    def build(self, node: Any, path: PathT, depth: int) -> Any:
        from ruamel.yaml.nodes import MappingNode, SequenceNode

        self.budget -= 1
        if self.budget < 0 or depth > MAX_DEPTH:
            if not self.bombed:
                self.bombed = True
                what = "too many nodes" if self.budget < 0 else "nesting too deep"
                self.error(node, path, f"{what} after expanding aliases; is this an alias bomb?")
            return None
        self.values.setdefault(path, self.loc(node))
        tag = _tag(node)
        if isinstance(node, MappingNode):
            if tag not in ("", _CORE + "map"):
                self.error(
                    node, path, f"tag '{_short_tag(tag)}' is not allowed; use plain YAML values"
                )
                return None
            return self.mapping(node, path, depth)
        if isinstance(node, SequenceNode):
            if tag not in ("", _CORE + "seq"):
                self.error(
                    node, path, f"tag '{_short_tag(tag)}' is not allowed; use plain YAML values"
                )
                return None
            return [self.build(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        return self.scalar(node, path, tag)

    def mapping(self, node: Any, path: PathT, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        explicit: set[str] = set()
        for key_node, value_node in self._merged_pairs(node, path):
            key = self.key(key_node, path)
            if key is None:
                continue
            child = (*path, key)
            if key in explicit:
                self.error(key_node, child, f"duplicate key '{key}'")
                continue
            if id(key_node) not in self.merged:
                explicit.add(key)
            self.keys[child] = self.loc(key_node)
            self.values.pop(child, None)
            out[key] = self.build(value_node, child, depth + 1)
        return out

    def _merged_pairs(self, node: Any, path: PathT) -> Iterator[tuple[Any, Any]]:
        """Yield (key, value) nodes; `<<` merges come first so explicit keys override them."""
        from ruamel.yaml.nodes import MappingNode, SequenceNode

        merged: list[tuple[Any, Any]] = []
        plain: list[tuple[Any, Any]] = []
        for key_node, value_node in node.value:
            if _tag(key_node) == _CORE + "merge":
                sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                for src in sources:
                    if not isinstance(src, MappingNode):
                        self.error(src, path, "a '<<' merge takes a mapping or a list of mappings")
                        continue
                    merged.extend(src.value)
            else:
                plain.append((key_node, value_node))
        seen: set[str] = set()
        for key_node, value_node in reversed(merged):
            key = str(key_node.value)
            if key in seen or any(str(k.value) == key for k, _ in plain):
                continue
            seen.add(key)
            self.merged.add(id(key_node))
            yield key_node, value_node
        yield from plain

    def key(self, node: Any, path: PathT) -> str | None:
        from ruamel.yaml.nodes import ScalarNode

        if not isinstance(node, ScalarNode):
            self.error(node, path, "mapping keys must be plain strings")
            return None
        tag = _tag(node)
        if tag not in (
            "",
            _CORE + "str",
            _CORE + "int",
            _CORE + "float",
            _CORE + "bool",
            _CORE + "null",
        ):
            self.error(node, path, f"tag '{_short_tag(tag)}' is not allowed; use plain YAML values")
            return None
        return str(node.value)

    def scalar(self, node: Any, path: PathT, tag: str) -> Any:
        value: str = node.value
        if getattr(node, "style", None) == ">":
            value = value.replace("\a", "")  # the pure round-trip parser's fold markers
        core = tag[len(_CORE) :] if tag.startswith(_CORE) else None
        try:
            if core in ("str", "timestamp") or (core is None and tag in ("", "!")):
                return value
            if core == "null":
                return None
            if core == "bool":
                return value.lower() in ("true", "yes", "on", "y")
            if core == "int":
                return _to_int(value)
            if core == "float":
                return _to_float(value)
        except ValueError:
            self.error(node, path, f"cannot read {value!r} as {core}")
            return None
        self.error(node, path, f"tag '{_short_tag(tag)}' is not allowed; use plain YAML values")
        return None


def _to_int(value: str) -> int:
    s = value.replace("_", "")
    try:
        return int(s, 0)
    except ValueError:
        if s.lower().startswith(("0o", "-0o", "+0o")):
            raise
        return int(s, 10)


def _to_float(value: str) -> float:
    s = value.replace("_", "").lower()
    if s in (".inf", "+.inf"):
        return math.inf
    if s == "-.inf":
        return -math.inf
    if s == ".nan":
        return math.nan
    return float(s)
