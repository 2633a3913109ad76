"""Load: a pipeline file (plus `--set` overrides) -> `LoadedPipeline`, or every error at once.

Input: a path and override strings. Output: `LoadedPipeline` (the validated
`PipelineSpec` and the `Document` that locates each value). Checks that belong
to the file live here: the structure and types, known kinds, profiles, memory
presets and roles, `needs` naming real stages without cycles, each stage's
config against its kind (merged with `defaults:`), and distinct output paths.
"""

from __future__ import annotations

import contextlib
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.errors import Diagnostic, PipeError, did_you_mean, found, one_of
from engine.load.overrides import apply_overrides
from engine.load.schema import PipelineSpec, StageSpec
from engine.load.source import Document, load_document, render_path
from engine.load.tracking_block import check_tracking
from engine.load.validation import validation_diagnostics
from engine.stage import StageKind, kinds


@dataclass(frozen=True)
class LoadedPipeline:
    """A validated pipeline and where each of its values was written."""

    path: Path
    doc: Document
    spec: PipelineSpec

    @property
    def base_dir(self) -> Path:
        """The pipeline file's folder: relative inputs resolve against it."""
        return self.path.parent


def load_pipeline(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> LoadedPipeline:
    """Read, override and validate a pipeline file; raise `PipeError` listing every problem."""
    doc = load_document(path)
    apply_overrides(doc, overrides)
    return validate_document(doc, Path(path))


def validate_document(doc: Document, path: Path) -> LoadedPipeline:
    """Validate a parsed document: all structural and cross-stage checks."""
    if not isinstance(doc.data, dict):
        raise PipeError.single(
            doc.value_loc(()),
            "",
            f"expected a mapping of pipeline settings at the top, found {found(doc.data)}",
        )
    errors: list[Diagnostic] = []
    spec: PipelineSpec | None = None
    try:
        spec = PipelineSpec.model_validate(doc.data)
    except ValidationError as exc:
        errors.extend(validation_diagnostics(exc, doc, (), doc.data, PipelineSpec))
    errors.extend(_check_stage_names(doc))
    parts = spec if spec is not None else _Parts.from_raw(doc.data)
    errors.extend(_check_stages(doc, parts))
    errors.extend(_check_presets(doc, parts, path.parent))
    if spec is not None:
        errors.extend(check_tracking(doc, spec.tracking))
    if errors or spec is None:
        raise PipeError(errors)
    return LoadedPipeline(path, doc, spec)


@dataclass
class _Parts:
    """The sections of an invalid pipeline that are valid on their own, so their checks still
    run."""

    stages: dict[str, StageSpec]
    defaults: dict[str, Any]
    profile: str
    memory: str
    presets: list[str]

    @classmethod
    def from_raw(cls, data: dict[str, Any]) -> _Parts:
        stages: dict[str, StageSpec] = {}
        raw = data.get("stages")
        if isinstance(raw, dict):
            for name, body in raw.items():
                with contextlib.suppress(ValidationError):
                    stages[name] = StageSpec.model_validate(body)
        defaults = data.get("defaults")
        presets = data.get("presets")
        return cls(
            stages=stages,
            defaults=defaults if isinstance(defaults, dict) else {},
            profile=_str(data.get("profile", "default")),
            memory=_str(data.get("memory", "default")),
            presets=[p for p in presets if isinstance(p, str)] if isinstance(presets, list) else [],
        )


def _str(value: Any) -> str:
    return value if isinstance(value, str) else "default"


def _check_stage_names(doc: Document) -> list[Diagnostic]:
    import re

    stages = doc.data.get("stages")
    if not isinstance(stages, dict):
        return []
    out = []
    for name in stages:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_-]*$", name):
            out.append(
                Diagnostic(
                    doc.key_loc(("stages", name)),
                    f"stages.{name}",
                    "stage names use letters, digits, '_' and '-', starting with a letter, "
                    f"found '{name}'",
                )
            )
    return out


def _check_stages(doc: Document, spec: PipelineSpec | _Parts) -> list[Diagnostic]:
    registry = kinds()
    names = list(spec.stages)
    errors: list[Diagnostic] = []
    for name, st in spec.stages.items():
        base = ("stages", name)
        for i, need in enumerate(st.needs):
            where = doc.value_loc((*base, "needs", i))
            path = render_path((*base, "needs", i))
            if need == name:
                errors.append(Diagnostic(where, path, f"stage '{name}' cannot need itself"))
            elif need not in spec.stages:
                hint = did_you_mean(need, names)
                errors.append(Diagnostic(where, path, f"no stage named '{need}'{hint}"))
            elif need in st.needs[:i]:
                errors.append(Diagnostic(where, path, f"'{need}' is listed twice"))
        kind = registry.get(st.kind)
        if kind is None:
            hint = did_you_mean(st.kind, sorted(registry))
            msg = f"unknown stage kind '{st.kind}'; expected {one_of(sorted(registry))}{hint}"
            errors.append(
                Diagnostic(doc.value_loc((*base, "kind")), render_path((*base, "kind")), msg)
            )
            continue
        errors.extend(_check_config(doc, spec, name, kind))
    errors.extend(_check_defaults(doc, spec, registry))
    errors.extend(_check_cycles(doc, spec))
    errors.extend(_check_outputs(doc, spec, registry))
    return errors


def stage_config_data(spec: PipelineSpec | _Parts, name: str, kind: StageKind) -> dict[str, Any]:
    """The stage's config as written, on top of the pipeline `defaults:` its kind has."""
    fields = kind.config.model_fields
    merged = {k: v for k, v in spec.defaults.items() if k in fields}
    merged.update(spec.stages[name].config)
    return merged


def _check_config(
    doc: Document, spec: PipelineSpec | _Parts, name: str, kind: StageKind
) -> list[Diagnostic]:
    data = stage_config_data(spec, name, kind)
    try:
        kind.config.model_validate(data)
    except ValidationError as exc:
        own = spec.stages[name].config
        out = []
        for diag in validation_diagnostics(exc, doc, ("stages", name, "config"), data, kind.config):
            out.append(diag)
        # errors in values that came from `defaults:` point there instead
        return [_reroute(d, doc, own, name) for d in out]
    return []


def _reroute(diag: Diagnostic, doc: Document, own: dict[str, Any], name: str) -> Diagnostic:
    prefix = f"stages.{name}.config."
    if not diag.path.startswith(prefix):
        return diag
    rest = diag.path[len(prefix) :]
    top = rest.split(".", 1)[0].split("[", 1)[0]
    if top in own or top not in (doc.data.get("defaults") or {}):
        return diag
    return Diagnostic(
        doc.value_loc(("defaults", top)), f"defaults.{rest}", f"{diag.message} (in stage '{name}')"
    )


def _check_defaults(doc: Document, spec: PipelineSpec | _Parts, registry: Any) -> list[Diagnostic]:
    known: set[str] = set()
    for kind in registry.values():
        known.update(kind.config.model_fields)
    out = []
    for key in spec.defaults:
        if key not in known:
            hint = did_you_mean(key, sorted(known))
            out.append(
                Diagnostic(
                    doc.key_loc(("defaults", key)),
                    f"defaults.{key}",
                    f"no stage kind has a setting '{key}'{hint}",
                )
            )
    return out


def _acyclic(spec: PipelineSpec | _Parts) -> bool:
    """Whether the needs form no cycle (Kahn's algorithm), without importing networkx (0.2-0.3 s
    of every `pipe run`): it is imported only to name the cycles of a pipeline that has one."""
    waiting = {
        n: {d for d in st.needs if d in spec.stages and d != n} for n, st in spec.stages.items()
    }
    ready = [n for n, needs in waiting.items() if not needs]
    done = 0
    needed_by: dict[str, list[str]] = {}
    for name, needs in waiting.items():
        for need in needs:
            needed_by.setdefault(need, []).append(name)
    while ready:
        name = ready.pop()
        done += 1
        for other in needed_by.get(name, ()):
            waiting[other].discard(name)
            if not waiting[other]:
                ready.append(other)
    return done == len(waiting)


def _check_cycles(doc: Document, spec: PipelineSpec | _Parts) -> list[Diagnostic]:
    if _acyclic(spec):
        return []
    import networkx as nx

    graph: Any = nx.DiGraph()
    graph.add_nodes_from(spec.stages)
    for name, st in spec.stages.items():
        graph.add_edges_from(
            (name, need) for need in st.needs if need in spec.stages and need != name
        )
    out = []
    for component in nx.strongly_connected_components(graph):
        if len(component) < 2:
            continue
        first = min(component, key=lambda n: doc.key_loc(("stages", n)))
        cycle = [u for u, _ in nx.find_cycle(graph.subgraph(component), source=first)]
        start = cycle.index(first) if first in cycle else 0
        cycle = cycle[start:] + cycle[:start]
        chain = " -> ".join(f"'{n}'" for n in [*cycle, cycle[0]])
        out.append(
            Diagnostic(
                doc.value_loc(("stages", cycle[0], "needs")),
                f"stages.{cycle[0]}.needs",
                f"needs form a cycle: {chain} (each needs the next)",
            )
        )
    return out


def output_key(stage: str, value: str) -> str:
    """Where an output lands, normalised, with the run directory left symbolic."""
    if "://" in value or value.startswith("/"):
        return posixpath.normpath(value)
    return posixpath.normpath(posixpath.join("<run-dir>", stage, value))


def _check_outputs(doc: Document, spec: PipelineSpec | _Parts, registry: Any) -> list[Diagnostic]:
    seen: dict[str, str] = {}
    out = []
    order = sorted(spec.stages, key=lambda n: doc.key_loc(("stages", n)))
    for name in order:
        kind = registry.get(spec.stages[name].kind)
        if kind is None:
            continue
        data = stage_config_data(spec, name, kind)
        for field in kind.config.OUTPUTS:
            value = data.get(field, kind.config.model_fields[field].default)
            if not isinstance(value, str):
                continue
            key = output_key(name, value)
            path = ("stages", name, "config", field)
            if key in seen:
                out.append(
                    Diagnostic(
                        doc.value_loc(path),
                        render_path(path),
                        f"'{value}' is also written by {seen[key]}",
                    )
                )
            else:
                seen[key] = f"stage '{name}' ({field})"
    return out


def _check_presets(doc: Document, spec: PipelineSpec | _Parts, base: Path) -> list[Diagnostic]:
    from engine.load.presets import available

    out = []
    for field, what in (("profile", "profile"), ("memory", "memory preset")):
        value = getattr(spec, field)
        names = available(field, base, spec.presets)
        if value not in names:
            hint = did_you_mean(value, sorted(names))
            msg = f"unknown {what} '{value}'; expected {one_of(sorted(names))}{hint}"
            out.append(Diagnostic(doc.value_loc((field,)), field, msg))
    return out
