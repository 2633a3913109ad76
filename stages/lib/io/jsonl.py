"""Files every kind reads and writes: one JSONL reader, one atomic write, one line count.

Input: paths (local, `file://`, or an fsspec URL for reading). Output: rows as
dicts, counts, and files that appear whole or not at all: everything is written
to a temporary sibling (flushed and fsynced), then renamed into place.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any


@contextmanager
def open_binary(path: str) -> Iterator[IO[bytes]]:
    """Open a local path or an fsspec URL for binary reading."""
    if "://" in path and not path.startswith("file://"):
        import fsspec

        with fsspec.open(path, "rb") as handle:
            yield handle
    else:
        with open(path.removeprefix("file://"), "rb", buffering=1 << 20) as handle:
            yield handle


def read_jsonl(path: str, error: type[Exception] = ValueError) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file; blank lines are skipped, a bad line raises `error` naming it."""
    with open_binary(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise error(f"{path}:{n}: expected a JSON object per line")
            yield row


def count_lines(path: str) -> int:
    """Non-blank lines of a file (0 when it does not exist)."""
    if "://" not in path and not os.path.exists(path):
        return 0
    with open_binary(path) as f:
        return sum(1 for line in f if line.strip())


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary sibling of `path` to write; renamed onto `path` when the block succeeds."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    stem, ext = os.path.splitext(os.path.basename(path))
    tmp = os.path.join(folder, f".{stem}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}{ext}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write(path: str, data: str | bytes) -> None:
    """Write `data` to `path` atomically (flushed and fsynced before the rename)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str, data: Any, indent: int | None = 2) -> None:
    """`data` as a JSON document at `path`, atomically."""
    atomic_write(path, json.dumps(data, indent=indent, default=str) + "\n")


def write_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line at `path`, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
