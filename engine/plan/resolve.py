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
outputs inside `<run-dir>/<stage>/`, both made absolute), GPU roles are allocated
(`engine.plan.resources`), the kind derives what it derives from the rest (its `derive` hook:
values nobody set), and the stage is checked: stage GPUs within the cluster here, the kind's own
rules (engines x tensor-parallel size, batch sizes that divide, ...) through its `check` hook.
"""

from __future__ import annotations

import copy
import os
import posixpath
from typing import Any

from pydantic import ValidationError

from engine.errors import Diagnostic, Location, PipeError, did_you_mean, found
from engine.plan.paths import leaves
from engine.plan.resolved import DEFAULT, GpusAuto, ResolvedPipeline, ResolvedStage, Source
from engine.plan.resources import allocate, ratio_text, refused_roles
from engine.spec.load import LoadedPipeline, stage_config_data
from engine.spec.presets import PresetSource, load_preset
from engine.spec.schema import validation_diagnostics
from engine.spec.source import Document, PathT, get_at, render_path, set_at
from engine.stage import (
    Derived,
    ResolveContext,
    RoleAlloc,
    StageConfig,
    StageKind,
    kinds,
    nested_blocks,
)


def default_run_dir(loaded: LoadedPipeline) -> str:
    return posixpath.join("runs", loaded.spec.name)


def resolve(
    loaded: LoadedPipeline, run_dir: str | None = None, gpus: int | None = None, gpus_from: str = ""
) -> ResolvedPipeline:
    """Resolve presets, references, paths and resources; raise `PipeError` with every problem.
    `gpus` is what `cluster.gpus: auto` came to, `gpus_from` where from (none: a stand-in
    count); read as 0, the stages' GPU requests (`resources.gpus`, roles) are dropped: CPU."""
    spec = loaded.spec
    base = loaded.base_dir
    profile = load_preset("profile", spec.profile, base, spec.presets)
    memory = load_preset("memory", spec.memory, base, spec.presets)
    state = _State(loaded, run_dir or default_run_dir(loaded), profile, memory)
    colocate, colocate_source = state.colocation()
    total = gpus if gpus is not None else spec.cluster.gpus
    state.cpu_only = spec.cluster.gpus == "auto" and total == 0 and bool(gpus_from)
    roles: dict[str, RoleAlloc] = {}
    used = state.used_roles()
    state.refused = refused_roles(loaded.doc, spec, used, state.errors)
    if isinstance(total, int) and used:
        where = loaded.doc.value_loc(("cluster", "gpus"))
        ratio = state.ratio(used)
        roles, errs = allocate(total, ratio, colocate, where, ratio_text(ratio), used)
        state.errors.extend(errs)
        state.alloc_failed = bool(errs)
    stages: dict[str, ResolvedStage] = {}
    from engine.spec.graph import topological

    for name in topological(spec):
        resolved = state.stage(name, roles, stages)
        if resolved is not None:
            stages[name] = resolved
    if state.errors:
        raise PipeError(state.errors)
    for preset in (profile, memory):
        applied = any(
            src.label == preset.label for st in stages.values() for src in st.sources.values()
        )
        if preset.preset.caution and applied:
            key = preset.preset.kind
            state.note("warning", loaded.doc.value_loc((key,)), key, preset.preset.caution)
    ordered = {n: stages[n] for n in spec.stages if n in stages}
    auto = None
    if spec.cluster.gpus == "auto" and isinstance(total, int) and gpus_from:
        wanting = tuple(n for n in ordered if n in state.wanting or ordered[n].gpus)
        auto = GpusAuto(total, gpus_from, wanting)
    return ResolvedPipeline(
        loaded, state.run_dir, colocate, colocate_source, roles, ordered, state.notes, auto
    )


class _State:
    """Working state of one resolution: the presets, collected errors and notes."""

    def __init__(
        self, loaded: LoadedPipeline, run_dir: str, profile: PresetSource, memory: PresetSource
    ) -> None:
        self.loaded = loaded
        self.doc = loaded.doc
        self.run_dir = run_dir
        self.profile = profile
        self.memory = memory
        self.errors: list[Diagnostic] = []
        self.notes: list[Diagnostic] = []
        self.alloc_failed, self.refused = False, set[str]()  # refused: their role is refused
        self.cpu_only = False  # `cluster.gpus: auto` came to 0
        self.wanting: set[str] = set()  # stages whose GPU requests that dropped

    def note(self, severity: str, where: Location | None, path: str, message: str) -> None:
        self.notes.append(Diagnostic(where, path, message, severity))

    def preset_source(self, preset: PresetSource, key: str) -> Source:
        setting = preset.preset.settings.get(key)
        reason = (
            setting.reason
            if setting
            else (
                preset.preset.resources.colocate.reason if preset.preset.resources.colocate else ""
            )
        )
        return Source(preset.label, reason, preset.locations.get(key))

    def user_source(self, path: PathT) -> Source:
        loc = self.doc.value_loc(path)
        return Source(str(loc), "", loc)

    # -- roles ------------------------------------------------------------------------------
    def used_roles(self) -> frozenset[str]:
        """Roles some stage holds: its `resources.role`, or those its kind says it uses."""
        spec = self.loaded.spec
        used: set[str] = set()
        for name, st in spec.stages.items():
            if st.resources.role:
                used.add(st.resources.role)
            used.update(self.kind_roles(name))
        return frozenset(used)

    def kind_roles(self, name: str) -> tuple[str, ...]:
        """The roles a stage's kind says it holds (an online-RL stage's engines, actor, ...)."""
        spec = self.loaded.spec
        kind = kinds().get(spec.stages[name].kind)
        if kind is None:
            return ()
        return kind.config.roles_used(stage_config_data(spec, name, kind))

    def ratio(self, used: frozenset[str]) -> dict[str, int]:
        """The written ratio over the used roles (a role no stage uses is dropped, with a
        warning), or 1 for every used role when none is written."""
        raw = self.doc.data.get("resources")
        if not (isinstance(raw, dict) and "ratio" in raw):
            return {r: 1 for r in used}
        ratio = {str(r): n for r, n in self.loaded.spec.resources.ratio.items()}
        for role in ratio:
            if role not in used:
                self.note(
                    "warning",
                    self.doc.key_loc(("resources", "ratio", role)),
                    f"resources.ratio.{role}",
                    f"no stage uses role '{role}'; it gets no GPUs",
                )
        return {r: n for r, n in ratio.items() if r in used}

    # -- colocation -------------------------------------------------------------------------
    def colocation(self) -> tuple[Any, Source]:
        value: Any = "none"
        source = DEFAULT
        for preset in (self.profile, self.memory):
            setting = preset.preset.resources.colocate
            if setting is None:
                continue
            if (
                preset is self.memory
                and source.label == self.profile.label
                and setting.value != value
            ):
                self.note(
                    "warning",
                    self.doc.value_loc(("memory",)),
                    "resources.colocate",
                    f"memory preset '{self.memory.preset.name}' sets {found(setting.value, whole=True)} over "
                    f"profile '{self.profile.preset.name}''s {found(value, whole=True)} ({setting.reason})",
                )
            value, source = setting.value, self.preset_source(preset, "colocate")
        raw = self.doc.data.get("resources")
        if isinstance(raw, dict) and "colocate" in raw:
            user = self.loaded.spec.resources.colocate
            if source.label == self.memory.label and user != value:
                self._contradicts(("resources", "colocate"), user, value, source)
            value, source = user, self.user_source(("resources", "colocate"))
        return value, source

    def _contradicts(self, path: PathT, user: Any, preset_value: Any, source: Source) -> None:
        self.note(
            "note",
            self.doc.value_loc(path),
            render_path(path),
            f"{found(user, whole=True)} overrides memory preset '{self.memory.preset.name}''s {found(preset_value, whole=True)} ({source.reason})",
        )

    # -- one stage --------------------------------------------------------------------------
    def stage(
        self, name: str, roles: dict[str, RoleAlloc], done: dict[str, ResolvedStage]
    ) -> ResolvedStage | None:
        spec = self.loaded.spec
        st = spec.stages[name]
        kind = kinds()[st.kind]
        gpus = self.stage_gpus(name, roles)
        merged, sources = self.layers(name, kind)
        self.references(name, kind, merged, sources, done)
        view = self.view(name, merged, sources)
        try:
            config = kind.config.model_validate(merged)
        except ValidationError as exc:
            self.errors.extend(validation_diagnostics(exc, view, (), merged, kind.config))
            return None
        ctx = self.context(name, gpus, roles, sources, view, done)
        final = self.derive(config, ctx, merged, sources)
        if final is None:
            return None
        resolved = ResolvedStage(
            name,
            st.kind,
            tuple(st.needs),
            st.resources.role,
            gpus,
            st.retries,
            final,
            sources,
            () if st.resources.role or st.resources.gpus is not None else self.kind_roles(name),
        )
        for diag in self.check(resolved, ctx):
            (self.errors if diag.severity == "error" else self.notes).append(diag)
        return resolved

    def check(self, stage: ResolvedStage, ctx: ResolveContext) -> list[Diagnostic]:
        """What every stage shares (its GPUs within the cluster), then the kind's own checks."""
        out: list[Diagnostic] = []
        cluster = self.loaded.spec.cluster
        if isinstance(cluster.gpus, int) and stage.gpus > cluster.gpus:
            out.append(
                Diagnostic(
                    self.doc.value_loc(("stages", stage.name, "resources")),
                    f"stages.{stage.name}.resources",
                    f"asks for {stage.gpus} GPUs; the cluster has {cluster.gpus} (cluster.gpus)",
                )
            )
        return out + stage.config.check(ctx)

    def view(self, name: str, merged: dict[str, Any], sources: dict[str, Source]) -> Document:
        """The merged config as a document whose values are located where they were written."""
        locs: dict[PathT, Location] = {(): self.doc.key_loc(("stages", name))}
        for dotted, src in sources.items():
            if src.location is not None:
                locs[tuple(dotted.split("."))] = src.location
        return Document(self.doc.name, merged, locs)

    def context(
        self,
        name: str,
        gpus: int,
        roles: dict[str, RoleAlloc],
        sources: dict[str, Source],
        view: Document,
        done: dict[str, ResolvedStage],
    ) -> ResolveContext:
        def locate(dotted: str) -> Location:
            return view.value_loc(tuple(dotted.split(".")) if dotted else ())

        def describe(dotted: str) -> str:
            return sources[dotted].render() if dotted in sources else DEFAULT.render()

        from engine.plan.paths import stage_outputs

        return ResolveContext(
            stage=name,
            gpus=gpus,
            role=self.loaded.spec.stages[name].resources.role,
            roles=roles,
            gpus_per_node=self.loaded.spec.cluster.gpus_per_node,
            explicit=frozenset(sources),
            pipeline_dir=os.path.abspath(self.loaded.base_dir),
            produced=stage_outputs(done),
            locate=locate,
            describe=describe,
        )

    def derive(
        self,
        config: StageConfig,
        ctx: ResolveContext,
        merged: dict[str, Any],
        sources: dict[str, Source],
    ) -> StageConfig | None:
        """Apply the kind's derived values where neither the user nor a preset set one."""
        derived: dict[str, Derived] = {
            k: v for k, v in config.derive(ctx).items() if k not in sources
        }
        if not derived:
            return config
        for dotted, value in derived.items():
            set_at(merged, tuple(dotted.split(".")), copy.deepcopy(value.value))
            sources[dotted] = Source("rule", value.reason)
        try:
            return type(config).model_validate(merged)
        except ValidationError as exc:
            view = self.view(ctx.stage, merged, sources)
            self.errors.extend(validation_diagnostics(exc, view, (), merged, type(config)))
            return None

    def layers(self, name: str, kind: StageKind) -> tuple[dict[str, Any], dict[str, Source]]:
        spec = self.loaded.spec
        user = copy.deepcopy(stage_config_data(spec, name, kind))
        merged: dict[str, Any] = {}
        sources: dict[str, Source] = {}
        for preset in (self.profile, self.memory):
            for key, setting in preset.preset.settings.items():
                target = kind.config.preset_path(key, user)
                if target is None:
                    continue
                dotted = ".".join(map(str, target))
                before = sources.get(dotted)
                if (
                    preset is self.memory
                    and before is not None
                    and before.label == self.profile.label
                    and get_at(merged, target) != setting.value
                ):
                    self.note(
                        "warning",
                        self.doc.value_loc(("memory",)),
                        f"stages.{name}.config.{dotted}",
                        f"memory preset '{self.memory.preset.name}' sets {found(setting.value, whole=True)} over "
                        f"profile '{self.profile.preset.name}''s {found(get_at(merged, target), whole=True)} ({setting.reason})",
                    )
                set_at(merged, target, copy.deepcopy(setting.value))
                sources[dotted] = self.preset_source(preset, key)
        own = spec.stages[name].config
        for path, value in leaves(user, nested_blocks(kind.config)):
            dotted = ".".join(map(str, path))
            top = str(path[0])
            origin: PathT = ("stages", name, "config", *path) if top in own else ("defaults", *path)
            before = sources.get(dotted)
            if (
                before is not None
                and before.label == self.memory.label
                and get_at(merged, path) != value
            ):
                self._contradicts(origin, value, get_at(merged, path), before)
            set_at(merged, path, copy.deepcopy(value))
            sources[dotted] = self.user_source(origin)
        return merged, sources

    def references(
        self,
        name: str,
        kind: StageKind,
        merged: dict[str, Any],
        sources: dict[str, Source],
        done: dict[str, ResolvedStage],
    ) -> None:
        from engine.plan.paths import resolve_paths

        resolve_paths(self, name, kind, merged, sources, done)

    def stage_gpus(self, name: str, roles: dict[str, RoleAlloc]) -> int:
        res = self.loaded.spec.stages[name].resources
        if self.cpu_only and (res.gpus or res.role or self.kind_roles(name)):
            self.wanting.add(name)  # `cluster.gpus: auto` came to 0: on the CPU
            return 0
        if res.gpus is not None:
            return res.gpus
        if res.role is None:
            held = self.kind_roles(name)
            pools = {(r, *sorted(roles[r].colocated_with)) for r in held if r in roles}
            return sum(roles[pool[0]].gpus for pool in {tuple(sorted(p)) for p in pools})
        if res.role in roles:
            return roles[res.role].gpus
        if self.alloc_failed or name in self.refused:
            return 0
        if isinstance(self.loaded.spec.cluster.gpus, int) and self.loaded.spec.cluster.gpus == 0:
            return 0
        path = ("stages", name, "resources", "role")
        known = sorted(roles)
        self.errors.append(
            Diagnostic(
                self.doc.value_loc(path),
                render_path(path),
                f"role '{res.role}' has no GPUs: it is not in resources.ratio{did_you_mean(res.role, known)}",
            )
        )
        return 0
