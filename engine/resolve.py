"""Resolve: `LoadedPipeline` -> `ResolvedPipeline`, every value explicit and its source known.

Merge order, lowest first: stage-kind defaults < profile < memory preset <
pipeline `defaults:` < stage `config:` < `--set` (already applied to the
document). A preset applies each setting to the stages that have it: top-level
config fields, and the vLLM settings to `backend: {kind: vllm}` blocks.

Conflict rules, always reported:
- the memory preset wins over the profile (e.g. `memory_constrained` turns off
  `high-performance`'s colocation and `overlap_comm`): a warning names both;
- an explicit user value wins over any preset: a note where it contradicts the
  memory preset.

Then `@stage` references and relative paths are resolved (inputs against the
pipeline's folder, outputs inside `<run-dir>/<stage>/`), GPU roles are
allocated (`engine.resources`), and the arithmetic is checked: engines x
tensor-parallel size = the vLLM GPUs, tensor-parallel groups within a node,
batch sizes that divide, stage GPUs within the cluster.
"""

from __future__ import annotations

import copy
import posixpath
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine.errors import Diagnostic, Location, PipeError, did_you_mean
from engine.load import LoadedPipeline, stage_config_data
from engine.presets import PresetSource, load_preset
from engine.resources import RoleAlloc, allocate, ratio_text
from engine.schema import validation_diagnostics
from engine.source import Document, PathT, get_at, render_path, set_at
from engine.stage import StageConfig, StageKind, kinds

VLLM_SETTINGS = (
    "vllm_num_engines",
    "vllm_tensor_parallel_size",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep",
    "enable_prefix_caching",
)


@dataclass(frozen=True)
class Source:
    """Where a resolved value came from."""

    label: str
    reason: str = ""
    location: Location | None = None

    def render(self) -> str:
        return f"{self.label}: {self.reason}" if self.reason else self.label


DEFAULT = Source("kind default")


@dataclass(frozen=True)
class ResolvedStage:
    """A stage with its typed, fully explicit config."""

    name: str
    kind: str
    needs: tuple[str, ...]
    role: str | None
    gpus: int
    retries: int
    config: StageConfig
    sources: dict[str, Source]

    def source(self, dotted: str) -> Source:
        return self.sources.get(dotted, DEFAULT)


@dataclass(frozen=True)
class ResolvedPipeline:
    """The pipeline after presets, references, paths and resources are resolved."""

    loaded: LoadedPipeline
    run_dir: str
    colocate: Any
    colocate_source: Source
    roles: dict[str, RoleAlloc]
    stages: dict[str, ResolvedStage]
    notes: list[Diagnostic] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.loaded.spec.name


def default_run_dir(loaded: LoadedPipeline) -> str:
    return posixpath.join("runs", loaded.spec.name)


def resolve(
    loaded: LoadedPipeline, run_dir: str | None = None, gpus: int | None = None
) -> ResolvedPipeline:
    """Resolve presets, references, paths and resources; raise `PipeError` with every problem."""
    spec = loaded.spec
    base = loaded.base_dir
    profile = load_preset("profile", spec.profile, base, spec.presets)
    memory = load_preset("memory", spec.memory, base, spec.presets)
    state = _State(loaded, run_dir or default_run_dir(loaded), profile, memory)
    colocate, colocate_source = state.colocation()
    total = gpus if gpus is not None else spec.cluster.gpus
    roles: dict[str, RoleAlloc] = {}
    raw_resources = loaded.doc.data.get("resources")
    wrote_ratio = isinstance(raw_resources, dict) and "ratio" in raw_resources
    uses_roles = wrote_ratio or any(st.resources.role for st in spec.stages.values())
    if isinstance(total, int) and uses_roles:
        where = loaded.doc.value_loc(("cluster", "gpus"))
        ratio = {str(role): n for role, n in spec.resources.ratio.items()}
        roles, errs = allocate(total, ratio, colocate, where, ratio_text(ratio))
        state.errors.extend(errs)
        state.alloc_failed = bool(errs)
    stages: dict[str, ResolvedStage] = {}
    from engine.graph import topological

    for name in topological(spec):
        resolved = state.stage(name, roles, stages)
        if resolved is not None:
            stages[name] = resolved
    if state.errors:
        raise PipeError(state.errors)
    for preset in (profile, memory):
        used = any(
            src.label == preset.label for st in stages.values() for src in st.sources.values()
        )
        if preset.preset.caution and used:
            key = preset.preset.kind
            state.note("warning", loaded.doc.value_loc((key,)), key, preset.preset.caution)
    ordered = {n: stages[n] for n in spec.stages if n in stages}
    return ResolvedPipeline(
        loaded, state.run_dir, colocate, colocate_source, roles, ordered, state.notes
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
        self.alloc_failed = False

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
                    f"memory preset '{self.memory.preset.name}' sets {_show(setting.value)} over "
                    f"profile '{self.profile.preset.name}''s {_show(value)} ({setting.reason})",
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
            f"{_show(user)} overrides memory preset '{self.memory.preset.name}''s {_show(preset_value)} ({source.reason})",
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
        self.rules(merged, sources, roles, gpus)
        self.references(name, kind, merged, sources, done)
        locs: dict[PathT, Location] = {(): self.doc.key_loc(("stages", name))}
        for dotted, src in sources.items():
            if src.location is not None:
                locs[tuple(dotted.split("."))] = src.location
        view = Document(self.doc.name, merged, locs)
        try:
            config = kind.config.model_validate(merged)
        except ValidationError as exc:
            self.errors.extend(validation_diagnostics(exc, view, (), merged, kind.config))
            return None
        resolved = ResolvedStage(
            name, st.kind, tuple(st.needs), st.resources.role, gpus, st.retries, config, sources
        )
        from engine.checks import check_stage

        self.errors.extend(check_stage(self, resolved, roles, view))
        return resolved

    def layers(self, name: str, kind: StageKind) -> tuple[dict[str, Any], dict[str, Source]]:
        spec = self.loaded.spec
        user = copy.deepcopy(stage_config_data(spec, name, kind))
        backend = user.get("backend")
        vllm = isinstance(backend, dict) and backend.get("kind") == "vllm"
        fields = kind.config.model_fields
        merged: dict[str, Any] = {}
        sources: dict[str, Source] = {}
        for preset in (self.profile, self.memory):
            for key, setting in preset.preset.settings.items():
                target: PathT | None = (
                    (key,)
                    if key in fields
                    else ("backend", key)
                    if vllm and key in VLLM_SETTINGS
                    else None
                )
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
                        f"memory preset '{self.memory.preset.name}' sets {_show(setting.value)} over "
                        f"profile '{self.profile.preset.name}''s {_show(get_at(merged, target))} ({setting.reason})",
                    )
                set_at(merged, target, copy.deepcopy(setting.value))
                sources[dotted] = self.preset_source(preset, key)
        own = spec.stages[name].config
        for path, value in _leaves(user):
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

    def rules(
        self,
        merged: dict[str, Any],
        sources: dict[str, Source],
        roles: dict[str, RoleAlloc],
        gpus: int,
    ) -> None:
        """Values derived from others: prefix caching, colocated memory share, engine count."""
        backend = merged.get("backend")
        if not (isinstance(backend, dict) and backend.get("kind") == "vllm"):
            return
        tp = backend.get("vllm_tensor_parallel_size", 1)
        if (
            gpus
            and "backend.vllm_num_engines" not in sources
            and isinstance(tp, int)
            and tp > 0
            and gpus % tp == 0
        ):
            backend["vllm_num_engines"] = gpus // tp
            sources["backend.vllm_num_engines"] = Source(
                "rule", f"{gpus} GPUs of the stage / tensor-parallel size {tp}"
            )
        repeats = merged.get("num_repeats", 1)
        if (
            "backend.enable_prefix_caching" not in sources
            and isinstance(repeats, int)
            and repeats > 1
        ):
            backend["enable_prefix_caching"] = True
            sources["backend.enable_prefix_caching"] = Source(
                "rule", f"num_repeats {repeats} > 1: the samples of a prompt share its KV cache"
            )
        shared = roles.get("vllm")
        if (
            shared is not None
            and shared.colocated_with
            and "backend.vllm_gpu_memory_utilization" not in sources
        ):
            backend["vllm_gpu_memory_utilization"] = 0.5
            sources["backend.vllm_gpu_memory_utilization"] = Source(
                "rule",
                f"vllm shares its GPUs with {', '.join(shared.colocated_with)}: leave half for training",
            )

    def references(
        self,
        name: str,
        kind: StageKind,
        merged: dict[str, Any],
        sources: dict[str, Source],
        done: dict[str, ResolvedStage],
    ) -> None:
        from engine.paths import resolve_paths

        resolve_paths(self, name, kind, merged, sources, done)

    def stage_gpus(self, name: str, roles: dict[str, RoleAlloc]) -> int:
        res = self.loaded.spec.stages[name].resources
        if res.gpus is not None:
            return res.gpus
        if res.role is None:
            return 0
        if res.role in roles:
            return roles[res.role].gpus
        if self.alloc_failed:
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


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return str(value)


def _leaves(data: dict[str, Any], prefix: PathT = ()) -> list[tuple[PathT, Any]]:
    """Leaf values of nested config blocks (lists and free-form dicts of scalars stay whole)."""
    out: list[tuple[PathT, Any]] = []
    for key, value in data.items():
        path = (*prefix, key)
        if isinstance(value, dict) and value and key in ("backend", "verifier", "model"):
            out.extend(_leaves(value, path))
        else:
            out.append((path, value))
    return out
