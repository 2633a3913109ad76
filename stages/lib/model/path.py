"""The plan-time check of a checkpoint path (`model:`, `checkpoints`, `backend.model`).

Input: the resolved (absolute, or kept as written) path and the stage's `ResolveContext`.
Output: located diagnostics: a folder that does not exist, or holds no `config.json`; a `.gguf`
file that does not exist or is not one (`stages.lib.model.gguf.check_gguf`). An earlier
stage's output (made when it runs), a remote URL and a hub id pass: the plan pins a hub id to
a commit and names what is wrong with it (`engine.resolve.pins`). `local_folder`: the folder a
model value names on this machine (a checkpoint folder, or a hub id already in the cache).
"""

from __future__ import annotations

import os
from typing import Any

from engine.errors import Diagnostic
from engine.gguf_header import is_gguf
from engine.hub import HUB_ID, cached_file
from engine.stage import ResolveContext
from stages.lib.model.gguf import check_gguf


def check_checkpoint(ctx: ResolveContext, field: str, value: str) -> list[Diagnostic]:
    """A checkpoint path as runs read it: a local folder holding `config.json`, a GGUF file
    (converted into one when the stage runs), or an output of an earlier stage (made when that
    stage runs). A hub id (`org/name[@revision]`, kept as written when no such folder exists)
    is the plan's to pin and check; a remote URL (`s3://...`) is read through fsspec at run
    time and not checked here."""
    if ctx.is_produced(value) or "://" in value:
        return []
    if is_gguf(value):
        return check_gguf(ctx, field, value)
    if HUB_ID.match(value):
        return []
    if os.path.isdir(value):
        if os.path.isfile(os.path.join(value, "config.json")):
            return []
        return [
            ctx.error(
                field,
                f"'{value}' holds no config.json: not a Hugging Face checkpoint folder",
            )
        ]
    where = "" if value.startswith("/") else " (relative to the pipeline's folder)"
    return [ctx.error(field, f"no checkpoint folder '{value}'{where}")]


def check_model_ref(ctx: ResolveContext, field: str, model: Any) -> list[Diagnostic]:
    """`model` as a path (`check_checkpoint`); a tiny-model spec is built by the run."""
    return check_checkpoint(ctx, field, model) if isinstance(model, str) else []


def local_folder(value: Any) -> str | None:
    """The checkpoint folder `value` names on this machine: a folder with a config.json, or
    a hub id's snapshot in the local cache; None otherwise."""
    if not isinstance(value, str) or "://" in value:
        return None
    if os.path.isfile(os.path.join(value, "config.json")):
        return value
    if HUB_ID.match(value):
        found = cached_file(value, "config.json")
        return os.path.dirname(found) if found else None
    return None
