"""Load, part two: a `Document` -> a validated `PipelineSpec`, or located errors.

The models are pydantic v2, frozen and `extra="forbid"` at every level, strict
(a quoted "64" is not a number), with a description on every field so the JSON
Schema carries editor hover text. A stage's `config:` is kept as the user wrote
it (resolve merges it with presets), but is checked here against its kind's
model merged with the pipeline `defaults:`, so `pipe validate` catches a typo
in any stage at once. Every pydantic error is mapped back to `file:line:col`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.errors import Diagnostic, did_you_mean, found, one_of
from engine.spec.slurm import SlurmSpec
from engine.spec.source import Document, PathT, render_path
from engine.spec.tracking import TrackingSpec

SCHEMES = ("tcp", "tls", "ucx", "inproc")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ADDRESS = re.compile(r"^(?P<scheme>[a-z]+)://\S+$")

Role = Literal["vllm", "actor", "critic", "ref", "reward"]
ROLES: tuple[str, ...] = get_args(Role)  # the one list of roles, in placement order


class Model(BaseModel):
    """Frozen, strict, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ClusterSpec(Model):
    """Where stages run."""

    scheduler: str = Field(
        "local",
        description="local (an embedded LocalCluster), slurm (workers as Slurm batch jobs, see "
        "'slurm') or a Dask scheduler address: tcp://host:8786, tls://...",
    )
    workers: int = Field(
        2, gt=0, description="Worker processes of the embedded LocalCluster (local only)."
    )
    gpus: int | Literal["auto"] = Field(
        0,
        description="Total GPUs, or auto: the Dask workers' (the embedded cluster's: this "
        "machine's visible GPUs); with none, the stages' GPU requests run on the CPU.",
    )
    gpus_per_node: int = Field(
        8, gt=0, description="GPUs on one node; a tensor-parallel group never spans nodes."
    )
    slurm: SlurmSpec = Field(
        default_factory=SlurmSpec,
        description="Slurm jobs for scheduler: slurm (one per node the plan needs).",
    )

    @field_validator("scheduler")
    @classmethod
    def _address(cls, value: str) -> str:
        if value in ("local", "slurm"):
            return value
        match = _ADDRESS.match(value)
        if match is None or match["scheme"] not in SCHEMES:
            raise ValueError(
                f"expected 'local', 'slurm' or a Dask address ({', '.join(s + '://' for s in SCHEMES)}), found '{value}'"
            )
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ):
            return value
        raise ValueError(f"expected a count of GPUs (0 or more) or 'auto', found {found(value)}")


def _colocate_tag(value: Any) -> str:
    return "groups" if isinstance(value, list) else "mode"


Colocate = Annotated[
    Annotated[Literal["none", "all"], Tag("mode")] | Annotated[list[list[Role]], Tag("groups")],
    Discriminator(_colocate_tag),
]


def _default_ratio() -> dict[Role, int]:
    return {"vllm": 1, "actor": 1, "critic": 1}


class ResourcesSpec(Model):
    """How GPUs are split among roles."""

    ratio: dict[Role, Annotated[int, Field(gt=0)]] = Field(
        default_factory=_default_ratio,
        description="GPU ratio among roles (vllm, actor, critic, ref, reward), e.g. {vllm: 1, actor: 1, critic: 1}.",
    )
    colocate: Colocate = Field(
        "none",
        description="none, all, or groups of roles sharing GPUs, e.g. [[actor, ref], [critic, reward]].",
    )

    @field_validator("colocate")
    @classmethod
    def _groups(cls, value: Any) -> Any:
        if isinstance(value, list):
            seen: set[str] = set()
            for group in value:
                if len(group) < 2:
                    raise ValueError("each colocation group needs at least two roles")
                for role in group:
                    if role in seen:
                        raise ValueError(f"role '{role}' is in more than one colocation group")
                    seen.add(role)
        return value


class StageResources(Model):
    """What a stage asks the cluster for."""

    role: Role | None = Field(
        None, description="Take the GPUs of this role (vllm, actor, critic, ref, reward)."
    )
    gpus: int | None = Field(None, ge=0, description="Take this many GPUs.")

    @model_validator(mode="after")
    def _one(self) -> StageResources:
        if self.role is not None and self.gpus is not None:
            raise ValueError("give either 'role' or 'gpus', not both")
        return self


class StageSpec(Model):
    """One node of the DAG."""

    kind: str = Field(
        description="The stage kind: dataset, collect, filter, train, evaluate, or a plugin's."
    )
    needs: list[str] = Field(
        default_factory=list,
        description="Stages that must finish first; their outputs feed this one.",
    )
    resources: StageResources = Field(
        default_factory=StageResources, description="GPUs the stage needs."
    )
    retries: int = Field(0, ge=0, le=100, description="Extra attempts when the stage fails.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The kind's settings (see its schema)."
    )


class PipelineSpec(Model):
    """A pipeline file."""

    name: str = Field(description="Pipeline name; the run directory defaults to runs/<name>/.")
    description: str = Field("", description="What the pipeline does.")
    profile: str = Field(
        "default",
        description="Preset profile: default, high-performance, max-throughput, or your own.",
    )
    memory: str = Field(
        "default", description="Memory preset: default, memory_constrained, or your own."
    )
    presets: list[str] = Field(
        default_factory=list,
        description="Extra preset files or folders, relative to this file (a presets/ folder beside it is read too).",
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Where stages run.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPU roles, ratio and colocation."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Values every stage's config starts from (applied to the stages that have them).",
    )
    stages: dict[str, StageSpec] = Field(min_length=1, description="The stages, by name.")
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers (tensorboard, mlflow, wandb; any subset, none by default).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"expected letters, digits, '_', '-' or '.', starting with a letter, found '{value}'"
            )
        return value


def validation_diagnostics(
    exc: ValidationError, doc: Document, prefix: PathT, data: Any, model: type[BaseModel]
) -> list[Diagnostic]:
    """Map pydantic errors on `data` (found at `prefix` in `doc`) to located diagnostics."""
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path, rest, at_key = _data_path(data, loc)
        full = (*prefix, *path)
        message = _message(err, rest, model, loc)
        error_type = err["type"]
        if error_type in ("union_tag_invalid",) and isinstance(_get(data, path), dict):
            full = (*full, "kind")
        if error_type in ("extra_forbidden", "missing", "union_tag_not_found") or at_key:
            where = doc.key_loc(full)
        else:
            where = doc.value_loc(full)
        out.append(Diagnostic(where, render_path(full), message))
    return out


def _get(data: Any, path: PathT) -> Any:
    for part in path:
        data = data[part]
    return data


def _data_path(data: Any, loc: tuple[Any, ...]) -> tuple[PathT, list[Any], bool]:
    """Follow a pydantic `loc` through the data; union tags are skipped, missing names returned."""
    path: list[str | int] = []
    cur = data
    for i, part in enumerate(loc):
        if part == "[key]":
            return tuple(path), [], True
        if (isinstance(cur, dict) and part in cur) or (
            isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        ):
            path.append(part)
            cur = cur[part]
        elif i == len(loc) - 1:
            return tuple(path), [part], False
    return tuple(path), [], False


def _message(
    err: Mapping[str, Any], rest: list[Any], model: type[BaseModel], loc: tuple[Any, ...]
) -> str:
    error_type = err["type"]
    ctx = err.get("ctx") or {}
    shown = found(err.get("input"))
    if error_type == "extra_forbidden":
        key = str(loc[-1])
        return f"unknown field '{key}'{did_you_mean(key, sorted(allowed_fields(model, loc[:-1])))}"
    if error_type == "missing":
        return f"missing required field '{loc[-1]}'"
    if error_type == "union_tag_not_found":
        return f"missing required field '{ctx.get('discriminator', 'kind').strip(chr(39))}'"
    if error_type == "union_tag_invalid":
        tags = re.findall(r"'([^']*)'", str(ctx.get("expected_tags", "")))
        tag = str(ctx.get("tag"))
        return f"expected {one_of(tags)}, found '{tag}'{did_you_mean(tag, tags)}"
    if error_type == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(err["input"], options) if isinstance(err.get("input"), str) else ""
        return f"expected {one_of(options)}, found {shown}{hint}"
    simple = {
        "int_type": "an integer",
        "int_parsing": "an integer",
        "int_from_float": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "string_type": "a string",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
        "list_type": "a list",
    }
    if error_type in simple:
        return f"expected {simple[error_type]}, found {shown}"
    bounds = {
        "greater_than": ("greater than", "gt"),
        "greater_than_equal": ("at least", "ge"),
        "less_than": ("less than", "lt"),
        "less_than_equal": ("at most", "le"),
    }
    if error_type in bounds:
        words, key = bounds[error_type]
        return f"expected a number {words} {ctx.get(key)}, found {shown}"
    if error_type == "too_short":
        return (
            f"expected at least {ctx.get('min_length')} item(s), found {ctx.get('actual_length')}"
        )
    if error_type in ("value_error", "assertion_error"):
        msg = str(err["msg"])
        for lead in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(lead)
        return msg
    msg = str(err["msg"])
    return msg[:1].lower() + msg[1:]


def allowed_fields(model: Any, loc: tuple[Any, ...]) -> set[str]:
    """Field names of the model(s) reached by following `loc` from `model`."""
    current: list[Any] = [model]
    for part in loc:
        nxt: list[Any] = []
        for ann in _expand(current):
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                field = ann.model_fields.get(str(part))
                if field is not None:
                    nxt.append(field.annotation)
                else:
                    nxt.append(ann)  # a union tag: stay on this model
            elif get_origin(ann) in (dict, Mapping):
                args = get_args(ann)
                nxt.append(args[1] if len(args) == 2 else Any)
            elif get_origin(ann) is list:
                args = get_args(ann)
                nxt.append(args[0] if args else Any)
        current = nxt
    names: set[str] = set()
    for ann in _expand(current):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names.update(ann.model_fields)
    return names


def _expand(annotations: list[Any]) -> list[Any]:
    """Unwrap Annotated and unions into their member types."""
    out: list[Any] = []
    stack = list(annotations)
    while stack:
        ann = stack.pop()
        origin = get_origin(ann)
        if origin is Annotated:
            stack.append(get_args(ann)[0])
        elif origin is not None and origin not in (dict, list, Mapping, Literal) and get_args(ann):
            stack.extend(get_args(ann))
        else:
            out.append(ann)
    return out
