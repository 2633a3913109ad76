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
- `hub_inputs()`: which of those fields may name a Hugging Face hub repository
  (`org/name[@revision]`, pinned to a commit by the plan), and whether a model or a dataset;
- `preset_path(key, data)`: where a preset setting lands in this kind's config;
- `derive(ctx)`: values derived from others (`Derived(value, reason)`), applied
  where neither the user nor a preset set one;
- `check(ctx)`: the kind's own arithmetic and consistency checks, as located
  `Diagnostic`s made with `ctx.error(path, message)`;
- `headline(result)`: the line(s) `pipe run` ends with for the stage.

Inside: `config` (`StageConfig`, its hooks and what they take and return), `context` (what a
running stage knows: `StageContext`, `Slot`, `at_stage_end`) and `registry` (`@stage`,
`kinds()`). Import the names from here: `from engine.stage import StageConfig, stage`.
"""

from engine.stage.context import (
    DATE_ENV,
    STAGE_END,
    NodeLink,
    Slot,
    StageContext,
    at_stage_end,
    visible_names,
)
from engine.stage.hooks import (
    Derived,
    MemoryNeed,
    ResolveContext,
    RoleAlloc,
    StageConfig,
    nested_blocks,
)
from engine.stage.registry import (
    ENTRY_POINT_GROUP,
    StageFn,
    StageKind,
    get_kind,
    kinds,
    register_kind,
    reset_registry,
    stage,
)

__all__ = [
    "DATE_ENV",
    "ENTRY_POINT_GROUP",
    "STAGE_END",
    "Derived",
    "MemoryNeed",
    "NodeLink",
    "ResolveContext",
    "RoleAlloc",
    "Slot",
    "StageConfig",
    "StageContext",
    "StageFn",
    "StageKind",
    "at_stage_end",
    "get_kind",
    "kinds",
    "nested_blocks",
    "register_kind",
    "reset_registry",
    "stage",
    "visible_names",
]
