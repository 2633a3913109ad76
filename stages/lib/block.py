"""What every config block of a kind is built from: frozen blocks, counts that may be `auto`,
and a user's `module:attr` references, found at plan time without importing them.

Input: YAML values and the resolve context. Output: validated values, or located errors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema

from engine.errors import Diagnostic, found
from engine.stage import ResolveContext

_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Block(BaseModel):
    """A nested config block: frozen, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _count_or_auto(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"expected a positive integer or 'auto', found {found(value)}")


CountOrAuto = Annotated[
    int | Literal["auto"],
    BeforeValidator(_count_or_auto),
    WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"const": "auto"}]}),
]


def named_or_callable(value: Any, names: Sequence[str], form: str) -> Any:
    """A `kind` that is one of `names` or a `module:attr` (`form` says which attr), as is;
    anything else a ValueError with the closest name."""
    if not isinstance(value, str) or value in names or _CALLABLE.match(value):
        return value
    from engine.errors import did_you_mean, one_of

    hint = did_you_mean(value, names)
    raise ValueError(f"expected {one_of((*names, form))}, found '{value}'{hint}")


# -- a user's `module:function`, found before the run imports it ----------------------------


def missing_module(name: str, search: Sequence[str] = ()) -> str | None:
    """The first dotted prefix of module `name` that no finder locates (None: found), looked
    up in the folders `search` first, then where Python imports from. Nothing is imported,
    not even a parent package: plan never runs user code."""
    import importlib.util
    import sys
    from importlib.machinery import PathFinder

    parts = name.split(".")
    folders: list[str] | None = list(search) or None
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None)
        if spec is None and folders is not None:
            spec = PathFinder.find_spec(full, folders)
        if spec is None and i == 0:
            spec = importlib.util.find_spec(full)  # built-ins, installed and editable packages
        if spec is None:
            return full
        folders = list(spec.submodule_search_locations or [])
        if not folders and i + 1 < len(parts):
            return ".".join(parts[: i + 2])  # `full` is a module, not a package
    return None


def check_callable(
    ctx: ResolveContext, path: str, what: str, spec: str, search: Sequence[str] = ()
) -> list[Diagnostic]:
    """A `module:function` whose module the run could not import is refused, located at
    `path`. Only the module is looked for: whether it defines the function is known by
    importing it, which the run does."""
    if not _CALLABLE.match(spec):
        return []
    module = spec.partition(":")[0]
    gone = missing_module(module, search)
    if gone is None:
        return []
    return [ctx.error(path, f"{what} '{spec}': no module named '{gone}'")]
