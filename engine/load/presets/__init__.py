"""Presets as data: profiles and memory presets, each value with a one-line reason.

Built-in presets are the YAML files beside this module, named
`<name>.<kind>.yaml` (kind: `profile` or `memory`). A pipeline adds its own
from a `presets/` folder beside it and from the files or folders it lists under
`presets:`; they are validated by the same schema and may shadow a built-in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import Location, PipeError

HERE = Path(__file__).parent
KINDS = ("profile", "memory")


class Setting(BaseModel):
    """One preset value and why it is there."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    value: Any = Field(description="The value the preset sets.")
    reason: str = Field(
        min_length=1, description="One line: why (the published guidance it encodes)."
    )


class PresetResources(BaseModel):
    """Pipeline-level resources a preset sets."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    colocate: Setting | None = Field(None, description="Colocation: none, all, or role groups.")


class Preset(BaseModel):
    """A profile or a memory preset."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["profile", "memory"] = Field(description="profile or memory.")
    name: str = Field(min_length=1, description="The name pipelines use.")
    description: str = Field("", description="What the preset is for.")
    caution: str | None = Field(None, description="A warning shown whenever the preset is used.")
    resources: PresetResources = Field(
        default_factory=PresetResources, description="Resources it sets."
    )
    settings: dict[str, Setting] = Field(
        default_factory=dict, description="Stage settings it sets, by field name."
    )


@dataclass(frozen=True)
class PresetSource:
    """A preset, the file it came from, and where each setting's value was written."""

    preset: Preset
    path: Path
    locations: dict[str, Location]

    @property
    def label(self) -> str:
        """`profile high-performance` / `memory memory_constrained`."""
        return f"{self.preset.kind} {self.preset.name}"


def _files(base: Path | None, extra: Iterable[str]) -> list[Path]:
    files = sorted(HERE.glob("*.yaml"))
    dirs: list[Path] = []
    if base is not None:
        dirs.append(base / "presets")
        for item in extra:
            p = base / item
            if p.is_dir():
                dirs.append(p)
            elif p.exists():
                files.append(p)
    for d in dirs:
        if d.is_dir():
            files.extend(sorted(d.glob("*.yaml")))
    return files


def _kind_of(path: Path) -> tuple[str, str] | None:
    stem = path.name[: -len(".yaml")]
    name, _, kind = stem.rpartition(".")
    return (name, kind) if kind in KINDS and name else None


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def available(kind: str, base: Path | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Names of the presets of `kind` (built-in and the pipeline's own)."""
    names = []
    for path in _files(base, extra):
        parsed = _kind_of(path)
        if parsed and parsed[1] == kind:
            names.append(parsed[0])
    return sorted(set(names))


def load_preset(
    kind: str, name: str, base: Path | None = None, extra: Iterable[str] = ()
) -> PresetSource:
    """The preset `name` of `kind`; the pipeline's own files shadow built-ins of the same name."""
    from engine.load.source import load_document
    from engine.load.validation import validation_diagnostics

    found = [p for p in _files(base, extra) if _kind_of(p) == (name, kind)]
    if not found:
        raise KeyError(f"no {kind} preset named '{name}'")
    path = found[-1]
    doc = load_document(path, _display(path))
    try:
        preset = Preset.model_validate(doc.data)
    except ValidationError as exc:
        raise PipeError(validation_diagnostics(exc, doc, (), doc.data, Preset)) from None
    locs = {key: doc.value_loc(("settings", key, "value")) for key in preset.settings}
    if preset.resources.colocate is not None:
        locs["colocate"] = doc.value_loc(("resources", "colocate", "value"))
    return PresetSource(preset, path, locs)


def all_presets(base: Path | None = None, extra: Iterable[str] = ()) -> list[PresetSource]:
    """Every preset, built-in first."""
    out = []
    for kind in KINDS:
        for name in available(kind, base, extra):
            out.append(load_preset(kind, name, base, extra))
    return out
