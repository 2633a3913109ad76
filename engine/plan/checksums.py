"""Plan, part of: content hashes of the files a plan depends on, remembered across runs.

Input: a path (a file or a checkpoint folder) and the run folder's memo
(`<run-dir>/.pipe-hashes.json`: per local file, its size, mtime and sha256). Output:
`HashCache.get` (the key of an external input in a stage's cache key: a file's sha256 prefix,
a folder's `engine.fsio.folder_key`), `HashCache.sha256` (a file's whole sha256), and
`model_files(config, memo)`: the sha256 of every single-file model a stage reads (a GGUF
checkpoint, a chat template file: the values of its kind's `MODEL_INPUTS` that are files),
which `pipe plan` shows and `plan.lock.yaml` records. A file is read again only when its
size or mtime moved, so planning a 250 MB GGUF costs about a second once, then nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.fsio import (
    atomic_write_text,
    exists,
    file_stamp,
    folder_key,
    is_local,
    isdir,
    read_text,
    sha256_file,
)

MEMO = ".pipe-hashes.json"


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

    @classmethod
    def of_run(cls, run_dir: str) -> HashCache:
        """The memo of a run folder."""
        return cls(f"{run_dir.rstrip('/')}/{MEMO}")

    def get(self, path: str) -> str:
        """A folder's key, or a file's sha256 prefix (16 hex digits)."""
        if isdir(path):
            return folder_key(path)
        return self.sha256(path, whole=False)[:16]

    def sha256(self, path: str, whole: bool = True) -> str:
        """A file's sha256 (`whole`: all 64 digits; else a memo holding 16 will do)."""
        stamp = file_stamp(path)
        hit = self.entries.get(path)
        if stamp is not None and hit is not None and hit[:2] == list(stamp):
            known = str(hit[2])
            if not whole or len(known) == 64:
                return known
        digest = sha256_file(path)
        if stamp is not None:
            self.entries[path] = [stamp[0], stamp[1], digest]
            self.dirty = True
        return digest

    def save(self) -> None:
        if self.dirty and is_local(self.path):
            atomic_write_text(self.path, json.dumps(self.entries) + "\n")


def model_files(config: Any, memo: HashCache) -> dict[str, str]:
    """The sha256 of each value of the config's `MODEL_INPUTS` that is a local file, by path."""
    out: dict[str, str] = {}
    for field in type(config).MODEL_INPUTS:
        value: Any = config
        for part in field.split("."):
            value = getattr(value, part, None)
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, str) and is_local(v) and os.path.isfile(v):
                out[v] = memo.sha256(v)
    return out
