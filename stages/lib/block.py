"""What every config block of a kind is built from: frozen blocks, counts that may be `auto`,
and a user's `module:attr` references, found at plan time without importing them.

Input: YAML values and the resolve context. Output: validated values, or located errors.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Sequence
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


def _find(name: str, search: Sequence[str] = ()) -> tuple[Any, str | None]:
    """Module `name`'s spec, or None and the first dotted prefix that no finder locates."""
    import importlib.util
    import sys
    from importlib.machinery import PathFinder

    parts = name.split(".")
    folders: list[str] | None = list(search) or None
    spec: Any = None
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None)
        if spec is None and folders is not None:
            spec = PathFinder.find_spec(full, folders)
        if spec is None and i == 0:
            spec = importlib.util.find_spec(full)  # built-ins, installed and editable packages
        if spec is None:
            return None, full
        folders = list(spec.submodule_search_locations or [])
        if not folders and i + 1 < len(parts):
            return None, ".".join(parts[: i + 2])  # `full` is a module, not a package
    return spec, None


def missing_module(name: str, search: Sequence[str] = ()) -> str | None:
    """The first dotted prefix of module `name` that no finder locates (None: found), looked
    up in the folders `search` first, then where Python imports from. Nothing is imported,
    not even a parent package: plan never runs user code."""
    return _find(name, search)[1]


def _top_level(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """The statements and expressions run at a module's top level (not inside a function's
    or a class's body)."""
    for node in nodes:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _top_level(ast.iter_child_nodes(node))


def _binds(source: str, attr: str, package: bool) -> bool | None:
    """Whether a module of this source binds `attr` at its top level: a `def`, a `class`, an
    assignment or an import of that name; None where the source cannot say (a star import, a
    module `__getattr__`, `globals()`, `setattr` or `vars()` at the top level, a syntax
    error: the run's import decides)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    unsure = False
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == attr:
                return True
            unsure |= node.name == "__getattr__"
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store) and node.id == attr:
                return True
            unsure |= node.id in ("globals", "setattr", "vars")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                unsure |= alias.name == "*"
                if (alias.asname or alias.name.partition(".")[0]) == attr:
                    return True
            # a package's `from .sub import x` makes `sub` an attribute of the package too
            sub = node.module if isinstance(node, ast.ImportFrom) and node.level == 1 else None
            if package and sub and sub.partition(".")[0] == attr:
                return True
    return None if unsure else False


def defines(spec: Any, attr: str) -> bool | None:
    """Whether the module of `spec` (found by `_find`) has `attr`: read from its source,
    parsed and not run, where the module has one; a module without (compiled, built in) is
    imported, as the run would; None when neither can say."""
    import importlib
    import sys

    loaded = sys.modules.get(spec.name)
    if loaded is not None:
        return hasattr(loaded, attr)
    package = spec.submodule_search_locations is not None
    try:
        source = spec.loader.get_source(spec.name) if spec.loader is not None else None
    except (ImportError, OSError):
        source = None
    if source is not None:
        found = _binds(source, attr, package)
        if found is False and package:
            # a submodule of that name becomes an attribute once anything imports it
            sub, _ = _find(f"{spec.name}.{attr}")
            return None if sub is not None else False
        return found
    try:
        module = importlib.import_module(spec.name)
    except Exception:  # the run reports a module that fails while importing
        return None
    return hasattr(module, attr)


def check_callable(
    ctx: ResolveContext,
    path: str,
    what: str,
    spec: str,
    search: Sequence[str] = (),
    noun: str = "function",
) -> list[Diagnostic]:
    """A `module:attr` the run could not load is refused, located at `path`: a module the
    run could not import (none found where it looks), or one that has no `attr` (`noun`
    names what it should be), read from the module's source without running it
    (`defines`). A module that is found but fails while importing is the run's to report."""
    if not _CALLABLE.match(spec):
        return []
    module, _, attr = spec.partition(":")
    found, gone = _find(module, search)
    if gone is not None:
        return [ctx.error(path, f"{what} '{spec}': no module named '{gone}'")]
    if defines(found, attr) is False:
        return [ctx.error(path, f"{what} '{spec}': module '{module}' has no {noun} '{attr}'")]
    return []
