"""Property test: whatever a mutated pipeline looks like, the loader raises only `PipeError`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import PipeError
from engine.load.load import validate_document
from engine.load.source import parse_document
from tests.conftest import ROOT

VALID = (ROOT / "tests" / "data" / "valid.yaml").read_text()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=6,
)


def _load(text: str | bytes) -> None:
    try:
        doc = parse_document(text, "fuzz.yaml")
        validate_document(doc, Path("fuzz.yaml"))
    except PipeError:
        pass


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(data: Any, path: tuple[Any, ...], op: str, value: Any) -> None:
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "retype":
        parent[last] = value
    elif op == "duplicate" and isinstance(parent, dict):
        parent[f"{last}_copy"] = parent[last]
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(parent[last])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_structural_mutations_raise_only_pipe_error(data: st.DataObject) -> None:
    tree = parse_document(VALID, "valid.yaml").data
    for _ in range(data.draw(st.integers(1, 4))):
        paths = _paths(tree)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        op = data.draw(st.sampled_from(["delete", "retype", "duplicate"]))
        _mutate(tree, path, op, data.draw(values))
    doc = parse_document(VALID, "valid.yaml")
    doc.data = tree
    with contextlib.suppress(PipeError):
        validate_document(doc, Path("valid.yaml"))


@settings(max_examples=300, deadline=None)
@given(
    pos=st.integers(0, len(VALID.encode())),
    junk=st.binary(min_size=1, max_size=8),
    cut=st.booleans(),
)
def test_random_bytes_raise_only_pipe_error(pos: int, junk: bytes, cut: bool) -> None:
    raw = VALID.encode()
    mutated = raw[:pos] + junk + (raw[pos + len(junk) :] if cut else raw[pos:])
    _load(mutated)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_arbitrary_text_raises_only_pipe_error(text: str) -> None:
    _load(text)


@settings(max_examples=100, deadline=None)
@given(lines=st.lists(st.sampled_from(VALID.splitlines()), max_size=30))
def test_shuffled_lines_raise_only_pipe_error(lines: list[str]) -> None:
    _load("\n".join(lines))
