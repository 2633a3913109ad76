"""The stage API: a stage kind is a frozen config model plus one function.

    @stage("mykind", config=MyConfig)
    def run(cfg: MyConfig, ctx: StageContext) -> dict[str, Any]: ...

or, for a kind whose body is heavy and lives beside its light `__init__.py`, `stage("mykind",
config=MyConfig, run="mypkg.mykind.run:run")`: the body is imported only when the stage runs,
and it may import the config from the package without an import cycle.

Kinds are found through the entry-point group `pipe.stages` (built-ins and plugins alike): each
entry point names a module whose `@stage` decorators register its kinds, or a `StageKind`
object. Stage modules must stay light at import time (no torch): `pipe validate` imports them
all.

A kind owns its rules, as hooks on its config model; the engine calls them and
names no kind and no kind's field:

- `INPUTS` / `OUTPUTS` / `MODEL_INPUTS` / `INPUT_TYPES` / `OUTPUT_TYPES`: which
  (dotted) fields read and write files, and what they hold;
- `preset_path(key, data)`: where a preset setting lands in this kind's config;
- `derive(ctx)`: values derived from others (`Derived(value, reason)`), applied
  where neither the user nor a preset set one;
- `check(ctx)`: the kind's own arithmetic and consistency checks, as located
  `Diagnostic`s made with `ctx.error(path, message)`;
- `headline(result)`: the line(s) `pipe run` ends with for the stage.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from engine.errors import Diagnostic, Location

ENTRY_POINT_GROUP = "pipe.stages"


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
        """A diagnostic about the config value at dotted `path` ('' for the stage itself)."""
        where = f"stages.{self.stage}.config.{path}" if path else f"stages.{self.stage}"
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
    a hub id (kept as written when no such local path exists). `OUTPUTS` name
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


C = TypeVar("C", bound=StageConfig)


@dataclass(frozen=True)
class Slot:
    """Devices a stage holds on one worker of one node, for one role (or the whole stage)."""

    node: str
    worker: str | None
    devices: tuple[int, ...]
    role: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "worker": self.worker,
            "devices": list(self.devices),
            "role": self.role,
        }


# what stage code registered to release when the stage running in this process ends
STAGE_END: list[Callable[[], None]] = []


def at_stage_end(release: Callable[[], None]) -> None:
    """Run `release` at the end of every stage in this worker process from now on (e.g. a
    cache of models on a GPU: the next stage there may need that memory)."""
    if release not in STAGE_END:
        STAGE_END.append(release)


class NodeLink(Protocol):
    """How the tasks of a stage that spans nodes reach each other (Dask variables)."""

    def publish(self, key: str, value: str) -> None: ...
    def lookup(self, key: str, timeout_s: float) -> str: ...
    def abort(self, reason: str) -> None: ...
    def aborted(self) -> str | None: ...


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
    slots: tuple[Slot, ...] = ()  # every slot of the stage, on every node, in node order
    node_rank: int = 0  # which of the stage's nodes this task runs on
    link: NodeLink | None = None  # set when the stage spans nodes

    def path(self, name: str) -> str:
        """A file inside this stage's folder."""
        return f"{self.stage_dir.rstrip('/')}/{name}"

    @property
    def tasks(self) -> tuple[tuple[str, str | None], ...]:
        """The stage's (node, worker) pairs in rank order: one Dask task each."""
        return tuple(dict.fromkeys((s.node, s.worker) for s in self.slots))

    def node_slots(self, role: str | None = None) -> tuple[Slot, ...]:
        """This task's slots (its node and worker), of `role` when given."""
        if not self.slots:
            return ()
        here = self.tasks[self.node_rank]
        return tuple(
            s for s in self.slots if (s.node, s.worker) == here and (role is None or s.role == role)
        )

    def devices(self, role: str | None = None) -> tuple[int, ...]:
        """Device ids this task holds (of `role` when given); empty on a CPU stage."""
        return tuple(sorted({d for s in self.node_slots(role) for d in s.devices}))

    def device_env(self, role: str | None = None) -> dict[str, str]:
        """`CUDA_VISIBLE_DEVICES` for a process this task starts: its devices, as this worker
        names them; nothing on a CPU stage (the environment is left as it is)."""
        ids = self.devices(role)
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible_names(ids))} if ids else {}


def visible_names(ids: Sequence[int]) -> list[str]:
    """How device ids read in `CUDA_VISIBLE_DEVICES`: the worker's own entries when it has a
    list of names that are not the ids themselves (e.g. GPU UUIDs), else the ids."""
    own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if own and not all(d.isdigit() for d in own):
        return [own[i] if i < len(own) else str(i) for i in ids]
    return [str(i) for i in ids]


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
