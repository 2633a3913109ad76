"""Resolve, part of: its types. Under way, a `Draft`: one stage's config data as it is merged
and rewritten. Out, a `ResolvedPipeline` of `ResolvedStage`s, each a typed, frozen config
whose every value remembers its `Source` (provenance)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import Diagnostic, Location
from engine.load.load import LoadedPipeline
from engine.stage import RoleAlloc, StageConfig, StageKind


@dataclass(frozen=True)
class Source:
    """Where a resolved value came from."""

    label: str
    reason: str = ""
    location: Location | None = None

    def render(self) -> str:
        return f"{self.label}: {self.reason}" if self.reason else self.label


DEFAULT = Source("kind default")


@dataclass(frozen=True)
class Draft:
    """The stage being resolved: its name and kind, its config data as merged so far and the
    source of every value set in it (both filled in place, step after step)."""

    name: str
    kind: StageKind
    merged: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedStage:
    """A stage with its typed, fully explicit config."""

    name: str
    kind: str
    needs: tuple[str, ...]
    role: str | None
    gpus: int
    retries: int
    config: StageConfig
    sources: dict[str, Source]
    roles: tuple[str, ...] = ()  # roles held besides `role` (a kind's roles_used)
    pins: tuple[Any, ...] = ()  # its hub ids pinned to a commit (`engine.resolve.pins.Pinned`)

    def source(self, dotted: str) -> Source:
        return self.sources.get(dotted, DEFAULT)


@dataclass(frozen=True)
class GpusAuto:
    """`cluster.gpus: auto` resolved: the count, where it came from, and the stages that take
    GPUs when there are some (they run on the CPU when the count is 0)."""

    gpus: int
    source: str
    wanting: tuple[str, ...]


@dataclass(frozen=True)
class ResolvedPipeline:
    """The pipeline after presets, references, paths and resources are resolved."""

    loaded: LoadedPipeline
    run_dir: str
    colocate: Any
    colocate_source: Source
    roles: dict[str, RoleAlloc]
    stages: dict[str, ResolvedStage]
    notes: list[Diagnostic] = field(default_factory=list)
    gpus_auto: GpusAuto | None = None
    pinning: Any = None  # the commits hub ids were pinned to (`engine.resolve.pins.Pinning`)

    @property
    def name(self) -> str:
        return self.loaded.spec.name
