"""Run, part of: the hub models a stage reads, made local folders before its body runs.

Input: a stage's config, whose `hub_inputs` of type model hold pinned hub ids
(`org/name@<sha>`, as the plan wrote them), and the stage's logger. Output: the config with
each such value replaced by the snapshot folder on this node (`engine.hub.fetch`: the cache's
when complete, or downloaded, or completed, once per node under a lock before any of the
stage's processes start: its ranks and engines, a vLLM server too, are given the folder), and
`{folder: org/name}`, the names people know those folders by. A Dask or Slurm worker on another
node fetches on its own node, into its own `HF_HOME` (or the shared one: docs/models.md).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.hub import fetch, hub_fields


def local_models(config: Any, log: logging.Logger) -> tuple[Any, dict[str, str]]:
    """`config` with its hub models as local snapshot folders, and their names."""
    names: dict[str, str] = {}
    given = config  # each field read as given (the fields are distinct leaves)
    for hf in hub_fields(config.hub_inputs(), lambda path: _get(given, path)):
        if hf.repo_type != "model":
            continue
        local = hf.values
        for i, v, hub in hf.ids:
            local[i] = fetch(v, log)
            names[local[i]] = hub.repo
            log.info("%s %s: %s", hf.dotted, v, local[i])
        if local != hf.values:
            config = _replace(config, hf.path, hf.rebuilt(local))
    return config, names


def _get(obj: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        obj = getattr(obj, part, None)
    return obj


def _replace(obj: Any, parts: tuple[str, ...], value: Any) -> Any:
    """A copy of the frozen config `obj` with the field at `parts` set to `value`."""
    head = parts[0]
    new = value if len(parts) == 1 else _replace(getattr(obj, head), parts[1:], value)
    return obj.model_copy(update={head: new})
