"""Resolve: `LoadedPipeline` -> `ResolvedPipeline`, every value explicit and its source known.

Merge order, lowest first: stage-kind defaults < profile < memory preset < pipeline `defaults:`
< stage `config:` < `--set` (already applied to the document). A preset applies each setting to
the stages that have it: where the kind's `preset_path` hook puts it (a top-level field by
default; a kind with a vLLM backend block puts the vLLM settings there).

Conflict rules, always reported:
- the memory preset wins over the profile (e.g. `memory_constrained` turns off
  `high-performance`'s colocation and `overlap_comm`): a warning names both;
- an explicit user value wins over any preset: a note where it contradicts the memory preset.

Then `@stage` references and relative paths are resolved (inputs against the pipeline's folder,
outputs inside `<run-dir>/<stage>/`, both made absolute), hub ids are pinned to a commit, GPU
roles are allocated (`engine.resolve.resources`), the kind derives what it derives from the rest
(its `derive` hook: values nobody set), and the stage is checked: stage GPUs within the cluster
here, the kind's own rules (engines x tensor-parallel size, batch sizes that divide, ...)
through its `check` hook.

This module runs those steps, stage after stage in the order of `needs`; each is a module:
`layers` (the merge and its conflicts, with provenance), `roles` (the GPUs of roles and
stages), `paths` (references and paths), `checks` (validation, derived values and checks);
`pins` (hub ids pinned to a commit); the stage under way is a `Draft` (`types`).
"""

from __future__ import annotations

import copy
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import Diagnostic, PipeError
from engine.load.load import LoadedPipeline, validate_document
from engine.load.source import Document, set_at
from engine.resolve.checks import check, context, derive, located, validated
from engine.resolve.layers import Layers
from engine.resolve.paths import resolve_paths
from engine.resolve.pins import Pinning, pin_hub_inputs
from engine.resolve.roles import Roles
from engine.resolve.types import GpusAuto, ResolvedPipeline, ResolvedStage
from engine.stage import kinds


def default_run_dir(loaded: LoadedPipeline) -> str:
    return posixpath.join("runs", loaded.spec.name)


@dataclass
class _State:
    """Working state of one resolution: the pipeline, its run folder, errors and notes."""

    loaded: LoadedPipeline
    doc: Document
    run_dir: str
    errors: list[Diagnostic] = field(default_factory=list)
    notes: list[Diagnostic] = field(default_factory=list)
    done: dict[str, ResolvedStage] = field(default_factory=dict)  # the stages resolved so far
    pinning: Pinning = field(default_factory=Pinning)


def resolve(
    loaded: LoadedPipeline,
    run_dir: str | None = None,
    gpus: int | None = None,
    gpus_from: str = "",
    pinning: Pinning | None = None,
) -> ResolvedPipeline:
    """Resolve presets, references, paths and resources; raise `PipeError` with every problem.
    `gpus` is what `cluster.gpus: auto` came to, `gpus_from` where from (none: a stand-in
    count); read as 0, the stages' GPU requests (`resources.gpus`, roles) are dropped: CPU.
    `pinning`: how hub ids are pinned and the commits read so far (none: asking the hub)."""
    spec = loaded.spec
    state = _State(loaded, loaded.doc, run_dir or default_run_dir(loaded))
    state.pinning = pinning or Pinning()
    layers = Layers.load(loaded, state.notes)
    colocate, colocate_source = layers.colocation()
    total = gpus if gpus is not None else spec.cluster.gpus
    roles = Roles(loaded, state.errors, state.notes)
    roles.cpu_only = spec.cluster.gpus == "auto" and total == 0 and bool(gpus_from)
    roles.allocate(total, colocate)
    from engine.load.graph import topological

    for name in topological(spec):
        resolved = _stage(state, layers, roles, name)
        if resolved is not None:
            state.done[name] = resolved
    if state.errors:
        raise PipeError(state.errors)
    layers.cautions(state.done)
    ordered = {n: state.done[n] for n in spec.stages if n in state.done}
    auto = None
    if spec.cluster.gpus == "auto" and isinstance(total, int) and gpus_from:
        wanting = tuple(n for n in ordered if n in roles.wanting or ordered[n].gpus)
        auto = GpusAuto(total, gpus_from, wanting)
    return ResolvedPipeline(
        loaded,
        state.run_dir,
        colocate,
        colocate_source,
        roles.alloc,
        ordered,
        state.notes,
        auto,
        state.pinning,
    )


def resolve_changed(
    resolved: ResolvedPipeline, changes: Mapping[str, Any], gpus: int | None
) -> ResolvedPipeline:
    """What if: the pipeline resolved again with `changes` (`{dotted path: value}`) made to a
    copy of its document, validated again, in the same run folder with the pins read so far;
    `PipeError` where it does not resolve. How a plan tries a bigger cluster and a refusal
    another memory preset."""
    loaded = resolved.loaded
    data = copy.deepcopy(loaded.doc.data)
    for dotted, value in changes.items():
        set_at(data, tuple(dotted.split(".")), value)
    doc = Document(loaded.doc.name, data, loaded.doc.values, loaded.doc.keys)
    again = validate_document(doc, loaded.path)
    return resolve(again, resolved.run_dir, gpus, pinning=resolved.pinning)


def _stage(state: _State, layers: Layers, roles: Roles, name: str) -> ResolvedStage | None:
    """One stage resolved after the stages it needs (`state.done`), or None after an error."""
    st = state.loaded.spec.stages[name]
    kind = kinds()[st.kind]
    gpus = roles.stage_gpus(name)
    draft = layers.stage(name, kind)
    resolve_paths(state, draft)
    view = located(state.doc, draft)
    config = validated(kind.config, draft.merged, view, state.errors)
    if config is None:
        return None
    pins = pin_hub_inputs(config, draft, view, state.pinning, state.errors)
    if pins:  # the hub ids now name their commits
        config = validated(kind.config, draft.merged, view, state.errors)
        if config is None:
            return None
    ctx = context(state.loaded, draft, gpus, roles.alloc, view, state.done)
    final = derive(config, ctx, draft, state.doc, state.errors)
    if final is None:
        return None
    res = st.resources
    held = () if res.role or res.gpus is not None else roles.kind_roles(name)
    resolved = ResolvedStage(
        name,
        st.kind,
        tuple(st.needs),
        res.role,
        gpus,
        st.retries,
        final,
        draft.sources,
        held,
        tuple(pins),
    )
    for diag in check(state.loaded, resolved, ctx):
        (state.errors if diag.severity == "error" else state.notes).append(diag)
    return resolved
