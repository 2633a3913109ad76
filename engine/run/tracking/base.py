"""Trackers: one small interface, one class per transport (chosen by name in
`engine.run.tracking.recorder.make_trackers` only).

Input: what `engine.run.tracking.recorder` hands a tracker from the driver's writer thread (the
run's plan as flattened parameters with their provenance, each stage's opening, its
metric events, artifacts and end). Output: the tracker's own records (TensorBoard event
files, MLflow runs, W&B runs). Every method may raise: the writer turns the first
failure into one warning and stops calling that tracker; a tracker never sees a
credential (its library reads the environment).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RunInfo:
    """The parent run: one per `pipe run`."""

    run_id: str
    pipeline: str  # the pipeline's name
    run_dir: str  # absolute
    params: dict[str, str]  # the resolved plan, dotted keys
    sources: dict[str, str]  # dotted key -> where its value came from
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StageInfo:
    """A child run: one per stage."""

    name: str
    kind: str
    key: str  # the stage's cache key
    params: dict[str, str]  # its resolved config, dotted keys
    sources: dict[str, str]


class Tracker(Protocol):
    """What the writer calls, in this order: start, then per stage either opened ->
    metrics/artifact... -> closed, or skipped; then finish."""

    name: str

    def start(self, run: RunInfo) -> None: ...
    def opened(self, stage: StageInfo) -> None: ...
    def metrics(self, stage: str, step: int, values: dict[str, float], wall: float) -> None: ...
    def artifact(self, stage: str, path: str) -> None: ...
    def closed(self, stage: str, status: str, summary: dict[str, float]) -> None: ...
    def skipped(self, stage: StageInfo, status: str) -> None: ...
    def finish(self, status: str) -> None: ...
    def link(self) -> str: ...


def local_path(path: str) -> str:
    """A tracker's folder: absolute, relative ones against the working directory."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def redact(text: str) -> str:
    """`scheme://user:secret@host` -> `scheme://***@host`, for links and warnings."""
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1***@", text)
