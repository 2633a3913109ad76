"""Resolve, part of: the merge of a stage's layers, each value with its provenance.

Input: the loaded pipeline, its profile and memory preset, and a stage's kind. Output: a
`Draft`, the stage's merged config data (lowest first: kind defaults, left out here, <
profile < memory preset < pipeline `defaults:` < stage `config:`, `--set` already in the
document) with the `Source` of every value set, and the pipeline's colocation with its
source; conflicts become notes:

- the memory preset wins over the profile: a warning names both;
- an explicit user value wins over any preset: a note where it contradicts the memory preset.

A preset setting lands where the kind's `preset_path` hook puts it (a top-level field by
default); a user's nested config block counts value by value (`leaves`).
"""

from __future__ import annotations

import copy
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from engine.errors import Diagnostic, found
from engine.load.load import LoadedPipeline, stage_config_data
from engine.load.presets import PresetSource, load_preset
from engine.load.source import PathT, get_at, render_path, set_at
from engine.resolve.types import DEFAULT, Draft, ResolvedStage, Source
from engine.stage import StageKind, nested_blocks


@dataclass
class Layers:
    """The presets a pipeline names, merged under its own values; conflicts go to `notes`."""

    loaded: LoadedPipeline
    profile: PresetSource
    memory: PresetSource
    notes: list[Diagnostic]

    @classmethod
    def load(cls, loaded: LoadedPipeline, notes: list[Diagnostic]) -> Layers:
        """The pipeline's profile and memory preset (built-in, or its own presets)."""
        spec = loaded.spec
        profile = load_preset("profile", spec.profile, loaded.base_dir, spec.presets)
        memory = load_preset("memory", spec.memory, loaded.base_dir, spec.presets)
        return cls(loaded, profile, memory, notes)

    def colocation(self) -> tuple[Any, Source]:
        """`resources.colocate`: the profile's, the memory preset's over it, the user's over
        both; "none" when nobody sets it."""
        value: Any = "none"
        source = DEFAULT
        for preset in (self.profile, self.memory):
            setting = preset.preset.resources.colocate
            if setting is None:
                continue
            if preset is self.memory and source.label == self.profile.label:
                self._memory_wins("resources.colocate", value, setting.value, setting.reason)
            value, source = setting.value, self._preset_source(preset, "colocate")
        raw = self.loaded.doc.data.get("resources")
        if isinstance(raw, dict) and "colocate" in raw:
            user = self.loaded.spec.resources.colocate
            if source.label == self.memory.label and user != value:
                self._contradicts(("resources", "colocate"), user, value, source)
            value, source = user, self._user_source(("resources", "colocate"))
        return value, source

    def stage(self, name: str, kind: StageKind) -> Draft:
        """The stage's merged config data and the source of every value in it, as a draft."""
        user = copy.deepcopy(stage_config_data(self.loaded.spec, name, kind))
        draft = Draft(name, kind)
        self._presets(draft, user)
        self._user(draft, user)
        return draft

    def cautions(self, stages: dict[str, ResolvedStage]) -> None:
        """A warning for each preset with a caution that set a value of some stage."""
        for preset in (self.profile, self.memory):
            applied = any(
                src.label == preset.label for st in stages.values() for src in st.sources.values()
            )
            if preset.preset.caution and applied:
                key = preset.preset.kind
                where = self.loaded.doc.value_loc((key,))
                self.notes.append(Diagnostic(where, key, preset.preset.caution, "warning"))

    def _presets(self, draft: Draft, user: dict[str, Any]) -> None:
        """The profile's settings, then the memory preset's over them (`user`: the stage's
        own config data, where a kind's `preset_path` hook looks)."""
        merged, sources = draft.merged, draft.sources
        for preset in (self.profile, self.memory):
            for key, setting in preset.preset.settings.items():
                target = draft.kind.config.preset_path(key, user)
                if target is None:
                    continue
                dotted = ".".join(map(str, target))
                before = sources.get(dotted)
                if (
                    preset is self.memory
                    and before is not None
                    and before.label == self.profile.label
                ):
                    path = f"stages.{draft.name}.config.{dotted}"
                    earlier = get_at(merged, target)
                    self._memory_wins(path, earlier, setting.value, setting.reason)
                set_at(merged, target, copy.deepcopy(setting.value))
                sources[dotted] = self._preset_source(preset, key)

    def _user(self, draft: Draft, user: dict[str, Any]) -> None:
        """The pipeline's `defaults:` and the stage's `config:` (`user`) over the presets."""
        name, merged, sources = draft.name, draft.merged, draft.sources
        own = self.loaded.spec.stages[name].config
        for path, value in leaves(user, nested_blocks(draft.kind.config)):
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
            sources[dotted] = self._user_source(origin)

    def _preset_source(self, preset: PresetSource, key: str) -> Source:
        setting = preset.preset.settings.get(key)
        colocate = preset.preset.resources.colocate
        reason = setting.reason if setting else (colocate.reason if colocate else "")
        return Source(preset.label, reason, preset.locations.get(key))

    def _user_source(self, path: PathT) -> Source:
        loc = self.loaded.doc.value_loc(path)
        return Source(str(loc), "", loc)

    def _memory_wins(self, path: str, profile_value: Any, value: Any, reason: str) -> None:
        """A warning where the memory preset sets a value the profile set otherwise."""
        if value == profile_value:
            return
        self.notes.append(
            Diagnostic(
                self.loaded.doc.value_loc(("memory",)),
                path,
                f"memory preset '{self.memory.preset.name}' sets {found(value, whole=True)} "
                f"over profile '{self.profile.preset.name}''s "
                f"{found(profile_value, whole=True)} ({reason})",
                "warning",
            )
        )

    def _contradicts(self, path: PathT, user: Any, preset_value: Any, source: Source) -> None:
        """A note where the user's value overrides the memory preset's."""
        self.notes.append(
            Diagnostic(
                self.loaded.doc.value_loc(path),
                render_path(path),
                f"{found(user, whole=True)} overrides memory preset "
                f"'{self.memory.preset.name}''s {found(preset_value, whole=True)} "
                f"({source.reason})",
                "note",
            )
        )


def leaves(data: dict[str, Any], blocks: AbstractSet[str]) -> list[tuple[PathT, Any]]:
    """Leaf values of a config: the values of its nested blocks one by one, the rest whole
    (lists and free-form mappings are one value each)."""
    out: list[tuple[PathT, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict) and value and key in blocks:
            out.extend(((key, k), v) for k, v in value.items())
        else:
            out.append(((key,), value))
    return out
