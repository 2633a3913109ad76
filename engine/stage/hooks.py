"""The config side of the stage API: `StageConfig`, the base of every kind's config model,
with the hooks the engine calls while it resolves and plans a stage, and what they take and
return.

Input: a kind's config fields and hook methods. Output, through the hooks: where presets land
(`preset_path`), the roles a stage holds (`roles_used`), derived values (`Derived`), the
kind's own checks (located `Diagnostic`s, made through the `ResolveContext`), what its roles
need memory for (`MemoryNeed`) and the changes that cut it.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from engine.errors import Diagnostic, Location


@dataclass(frozen=True)
class RoleAlloc:
    """GPUs one role holds and the roles sharing them."""

    gpus: int
    colocated_with: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "colocated_with": list(self.colocated_with)}


@dataclass(frozen=True)
class Derived:
    """A value a kind derives from others, and why."""

    value: Any
    reason: str


@dataclass(frozen=True)
class MemoryNeed:
    """What a role of a stage needs memory for: a kind's `memory_needs` hook returns them and
    `engine.plan.memory` estimates them (role empty: the stage's role, or its kind's name)."""

    role: str = ""
    profile: str = (
        "trainer"  # "trainer" (weights, gradients, optimizer, activations), "frozen", "engine"
    )
    model: Any = None  # a checkpoint directory or a tiny-model spec mapping
    zero_stage: int = 0
    adam_offload: bool = False
    bf16: bool = False
    gradient_checkpointing: bool = False
    micro_batch: int = 1
    seq_len: int = 512
    utilization: float = 0.9  # engine: vllm_gpu_memory_utilization
    sleep: bool = False  # trainer: deepspeed_enable_sleep; engine: vllm_enable_sleep
    overlap_comm: bool = False  # trainer: two reduce buckets instead of one
    # trainer: LoRA adapters of this rank on these modules train, the base stays frozen
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    # the role whose processes load it when its own role has no devices ("stage": the stage's
    # own ranks, whatever role it is placed as)
    inside: str = ""


@dataclass(frozen=True)
class ResolveContext:
    """What a kind's `derive` and `check` hooks know about the stage being resolved."""

    stage: str
    gpus: int
    role: str | None
    roles: Mapping[str, RoleAlloc]
    gpus_per_node: int
    explicit: frozenset[str] = frozenset()  # dotted config paths set by the user or a preset
    # the pipeline file's folder (absolute): a run imports a filter's predicate from there
    pipeline_dir: str = ""
    produced: frozenset[str] = frozenset()  # earlier stages' outputs: made when they run
    locate: Callable[[str], Location | None] = field(default=lambda _: None, repr=False)
    describe: Callable[[str], str] = field(default=lambda _: "kind default", repr=False)

    def error(self, path: str, message: str, severity: str = "error") -> Diagnostic:
        """A diagnostic about the config value at dotted `path` ('' for the stage itself; a
        number part is a list's entry: `lora.target_modules.1`, shown `target_modules[1]`)."""
        shown = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)
        where = f"stages.{self.stage}.config.{shown}" if path else f"stages.{self.stage}"
        return Diagnostic(self.locate(path), where, message, severity)

    def warning(self, path: str, message: str) -> Diagnostic:
        return self.error(path, message, "warning")

    def source(self, path: str) -> str:
        """Where the value at `path` came from, as `pipe plan --explain` shows it."""
        return self.describe(path)

    def is_produced(self, path: str) -> bool:
        """Whether `path` is, or lies under, an earlier stage's output (made when it runs)."""
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.produced)


class StageConfig(BaseModel):
    """Base of every stage kind's config: frozen, and unknown keys are errors.

    `INPUTS` name the (dotted) fields that read an upstream file or directory (a
    relative path resolves against the pipeline's folder; left empty, the first
    upstream stage's main output); `MODEL_INPUTS` those of them that may also be
    a hub id (kept as written when no such local path exists; `hub_inputs` says which are
    read from the hub and how). `OUTPUTS` name
    the fields the stage writes (relative paths resolve inside the stage's
    folder in the run directory); the first is its main output. `SPANS_NODES`
    says the kind's body can run as one task per worker of its placement (its
    `StageContext` tells each task its rank); `gpu_unit` how many GPUs must stay
    on one node together. `OUTPUT_TYPES`
    say what an output holds (e.g. `{"output": "checkpoint"}`); a list-valued
    input named in `INPUT_TYPES` and left empty takes the main outputs of the
    stages in `needs` whose main output has that type. An empty `input` with
    nothing in `needs` is an error unless `INPUT_OPTIONAL`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    INPUTS: ClassVar[tuple[str, ...]] = ()
    MODEL_INPUTS: ClassVar[tuple[str, ...]] = ()
    OUTPUTS: ClassVar[tuple[str, ...]] = ()
    INPUT_OPTIONAL: ClassVar[bool] = False
    INPUT_TYPES: ClassVar[dict[str, str]] = {}
    OUTPUT_TYPES: ClassVar[dict[str, str]] = {}
    SPANS_NODES: ClassVar[bool] = False  # may one stage run on several workers (a task each)?
    # GPU roles the kind cannot use, each with why and what instead: a stage of the kind
    # naming one in `resources.role`, or a ratio naming one no stage uses, is an error
    REFUSED_ROLES: ClassVar[dict[str, str]] = {}

    @classmethod
    def refused_roles(cls, data: Mapping[str, Any]) -> dict[str, str]:
        """The roles a stage written as `data` cannot use, each with why: by default the
        kind's `REFUSED_ROLES` (a kind may lift one by its config: the rl stage's `reward`
        with a reward_model)."""
        return dict(cls.REFUSED_ROLES)

    def gpu_unit(self, role: str | None = None) -> int:
        """GPUs that must sit on one node together (a tensor-parallel group), for the stage
        or, in a stage holding several roles, for `role`."""
        return 1

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        """Where preset setting `key` lands for a stage written as `data`; None: not here."""
        return (key,) if key in cls.model_fields else None

    @classmethod
    def roles_used(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        """GPU roles a stage written as `data` holds besides its `resources.role` (an online-RL
        stage: its engines, actor, reference, ...); they take part in the ratio split."""
        return ()

    def hub_inputs(self) -> dict[str, str]:
        """The (dotted) fields that may name a Hugging Face hub repository (`org/name`,
        `org/name@revision`), with its type: model or dataset. The plan pins each such value
        to a commit (`org/name@<sha>`, in the config and so in the cache key); when the stage
        runs, a model's value is its local snapshot folder (fetched on the stage's node), a
        dataset's stays `org/name@<sha>` for the stage to read at that revision. By default
        the `MODEL_INPUTS`, as models, but a `chat_template` (a family name or a Jinja file,
        resolved like a model path, never a repository)."""
        return dict.fromkeys((f for f in self.MODEL_INPUTS if f != "chat_template"), "model")

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        """Values derived from others, by dotted path."""
        return {}

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """The kind's own checks of a resolved config."""
        return []

    def memory_needs(self) -> list[MemoryNeed]:
        """What the stage's roles need memory for on their GPUs (empty: nothing estimated)."""
        return []

    def memory_changes(self) -> list[tuple[str, Any]]:
        """Changes to this config that cut memory, cheapest first (`(dotted field, value)`)."""
        return []

    def workers_used(self, workers: int) -> int:
        """How many of a cluster's `workers` a stage keeps busy at once: its own task plus the
        tasks it submits from inside it. The embedded cluster starts no more workers than the
        stages to run use together (`ctx.workers` is the number started), so a kind that fans
        out over the workers (or reads `ctx.workers`) says so here."""
        return 1

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """What `pipe run` prints for the stage at the end, from the metrics its body
        returned (`metrics.json`): one line, or a small table; empty: nothing to say."""
        return []


@functools.cache
def nested_blocks(model: type[BaseModel]) -> frozenset[str]:
    """Fields of `model` holding a nested config block (a pydantic model, maybe in a union)."""
    out = set()
    for name, info in model.model_fields.items():
        if any(_is_model(t) for t in _leaf_types(info.annotation)):
            out.add(name)
    return frozenset(out)


def _leaf_types(annotation: Any) -> Iterator[Any]:
    args = typing.get_args(annotation)
    if not args:
        yield annotation
        return
    for arg in args:
        yield from _leaf_types(arg)


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)
