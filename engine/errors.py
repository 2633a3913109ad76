"""Diagnostics: the project's one error type, and how errors read.

Every user mistake becomes a `Diagnostic` (file, line, column, dotted path,
message). A `PipeError` carries all of them at once and renders them compiler
style, one per line, sorted by position::

    pipelines/x.yaml:10:13: stages.filter.needs[0]: no stage named 'colect'; did you mean 'collect'?
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Location:
    """A place in a source: a file with a 1-based line and column, or an origin such as `--set`."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    """One error or warning about the user's input."""

    location: Location | None
    path: str
    message: str
    severity: str = field(default="error")

    def sort_key(self) -> tuple[str, int, int, str]:
        loc = self.location
        if loc is None:
            return ("", 0, 0, self.path)
        return (loc.file, loc.line, loc.col, self.path)

    def render(self) -> str:
        parts = []
        if self.location is not None:
            parts.append(str(self.location))
        if self.severity != "error":
            parts.append(self.severity)
        if self.path:
            parts.append(self.path)
        parts.append(self.message)
        return ": ".join(parts)


class PipeError(Exception):
    """A user's mistake: one or more diagnostics. The CLI prints them and exits 2."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        diags = sorted(diagnostics, key=Diagnostic.sort_key)
        if not diags:
            raise ValueError("PipeError needs at least one diagnostic")
        self.diagnostics: list[Diagnostic] = diags
        super().__init__(self.render())

    @classmethod
    def single(cls, location: Location | None, path: str, message: str) -> PipeError:
        return cls([Diagnostic(location, path, message)])

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class RunFailed(Exception):
    """The run could not go on (no cluster to run on, jobs that never started): the CLI prints
    the message and exits 1, as for a failed stage; no traceback."""


def found(value: object, *, whole: bool = False) -> str:
    """How a value the user wrote reads in a message: 'text', 3, true, null, a list, a mapping
    (with `whole`, lists and mappings are shown as written: [['actor', 'ref']])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, dict) and not whole:
        return "a mapping"
    if isinstance(value, list) and not whole:
        return "a list"
    return str(value)


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """Return "; did you mean 'x'?" for the closest option, or "" when nothing is close."""
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not matches:
        return ""
    return f"; did you mean '{matches[0]}'?"


def one_of(options: Iterable[str]) -> str:
    """Render a set of options as "'a', 'b' or 'c'"."""
    quoted = [f"'{o}'" for o in options]
    if len(quoted) <= 1:
        return "".join(quoted)
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]
