"""`pipe tune --write`: one value changes (or one line is added); every other byte stays."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from engine.errors import PipeError
from stages.collect.tune.write import set_stage_config_value, write_stage_config_value

TEXT = """\
# A pipeline with comments, flow maps and quoting to keep.
name: kept   # trailing comment
stages:
  a:          # block config, value present
    kind: collect
    config:
      input: "p.jsonl"
      num_samples_in_parallel: 'auto'   # was auto
      backend: {kind: openai, base_url: http://h/v1, model: m}
  b:
    kind: collect
    config: {input: p.jsonl, num_repeats: 4}
  c:
    kind: collect
    config:
      input: p.jsonl
  d:
    kind: collect
  e:
    kind: collect
    config: {}
  f:
    kind: collect
    config:
      input: p.jsonl
      num_samples_in_parallel: &n 16
"""


def diff(old: str, new: str) -> list[str]:
    return list(difflib.unified_diff(old.splitlines(), new.splitlines(), n=0, lineterm=""))[2:]


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (
            "a",
            [
                "@@ -8 +8 @@",
                "-      num_samples_in_parallel: 'auto'   # was auto",
                "+      num_samples_in_parallel: 51   # was auto",
            ],
        ),
        (
            "b",
            [
                "@@ -12 +12 @@",
                "-    config: {input: p.jsonl, num_repeats: 4}",
                "+    config: {num_samples_in_parallel: 51, input: p.jsonl, num_repeats: 4}",
            ],
        ),
        ("c", ["@@ -15,0 +16 @@", "+      num_samples_in_parallel: 51"]),
        ("d", ["@@ -17,0 +18 @@", "+    config: {num_samples_in_parallel: 51}"]),
        (
            "e",
            ["@@ -21 +21 @@", "-    config: {}", "+    config: {num_samples_in_parallel: 51}"],
        ),
    ],
)
def test_only_the_value_changes(stage: str, expected: list[str]) -> None:
    assert (
        diff(TEXT, set_stage_config_value(TEXT, "p.yaml", stage, "num_samples_in_parallel", 51))
        == expected
    )


def test_an_anchored_value_is_left_to_the_user() -> None:
    with pytest.raises(PipeError) as exc:
        set_stage_config_value(TEXT, "p.yaml", "f", "num_samples_in_parallel", 51)
    assert exc.value.render() == (
        "p.yaml:26:32: stages.f.config.num_samples_in_parallel: is not a plain value"
        " (an anchor, alias or collection); edit by hand"
    )


def test_write_keeps_crlf_line_endings_and_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    original = TEXT.replace("\n", "\r\n").encode()
    path.write_bytes(original)
    os.chmod(path, 0o640)
    write_stage_config_value(path, "c", "num_samples_in_parallel", 7)
    new = path.read_bytes()
    assert new.count(b"\r\n") == original.count(b"\r\n") + 1
    assert b"      num_samples_in_parallel: 7\r\n      input: p.jsonl\r\n" in new
    assert new.replace(b"      num_samples_in_parallel: 7\r\n", b"", 1) == original
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]
