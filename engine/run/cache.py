"""Cache keys and up-to-date checks.

A stage's key hashes its resolved config (with its kind), its kind's code
version, the keys of the stages it needs, and the content of its external
input files (files it reads that no stage of the pipeline writes). A file's
content hash is remembered per (path, size, mtime) in `<run-dir>/.pipe-hashes.json`
(`engine.plan.checksums.HashCache`, which the plan's checksums share) so unchanged large
inputs are not read again. A folder (a checkpoint) is keyed by
its files (`engine.fsio.folder_key`: names, sizes, mtimes, and the bytes of the
small ones), never by the folder's own size and mtime, which a file rewritten in
place leaves alone. A model or dataset named by hub id is keyed by the commit the
plan pinned it to: the config holds `org/name@<sha>` (`engine.resolve.pins`), so a
moved branch changes the config's hash. A stage is up to date when its
stamp holds the same key and all its outputs exist.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from engine.fsio import exists, read_text
from engine.plan.checksums import HashCache
from engine.plan.dag import Plan
from engine.resolve.paths import shown
from engine.run.task import STAMP


def input_paths(config: Any) -> list[str]:
    """Every path a stage's config reads: its kind's INPUTS fields, lists included."""
    out: list[str] = []
    data = config.model_dump(mode="json")
    for field in type(config).INPUTS:
        value: Any = data
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, str))
    return out


def stage_keys(plan: Plan, hashes: HashCache) -> dict[str, str]:
    """The cache key of every stage, in plan order."""
    produced = {path for st in plan.stages.values() for path in st.outputs.values()}
    keys: dict[str, str] = {}
    for name in plan.order:
        st = plan.stages[name]
        parts = [st.config_hash, st.code_version, *(keys[n] for n in st.resolved.needs)]
        for path in input_paths(st.resolved.config):
            if path not in produced and exists(path):
                parts.append(f"{shown(path)}={hashes.get(path)}")
        keys[name] = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    return keys


def up_to_date(stage_dir: str, key: str, outputs: dict[str, str]) -> bool:
    """True when the stage's stamp holds `key` and every output exists."""
    return completed(stage_dir, outputs) == key


def completed(stage_dir: str, outputs: dict[str, str]) -> str | None:
    """The cache key the stage last completed under, while its stamp and every output
    exist; else None (never completed here, or an output gone)."""
    stamp = f"{stage_dir.rstrip('/')}/{STAMP}"
    if not exists(stamp):
        return None
    try:
        record = json.loads(read_text(stamp))
    except (ValueError, OSError):
        return None
    key = record.get("key") if isinstance(record, dict) else None
    return str(key) if key is not None and all(exists(p) for p in outputs.values()) else None
