"""Resolve, part of: a stage's merged config validated, then its kind's rules applied.

Input: a `Draft`, one stage's merged config data with the source of every value (merged by
`engine.resolve.layers`, references and paths resolved by `engine.resolve.paths`). Output: the
typed config of its kind, with the values it derives (its `derive` hook, applied where
neither the user nor a preset set one, each with the rule's reason as its source), and the
located diagnostics of the checks: what every stage shares (its GPUs within the cluster),
then the kind's own (its `check` hook). Validation errors point where each value was written.
"""

from __future__ import annotations

import copy
import itertools
import os
from typing import Any, TypeVar

from pydantic import ValidationError

from engine.errors import Diagnostic, Location
from engine.load.load import LoadedPipeline
from engine.load.source import Document, PathT, set_at
from engine.load.validation import validation_diagnostics
from engine.resolve.paths import stage_outputs
from engine.resolve.types import DEFAULT, Draft, ResolvedStage, Source
from engine.stage import Derived, ResolveContext, RoleAlloc, StageConfig

C = TypeVar("C", bound=StageConfig)


def located(doc: Document, draft: Draft) -> Document:
    """The draft's config as a document whose values are located where they were written."""
    locs: dict[PathT, Location] = {(): doc.key_loc(("stages", draft.name))}
    for dotted, src in draft.sources.items():
        if src.location is not None:
            locs[tuple(dotted.split("."))] = src.location
    return Document(doc.name, draft.merged, locs)


def validated(
    model: type[C], merged: dict[str, Any], view: Document, errors: list[Diagnostic]
) -> C | None:
    """`merged` as a `model`, or None with its errors (located in `view`) added to `errors`."""
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        errors.extend(validation_diagnostics(exc, view, (), merged, model))
        return None


def context(
    loaded: LoadedPipeline,
    draft: Draft,
    gpus: int,
    roles: dict[str, RoleAlloc],
    view: Document,
    done: dict[str, ResolvedStage],
) -> ResolveContext:
    """What the kind's `derive` and `check` hooks know of the stage (`view`: its config,
    located), with the stages resolved before it (`done`)."""
    name, sources = draft.name, draft.sources

    def locate(dotted: str) -> Location:
        path = tuple(dotted.split(".")) if dotted else ()
        whole = tuple(itertools.takewhile(lambda p: not p.isdigit(), path))
        loc = view.value_loc(whole)
        if whole != path:  # a list's entry: where it was written, when the list was written
            # in the stage's own config (else where the list came from: defaults, --set)
            own = ("stages", name, "config")
            entry = own + tuple(int(p) if p.isdigit() else p for p in path)
            if loaded.doc.value_loc(own + whole) == loc and entry in loaded.doc.values:
                return loaded.doc.values[entry]
        return loc

    def describe(dotted: str) -> str:
        return sources[dotted].render() if dotted in sources else DEFAULT.render()

    return ResolveContext(
        stage=name,
        gpus=gpus,
        role=loaded.spec.stages[name].resources.role,
        roles=roles,
        gpus_per_node=loaded.spec.cluster.gpus_per_node,
        explicit=frozenset(sources),
        pipeline_dir=os.path.abspath(loaded.base_dir),
        produced=stage_outputs(done),
        locate=locate,
        describe=describe,
    )


def derive(
    config: StageConfig, ctx: ResolveContext, draft: Draft, doc: Document, errors: list[Diagnostic]
) -> StageConfig | None:
    """Apply the kind's derived values where neither the user nor a preset set one."""
    derived: dict[str, Derived] = {
        k: v for k, v in config.derive(ctx).items() if k not in draft.sources
    }
    if not derived:
        return config
    for dotted, value in derived.items():
        set_at(draft.merged, tuple(dotted.split(".")), copy.deepcopy(value.value))
        draft.sources[dotted] = Source("rule", value.reason)
    return validated(type(config), draft.merged, located(doc, draft), errors)


def check(loaded: LoadedPipeline, stage: ResolvedStage, ctx: ResolveContext) -> list[Diagnostic]:
    """What every stage shares (its GPUs within the cluster), then the kind's own checks."""
    out: list[Diagnostic] = []
    cluster = loaded.spec.cluster
    if isinstance(cluster.gpus, int) and stage.gpus > cluster.gpus:
        out.append(
            Diagnostic(
                loaded.doc.value_loc(("stages", stage.name, "resources")),
                f"stages.{stage.name}.resources",
                f"asks for {stage.gpus} GPUs; the cluster has {cluster.gpus} (cluster.gpus)",
            )
        )
    return out + stage.config.check(ctx)
