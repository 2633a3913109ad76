"""The YAML loader: values, locations, merges, and the plugin registry."""

from __future__ import annotations

import math

import pytest

from engine.errors import Location, PipeError
from engine.load.source import parse_document


def test_values_and_locations():
    doc = parse_document("a: 1\nb:\n  c: [x, 2.5, true, null, 0x1f]\n", "f.yaml")
    assert doc.data == {"a": 1, "b": {"c": ["x", 2.5, True, None, 31]}}
    assert doc.value_loc(("b", "c", 1)) == Location("f.yaml", 3, 10)
    assert doc.key_loc(("b", "c")) == Location("f.yaml", 3, 3)
    assert doc.value_loc(("b", "missing")) == Location("f.yaml", 3, 3)


def test_special_floats():
    doc = parse_document("a: .inf\nb: -.inf\nc: .nan\n", "f.yaml")
    assert doc.data["a"] == math.inf and doc.data["b"] == -math.inf and math.isnan(doc.data["c"])


def test_merge_keys_and_override():
    doc = parse_document("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  y: 3\n", "f.yaml")
    assert doc.data["use"] == {"x": 1, "y": 3}


def test_anchor_reuse_is_fine_but_bombs_are_not():
    assert parse_document("a: &a [1, 2]\nb: *a\n", "f.yaml").data["b"] == [1, 2]
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6)
    )
    with pytest.raises(PipeError, match="alias bomb"):
        parse_document(bomb, "f.yaml")


def test_recursive_alias_is_an_error_not_a_crash():
    with pytest.raises(PipeError):
        parse_document("a: &a [*a]\n", "f.yaml")


def test_binary_tag_rejected():
    with pytest.raises(PipeError, match=r"f.yaml:1:4: a: tag '!!binary' is not allowed"):
        parse_document("a: !!binary aGVsbG8=\n", "f.yaml")


def test_bom_is_accepted():
    assert parse_document("\ufeffa: 1\n".encode(), "f.yaml").data == {"a": 1}


def test_plugin_kind_registers_like_a_builtin():
    from pydantic import Field

    from engine.stage import StageConfig, StageKind, get_kind, register_kind

    class EchoConfig(StageConfig):
        """Echo."""

        message: str = Field("hi", description="What to say.")

    register_kind(StageKind("echo_test", EchoConfig, lambda cfg, ctx: None, __name__))
    try:
        assert get_kind("echo_test") is not None
        assert get_kind("echo_test").config is EchoConfig
    finally:  # other tests list the registered kinds in their expected messages
        from engine.stage.registry import _REGISTRY

        _REGISTRY.pop("echo_test", None)


def test_folded_scalar_reads_as_folded_text():
    doc = parse_document("d: >\n  one\n  two\n", "f.yaml")
    assert doc.data == {"d": "one two\n"}


def test_a_document_libyaml_refuses_still_loads_with_its_locations():
    # a ':' inside a flow scalar: YAML 1.2 allows it, libyaml does not
    doc = parse_document("a:\n  b: {url: http://h:1}\n", "f.yaml")
    assert doc.data == {"a": {"b": {"url": "http://h:1"}}}
    assert doc.value_loc(("a", "b", "url")).line == 2
