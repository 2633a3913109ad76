"""Load, part two: a `Document` -> a validated `PipelineSpec`, or located errors.

The models are pydantic v2, frozen and `extra="forbid"` at every level, strict
(a quoted "64" is not a number), with a description on every field so the JSON
Schema carries editor hover text. A stage's `config:` is kept as the user wrote
it (resolve merges it with presets), but is checked here against its kind's
model merged with the pipeline `defaults:`, so `pipe validate` catches a typo
in any stage at once. Every pydantic error is mapped back to `file:line:col`
(`engine.load.validation`).
"""

from __future__ import annotations

import re
from datetime import date as Date
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from engine.errors import found
from engine.load.slurm import SlurmSpec
from engine.load.tracking_block import TrackingSpec

SCHEMES = ("tcp", "tls", "ucx", "inproc")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ADDRESS = re.compile(r"^(?P<scheme>[a-z]+)://\S+$")

Role = Literal["vllm", "actor", "critic", "ref", "teacher", "reward"]
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
                "expected 'local', 'slurm' or a Dask address "
                f"({', '.join(s + '://' for s in SCHEMES)}), found '{value}'"
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
        description="GPU ratio among roles (vllm, actor, critic, ref, teacher, reward), "
        "e.g. {vllm: 1, actor: 1, critic: 1}.",
    )
    colocate: Colocate = Field(
        "none",
        description="none, all, or groups of roles sharing GPUs, "
        "e.g. [[actor, ref], [critic, reward]] or [[ref, teacher]].",
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
        None, description="Take the GPUs of this role (vllm, actor, critic, ref, teacher, reward)."
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
        description="Extra preset files or folders, relative to this file "
        "(a presets/ folder beside it is read too).",
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Where stages run.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPU roles, ratio and colocation."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Values every stage's config starts from "
        "(applied to the stages that have them).",
    )
    stages: dict[str, StageSpec] = Field(min_length=1, description="The stages, by name.")
    date: Date | None = Field(
        None,
        description="The day chat templates that read the date (strftime_now) render, "
        "YYYY-MM-DD; unset, the day the run was planned (a resumed run keeps its own).",
        strict=False,
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers "
        "(tensorboard, mlflow, wandb; any subset, none by default).",
    )

    @field_validator("date", mode="before")
    @classmethod
    def _date(cls, value: Any) -> Any:
        if value is None or (isinstance(value, Date) and not isinstance(value, datetime)):
            return value
        if isinstance(value, str):
            try:
                return Date.fromisoformat(value)
            except ValueError:
                pass
        raise ValueError(f"expected a day as YYYY-MM-DD, found '{value}'")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                "expected letters, digits, '_', '-' or '.', starting with a letter, "
                f"found '{value}'"
            )
        return value
