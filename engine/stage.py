"""The stage API: a stage kind is a frozen config model plus one function.

    @stage("filter", config=FilterConfig)
    def filter_rollouts(cfg: FilterConfig, ctx: StageContext) -> None: ...

Kinds are found through the entry-point group `pipe.stages` (built-ins and
plugins alike): each entry point names a module whose `@stage` decorators
register its kinds, or a `StageKind` object. Stage modules must stay light at
import time (no torch): `pipe validate` imports them all.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

BUILTIN_KINDS = ("dataset", "collect", "filter", "train", "evaluate")
ENTRY_POINT_GROUP = "pipe.stages"


class StageConfig(BaseModel):
    """Base of every stage kind's config: frozen, and unknown keys are errors.

    `INPUTS` name the fields that read an upstream file (a relative path resolves
    against the pipeline's folder; left empty, the first upstream stage's main
    output). `OUTPUTS` name the fields the stage writes (relative paths resolve
    inside the stage's folder in the run directory); the first is its main output.
    An empty `input` with nothing in `needs` is an error unless `INPUT_OPTIONAL`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    INPUTS: ClassVar[tuple[str, ...]] = ()
    OUTPUTS: ClassVar[tuple[str, ...]] = ()
    INPUT_OPTIONAL: ClassVar[bool] = False


C = TypeVar("C", bound=StageConfig)


@dataclass
class StageContext:
    """What a running stage knows about its place in the run.

    By the time a stage function runs, its config is fully resolved: input fields
    hold absolute paths (or URLs), `@stage` references are replaced by the paths
    they name, and output fields are absolute paths inside `stage_dir`. The stage
    returns a JSON-serialisable dict of metrics; the engine writes it to
    `<stage_dir>/metrics.json` and puts it in the run report.
    """

    name: str
    kind: str
    stage_dir: str
    run_dir: str
    pipeline_dir: str
    attempt: int = 1
    gpus: int = 0
    workers: int = 1
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("pipe.stage"))

    def path(self, name: str) -> str:
        """A file inside this stage's folder."""
        return f"{self.stage_dir.rstrip('/')}/{name}"


StageFn = Callable[[Any, StageContext], Any]


@dataclass(frozen=True)
class StageKind:
    """A registered kind: its name, config model and function."""

    name: str
    config: type[StageConfig]
    fn: StageFn
    module: str

    def code_version(self) -> str:
        """Hash of the source of the module (or package) that defines the kind."""
        return _source_hash(self.module)


_REGISTRY: dict[str, StageKind] = {}
_LOADED = False


def stage(
    name: str, *, config: type[C]
) -> Callable[[Callable[[C, StageContext], Any]], Callable[[C, StageContext], Any]]:
    """Register `fn` as the stage kind `name` with the config model `config`."""

    def register(fn: Callable[[C, StageContext], Any]) -> Callable[[C, StageContext], Any]:
        _REGISTRY[name] = StageKind(name, config, fn, fn.__module__)
        return fn

    return register


def register_kind(kind: StageKind) -> None:
    """Register a kind built by hand (tests, plugins that prefer objects)."""
    _REGISTRY[kind.name] = kind


def kinds() -> Mapping[str, StageKind]:
    """Every known kind: entry points of `pipe.stages`, then any built-in not yet found."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            obj = ep.load()
            if isinstance(obj, StageKind):
                register_kind(obj)
        for builtin in BUILTIN_KINDS:
            if builtin not in _REGISTRY:
                importlib.import_module(f"stages.{builtin}")
    return _REGISTRY


def get_kind(name: str) -> StageKind | None:
    return kinds().get(name)


_HASHES: dict[str, str] = {}


def _source_hash(module_name: str) -> str:
    if module_name in _HASHES:
        return _HASHES[module_name]
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    digest = hashlib.sha256()
    origin = getattr(module, "__file__", None)
    if origin:
        path = Path(origin)
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
        for f in files:
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    else:
        digest.update(module_name.encode())
    _HASHES[module_name] = digest.hexdigest()[:16]
    return _HASHES[module_name]
