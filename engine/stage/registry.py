"""The registry of stage kinds: `@stage` registers a kind, `kinds()` finds them all.

Input: the modules and `StageKind` objects of the entry-point group `pipe.stages` (built-ins
and plugins alike), whose `@stage` decorators register their kinds when imported. Output: the
`StageKind` of every name (its config model, its body, and the code version of its package).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from engine.stage.context import StageContext
from engine.stage.hooks import StageConfig

ENTRY_POINT_GROUP = "pipe.stages"

C = TypeVar("C", bound=StageConfig)

StageFn = Callable[[Any, StageContext], Any]


@dataclass(frozen=True)
class StageKind:
    """A registered kind: its name, config model and function (or "module:function")."""

    name: str
    config: type[StageConfig]
    fn: StageFn | str
    module: str

    def call(self, cfg: StageConfig, ctx: StageContext) -> Any:
        """Run the kind's body (imported now when it was registered by name)."""
        fn = self.fn
        if isinstance(fn, str):
            module, _, attr = fn.partition(":")
            fn = getattr(importlib.import_module(module), attr)
        return fn(cfg, ctx)

    def code_version(self) -> str:
        """Hash of every file of the kind's package and the shared code it imports."""
        from engine.codeversion import code_version

        return code_version(self.module)


_REGISTRY: dict[str, StageKind] = {}
_LOADED = False


def stage(
    name: str, *, config: type[C], run: str | None = None
) -> Callable[[Callable[[C, StageContext], Any]], Callable[[C, StageContext], Any]]:
    """Register the stage kind `name` with the config model `config`: the decorated function,
    or with `run="module:function"` that function, imported when a stage of the kind runs."""
    if run is not None:
        _REGISTRY[name] = StageKind(name, config, run, config.__module__)

    def register(fn: Callable[[C, StageContext], Any]) -> Callable[[C, StageContext], Any]:
        _REGISTRY[name] = StageKind(name, config, fn, config.__module__)
        return fn

    return register


def register_kind(kind: StageKind) -> None:
    """Register a kind built by hand (tests, plugins that prefer objects)."""
    _REGISTRY[kind.name] = kind


def kinds() -> Mapping[str, StageKind]:
    """Every known kind: the modules and objects of the entry-point group `pipe.stages`."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            obj = ep.load()
            if isinstance(obj, StageKind):
                register_kind(obj)
    return _REGISTRY


def get_kind(name: str) -> StageKind | None:
    return kinds().get(name)


def reset_registry() -> None:
    """Forget every kind and code hash; the next `kinds()` reads the entry points again."""
    global _LOADED
    _REGISTRY.clear()
    from engine.codeversion import forget_code_versions

    forget_code_versions()
    _LOADED = False
