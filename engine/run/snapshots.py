"""Run, part of: the hub models a stage reads, made local folders before its body runs.

Input: a stage's config, whose `hub_inputs` of type model hold pinned hub ids
(`org/name@<sha>`, as the plan wrote them), and the stage's logger. Output: the config with
each such value replaced by the snapshot folder on this node (`engine.hub.fetch`: the cache's,
or downloaded once per node under a lock before any of the stage's processes start: its ranks
and engines, a vLLM server too, are given the folder), and `{folder: org/name}`, the names
people know those folders by. A Dask or Slurm worker on another node fetches on its own node,
into its own `HF_HOME` (or the shared one: docs/models.md).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.hub import fetch, parse


def local_models(config: Any, log: logging.Logger) -> tuple[Any, dict[str, str]]:
    """`config` with its hub models as local snapshot folders, and their names."""
    names: dict[str, str] = {}
    for dotted, repo_type in config.hub_inputs().items():
        if repo_type != "model":
            continue
        parts = dotted.split(".")
        value = _get(config, parts)
        values = value if isinstance(value, list) else [value]
        local = list(values)
        for i, v in enumerate(values):
            hub = parse(v) if isinstance(v, str) else None
            if hub is None:
                continue
            local[i] = fetch(v, log)
            names[local[i]] = hub.repo
            log.info("%s %s: %s", dotted, v, local[i])
        if local != values:
            config = _replace(config, parts, local if isinstance(value, list) else local[0])
    return config, names


def _get(obj: Any, parts: list[str]) -> Any:
    for part in parts:
        obj = getattr(obj, part, None)
    return obj


def _replace(obj: Any, parts: list[str], value: Any) -> Any:
    """A copy of the frozen config `obj` with the field at `parts` set to `value`."""
    head = parts[0]
    new = value if len(parts) == 1 else _replace(getattr(obj, head), parts[1:], value)
    return obj.model_copy(update={head: new})
