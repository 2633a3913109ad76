"""Resolve, part of: `@stage` references, default inputs, and relative paths of one stage.

Input: a `Draft` (its layers merged by `engine.resolve.layers`) and the stages resolved before
it. Output: the draft's config data rewritten in place, the source of each value set, and
located errors (a reference that does not hold, an input that nothing gives).

- `"@data"` names stage data's main output, `"@data.test_output"` a named one; the
  stage referred to must be among this stage's (transitive) `needs`.
- An empty `input` takes the main output of the first stage in `needs`; an empty
  list input the kind types (`INPUT_TYPES`, e.g. checkpoints) takes the main
  outputs of the stages in `needs` whose main output has that type.
- A relative input resolves against the pipeline file's folder; one of the
  kind's `MODEL_INPUTS` does too when it exists there (otherwise it is kept: a
  hub id such as `org/model`); a relative output lands in `<run-dir>/<stage>/`.
  Both become absolute, so the config means the same in every process it
  reaches; `shown()` gives the paths back relative to the working directory,
  as `pipe plan` prints them and cache keys hash them.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import Diagnostic, did_you_mean, one_of
from engine.load.source import PathT, get_at, set_at
from engine.resolve.types import Draft, ResolvedStage, Source

if TYPE_CHECKING:
    from engine.load.load import LoadedPipeline
    from engine.load.source import Document


class _State(Protocol):
    """What path resolution needs of the resolution under way."""

    loaded: LoadedPipeline
    doc: Document
    run_dir: str
    errors: list[Diagnostic]
    done: dict[str, ResolvedStage]  # the stages resolved so far


def is_remote(value: str) -> bool:
    return "://" in value


def ancestors(spec: Any, name: str) -> set[str]:
    seen: set[str] = set()
    stack = list(spec.stages[name].needs)
    while stack:
        need = stack.pop()
        if need in seen or need not in spec.stages:
            continue
        seen.add(need)
        stack.extend(spec.stages[need].needs)
    return seen


def resolve_paths(state: _State, draft: Draft) -> None:
    """Rewrite the draft's paths in place, recording sources: inputs against the pipeline's
    folder, `@stage` references, empty inputs from `needs`, outputs inside the stage's folder."""
    _inputs(state, draft)
    _references(state, draft, draft.merged, ())
    _defaults(state, draft)
    _outputs(state, draft)


def _inputs(state: _State, draft: Draft) -> None:
    base = os.path.abspath(state.loaded.base_dir)
    config, merged = draft.kind.config, draft.merged
    for field in config.INPUTS:
        path = tuple(field.split("."))
        value = get_at(merged, path)
        model = field in config.MODEL_INPUTS
        if isinstance(value, str):
            set_at(merged, path, _input_path(base, value, model))
        elif isinstance(value, list):
            set_at(
                merged,
                path,
                [_input_path(base, v, model) if isinstance(v, str) else v for v in value],
            )


def _outputs(state: _State, draft: Draft) -> None:
    config, merged = draft.kind.config, draft.merged
    for field in config.OUTPUTS:
        value = merged.get(field, config.model_fields[field].default)
        if isinstance(value, str) and not (value.startswith("/") or is_remote(value)):
            run_dir = os.path.abspath(state.run_dir)
            merged[field] = posixpath.normpath(posixpath.join(run_dir, draft.name, value))
            src = draft.sources.get(field)
            if src is None:
                draft.sources[field] = Source("kind default", "inside the stage's folder")


def _input_path(base: str, value: str, model: bool) -> str:
    if value.startswith("/") or is_remote(value) or value.startswith("@"):
        return value
    candidate = posixpath.normpath(posixpath.join(base, value))
    if model:
        return candidate if os.path.exists(candidate) else value
    return candidate


def stage_outputs(done: Mapping[str, ResolvedStage]) -> frozenset[str]:
    """Every output path of the stages resolved so far (absolute)."""
    return frozenset(
        out
        for st in done.values()
        for field in type(st.config).OUTPUTS
        if isinstance(out := getattr(st.config, field, None), str)
    )


def shown(value: str) -> str:
    """A resolved path as people read it: relative to the working directory when under it."""
    if not value.startswith("/"):
        return value
    rel = os.path.relpath(value)
    return value if rel.startswith("..") else rel


def shown_config(config: Any) -> dict[str, Any]:
    """The config as JSON data, every absolute path in it as `shown`."""

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return shown(value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    data: dict[str, Any] = walk(config.model_dump(mode="json"))
    return data


def _references(state: _State, draft: Draft, node: Any, path: PathT) -> None:
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in list(items):
        sub = (*path, key)
        if isinstance(value, dict | list):
            _references(state, draft, value, sub)
        elif isinstance(value, str) and value.startswith("@"):
            target = _target(state, draft, value, sub)
            if target is not None:
                node[key] = target


def _target(state: _State, draft: Draft, ref: str, path: PathT) -> str | None:
    spec, name, sources = state.loaded.spec, draft.name, draft.sources
    stage, _, field = ref[1:].partition(".")
    key = ".".join(str(p) for p in path if isinstance(p, str))
    src = sources.get(key)
    where = src.location if src is not None else state.doc.key_loc(("stages", name))
    dotted = f"stages.{name}.config.{key}"
    if stage not in spec.stages:
        msg = f"'{ref}' refers to no stage named '{stage}'{did_you_mean(stage, list(spec.stages))}"
        state.errors.append(Diagnostic(where, dotted, msg))
        return None
    if stage not in ancestors(spec, name):
        msg = (
            f"'{ref}' refers to stage '{stage}', which stage '{name}' does not need; "
            "add it to needs"
        )
        state.errors.append(Diagnostic(where, dotted, msg))
        return None
    upstream = state.done.get(stage)
    if upstream is None:
        return None
    outputs = type(upstream.config).OUTPUTS
    field = field or (outputs[0] if outputs else "")
    if field not in outputs:
        msg = (
            f"stage '{stage}' ({upstream.kind}) has no output '{field}'; "
            f"its outputs: {one_of(outputs)}"
        )
        state.errors.append(Diagnostic(where, dotted, msg))
        return None
    if src is not None:
        sources[key] = Source(src.label, ref if src.reason == "" else src.reason, src.location)
    return str(getattr(upstream.config, field))


def _defaults(state: _State, draft: Draft) -> None:
    name, config, merged, done = draft.name, draft.kind.config, draft.merged, state.done
    needs = state.loaded.spec.stages[name].needs
    for field in config.INPUTS:
        if "." in field or merged.get(field) not in (None, []):
            continue
        wanted = config.INPUT_TYPES.get(field)
        if wanted is not None:
            ups = [n for n in needs if n in done and _main_output_type(done[n]) == wanted]
            if ups:
                merged[field] = [
                    str(getattr(done[n].config, type(done[n].config).OUTPUTS[0])) for n in ups
                ]
                draft.sources[field] = Source(
                    "upstream", f"{wanted} outputs of the stages in needs: {', '.join(ups)}"
                )
        elif field == "input":
            if not needs and config.INPUT_OPTIONAL:
                continue
            if not needs:
                where = state.doc.key_loc(("stages", name))
                state.errors.append(
                    Diagnostic(
                        where,
                        f"stages.{name}.config.input",
                        "no input: set 'input' or add the stage that produces it to 'needs'",
                    )
                )
                continue
            up = done.get(needs[0])
            if up is not None and type(up.config).OUTPUTS:
                merged[field] = str(getattr(up.config, type(up.config).OUTPUTS[0]))
                draft.sources[field] = Source("upstream", f"main output of stage '{needs[0]}'")


def _main_output_type(stage: ResolvedStage) -> str | None:
    model = type(stage.config)
    return model.OUTPUT_TYPES.get(model.OUTPUTS[0]) if model.OUTPUTS else None
