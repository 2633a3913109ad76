"""Load, part of: pydantic's validation errors -> located, compiler-style diagnostics.

Input: a `ValidationError` raised on data found at a path of a `Document`, and the model
it was validated against (the pipeline's, a kind's config, a preset's, a cluster file's).
Output: one `Diagnostic` per error, at the `file:line:col` of the value (or of its key,
for an unknown or missing field), worded for people: what was expected, what was found,
and "did you mean" for a misspelt field, kind or choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

from engine.errors import Diagnostic, did_you_mean, found, one_of
from engine.load.source import Document, PathT, render_path


def validation_diagnostics(
    exc: ValidationError, doc: Document, prefix: PathT, data: Any, model: type[BaseModel]
) -> list[Diagnostic]:
    """Map pydantic errors on `data` (found at `prefix` in `doc`) to located diagnostics."""
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path, rest, at_key = _data_path(data, loc)
        full = (*prefix, *path)
        message = _message(err, rest, model, loc)
        error_type = err["type"]
        if error_type in ("union_tag_invalid",) and isinstance(_get(data, path), dict):
            full = (*full, "kind")
        if error_type in ("extra_forbidden", "missing", "union_tag_not_found") or at_key:
            where = doc.key_loc(full)
        else:
            where = doc.value_loc(full)
        out.append(Diagnostic(where, render_path(full), message))
    return out


def _get(data: Any, path: PathT) -> Any:
    for part in path:
        data = data[part]
    return data


def _data_path(data: Any, loc: tuple[Any, ...]) -> tuple[PathT, list[Any], bool]:
    """Follow a pydantic `loc` through the data; union tags are skipped, missing names returned."""
    path: list[str | int] = []
    cur = data
    for i, part in enumerate(loc):
        if part == "[key]":
            return tuple(path), [], True
        if (isinstance(cur, dict) and part in cur) or (
            isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        ):
            path.append(part)
            cur = cur[part]
        elif i == len(loc) - 1:
            return tuple(path), [part], False
    return tuple(path), [], False


def _message(
    err: Mapping[str, Any], rest: list[Any], model: type[BaseModel], loc: tuple[Any, ...]
) -> str:
    error_type = err["type"]
    ctx = err.get("ctx") or {}
    shown = found(err.get("input"))
    if error_type == "extra_forbidden":
        key = str(loc[-1])
        return f"unknown field '{key}'{did_you_mean(key, sorted(allowed_fields(model, loc[:-1])))}"
    if error_type == "missing":
        return f"missing required field '{loc[-1]}'"
    if error_type == "union_tag_not_found":
        return f"missing required field '{ctx.get('discriminator', 'kind').strip(chr(39))}'"
    if error_type == "union_tag_invalid":
        tags = re.findall(r"'([^']*)'", str(ctx.get("expected_tags", "")))
        tag = str(ctx.get("tag"))
        return f"expected {one_of(tags)}, found '{tag}'{did_you_mean(tag, tags)}"
    if error_type == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(err["input"], options) if isinstance(err.get("input"), str) else ""
        return f"expected {one_of(options)}, found {shown}{hint}"
    simple = {
        "int_type": "an integer",
        "int_parsing": "an integer",
        "int_from_float": "an integer",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "string_type": "a string",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
        "list_type": "a list",
    }
    if error_type in simple:
        return f"expected {simple[error_type]}, found {shown}"
    bounds = {
        "greater_than": ("greater than", "gt"),
        "greater_than_equal": ("at least", "ge"),
        "less_than": ("less than", "lt"),
        "less_than_equal": ("at most", "le"),
    }
    if error_type in bounds:
        words, key = bounds[error_type]
        return f"expected a number {words} {ctx.get(key)}, found {shown}"
    if error_type == "too_short":
        return (
            f"expected at least {ctx.get('min_length')} item(s), found {ctx.get('actual_length')}"
        )
    if error_type in ("value_error", "assertion_error"):
        msg = str(err["msg"])
        for lead in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(lead)
        return msg
    msg = str(err["msg"])
    return msg[:1].lower() + msg[1:]


def allowed_fields(model: Any, loc: tuple[Any, ...]) -> set[str]:
    """Field names of the model(s) reached by following `loc` from `model`."""
    current: list[Any] = [model]
    for part in loc:
        nxt: list[Any] = []
        for ann in _expand(current):
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                field = ann.model_fields.get(str(part))
                if field is not None:
                    nxt.append(field.annotation)
                    for meta in field.metadata:  # a field type naming its variants (a registry's)
                        nxt.extend(getattr(meta, "variants", list)())
                else:
                    nxt.append(ann)  # a union tag: stay on this model
            elif get_origin(ann) in (dict, Mapping):
                args = get_args(ann)
                nxt.append(args[1] if len(args) == 2 else Any)
            elif get_origin(ann) is list:
                args = get_args(ann)
                nxt.append(args[0] if args else Any)
        current = nxt
    names: set[str] = set()
    for ann in _expand(current):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names.update(ann.model_fields)
    return names


def _expand(annotations: list[Any]) -> list[Any]:
    """Unwrap Annotated and unions into their member types."""
    out: list[Any] = []
    stack = list(annotations)
    while stack:
        ann = stack.pop()
        origin = get_origin(ann)
        if origin is Annotated:
            stack.append(get_args(ann)[0])
        elif origin is not None and origin not in (dict, list, Mapping, Literal) and get_args(ann):
            stack.extend(get_args(ann))
        else:
            out.append(ann)
    return out
