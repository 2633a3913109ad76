"""The registry of generation backends, and the `backend:` field kinds declare.

Input: the classes of the entry-point group `pipe.backends` (built-ins and plugins alike:
`openai`, `vllm` and `local` are this project's entries in pyproject.toml), and classes
registered by hand (`register_backend`: a test, a plugin that prefers code). Output: the
backend class of each `kind`, imported only when a stage's block names it (so `pipe run` of a
local collect never imports the vLLM backend's module); `Backend`, the field type that
validates a block against the class its `kind` names at validation time (so a backend
registered after the kinds' configs were built is accepted), and whose JSON schema is the
union of the registered backends; `BackendStageConfig`, the engine's placement, preset, memory
and hub hooks of a kind with a `backend` block, answered by its backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from engine.stage import MemoryNeed, StageConfig
from stages.lib.backends.protocol import BackendConfig

ENTRY_POINT_GROUP = "pipe.backends"

_CLASSES: dict[str, type[BackendConfig]] = {}  # kind -> class, once imported
_ENTRIES: dict[str, metadata.EntryPoint] | None = None  # kind -> entry point, not yet loaded


def register_backend(cls: type[BackendConfig]) -> type[BackendConfig]:
    """Register a backend class under the `kind` its `Literal` field names (a decorator)."""
    _CLASSES[_kind_of(cls)] = cls
    return cls


def unregister_backend(kind: str) -> None:
    """Forget a backend registered by hand (tests)."""
    _CLASSES.pop(kind, None)


def _kind_of(cls: type[BackendConfig]) -> str:
    field = cls.model_fields.get("kind")
    choices: tuple[Any, ...] = getattr(field.annotation, "__args__", ()) if field else ()
    if len(choices) != 1 or not isinstance(choices[0], str):
        raise TypeError(f"{cls.__name__}.kind must be a Literal of one name")
    return choices[0]


def _entries() -> dict[str, metadata.EntryPoint]:
    global _ENTRIES
    if _ENTRIES is None:
        _ENTRIES = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return _ENTRIES


BUILT_IN = ("openai", "vllm", "local")  # the order the schema and messages list them in


def backend_kinds() -> list[str]:
    """Every known kind: the built-ins, then plugins' entry points and those registered by
    hand, by name."""
    known = set(_entries()) | set(_CLASSES)
    return [k for k in BUILT_IN if k in known] + sorted(known - set(BUILT_IN))


def backend_class(kind: str) -> type[BackendConfig] | None:
    """The class of `kind`, its module imported now if it was not yet."""
    cls = _CLASSES.get(kind)
    if cls is None and kind in _entries():
        cls = _entries()[kind].load()
        if not (isinstance(cls, type) and issubclass(cls, BackendConfig)):
            raise TypeError(f"entry point {kind!r} of {ENTRY_POINT_GROUP} is not a BackendConfig")
        _CLASSES[kind] = cls
    return cls


def rl_engine_kinds() -> list[str]:
    """The kinds that can be the rl stage's rollout engine."""
    return sorted(k for k, c in _classes() if c.RL_ENGINE is not None)


def _tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("kind")
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", None)


def _validate(value: Any) -> BackendConfig:
    """A block validated against the class its `kind` names (pydantic's own errors, the
    block's fields located below it; an unknown kind as a union tag error)."""
    if isinstance(value, BackendConfig):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("model_type", "Input should be a valid mapping")
    kind = _tag(value)
    if kind is None:
        raise PydanticCustomError(
            "union_tag_not_found",
            "Unable to extract tag using discriminator 'kind'",
            {"discriminator": "'kind'"},
        )
    cls = backend_class(kind)
    if cls is None:
        tags = ", ".join(repr(k) for k in backend_kinds())
        raise PydanticCustomError(
            "union_tag_invalid",
            "Input tag '{tag}' found using 'kind' does not match any of the expected tags: "
            "{expected_tags}",
            {"discriminator": "'kind'", "tag": kind, "expected_tags": tags},
        )
    return cls.model_validate(value)


class _BackendField:
    """Validation by the registry at validation time; the JSON schema of every backend
    registered when the schema is made (`pipe schema`: every backend's module is imported
    then, and only then)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_plain_validator_function(_validate)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        union = core_schema.tagged_union_schema(
            {c_kind: c.__pydantic_core_schema__ for c_kind, c in _classes()}, discriminator=_tag
        )
        return handler(union)

    @staticmethod
    def variants() -> list[type[BackendConfig]]:
        """Every backend's class (the engine's "did you mean" reads their fields)."""
        return [c for _, c in _classes()]


def _classes() -> list[tuple[str, type[BackendConfig]]]:
    return [(k, c) for k in backend_kinds() if (c := backend_class(k)) is not None]


Backend = Annotated[BackendConfig, _BackendField]


class BackendStageConfig(StageConfig):
    """A kind's config with a `backend` block (collect, evaluate): the engine's placement,
    preset, memory and hub hooks answered by its backend. The kind declares the `backend`
    field itself (its own default and description)."""

    if TYPE_CHECKING:
        backend: BackendConfig

    def memory_needs(self) -> list[MemoryNeed]:
        return self.backend.memory_needs()

    def gpu_unit(self, role: str | None = None) -> int:
        """One engine's GPUs stay on one node."""
        return self.backend.gpu_unit()

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        """A backend's settings go to its block; the rest to top-level fields."""
        return super().preset_path(key, data) or backend_preset_path(key, data)

    def hub_inputs(self) -> dict[str, str]:
        """A server's own model name is not a hub repository."""
        return super().hub_inputs() if self.backend.hub_model() else {}


def backend_preset_path(key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
    """A preset's setting lands in the `backend` block whose class takes it (vLLM's settings
    in a `backend: {kind: vllm}` block)."""
    cls = backend_class(_tag(data.get("backend")) or "")
    if cls is not None and cls.takes_preset(key):
        return ("backend", key)
    return None
