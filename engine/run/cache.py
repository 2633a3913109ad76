"""Cache keys and up-to-date checks.

A stage's key hashes its resolved config (with its kind), its kind's code
version, the keys of the stages it needs, and the content of its external
input files (files it reads that no stage of the pipeline writes). A file's
content hash is remembered per (path, size, mtime) in `<run-dir>/.pipe-hashes.json`
so unchanged large inputs are not read again. A folder (a checkpoint) is keyed by
its files (`engine.fsio.folder_key`: names, sizes, mtimes, and the bytes of the
small ones), never by the folder's own size and mtime, which a file rewritten in
place leaves alone. A model or dataset named by hub id is keyed by the commit the
plan pinned it to: the config holds `org/name@<sha>` (`engine.plan.pins`), so a
moved branch changes the config's hash. A stage is up to date when its
stamp holds the same key and all its outputs exist.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from engine.fsio import (
    atomic_write_text,
    content_hash,
    exists,
    file_stamp,
    folder_key,
    is_local,
    isdir,
    read_text,
)
from engine.plan.dag import Plan
from engine.plan.paths import shown
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


class HashCache:
    """Content hashes of external inputs: files' keyed by path and (size, mtime); folders'
    computed each time from their files (stat calls and a few small reads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, list[Any]] = {}
        if exists(path):
            try:
                self.entries = json.loads(read_text(path))
            except (ValueError, OSError):
                self.entries = {}
        self.dirty = False

    def get(self, path: str) -> str:
        if isdir(path):
            return folder_key(path)
        stamp = file_stamp(path)
        hit = self.entries.get(path)
        if stamp is not None and hit is not None and hit[:2] == list(stamp):
            return str(hit[2])
        digest = content_hash(path)
        if stamp is not None:
            self.entries[path] = [stamp[0], stamp[1], digest]
            self.dirty = True
        return digest

    def save(self) -> None:
        if self.dirty and is_local(self.path):
            atomic_write_text(self.path, json.dumps(self.entries) + "\n")


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
    stamp = f"{stage_dir.rstrip('/')}/{STAMP}"
    if not exists(stamp):
        return False
    try:
        record = json.loads(read_text(stamp))
    except (ValueError, OSError):
        return False
    return bool(record.get("key") == key and all(exists(p) for p in outputs.values()))
