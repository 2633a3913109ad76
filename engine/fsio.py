"""Small file helpers over fsspec: local paths, `file://` and remote URLs (`s3://`) alike.

Writes are atomic where the filesystem allows: a temporary name beside the
target, then a rename, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any


def _fs(path: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    fs, real = url_to_fs(path)
    return fs, real


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, real = _fs(path)
    return bool(fs.exists(real))


def makedirs(path: str) -> None:
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
    else:
        fs, real = _fs(path)
        fs.makedirs(real, exist_ok=True)


def remove(path: str) -> None:
    if is_local(path):
        os.remove(local_path(path))
    else:
        fs, real = _fs(path)
        fs.rm(real)


def move(src: str, dst: str) -> None:
    """Move a file or folder to `dst` (its parent made first); same filesystem."""
    parent = dst.rstrip("/").rsplit("/", 1)[0]
    makedirs(parent)
    if is_local(src):
        os.replace(local_path(src), local_path(dst))
    else:
        fs, real = _fs(src)
        fs.mv(real, _fs(dst)[1], recursive=True)


def read_text(path: str) -> str:
    if is_local(path):
        with open(local_path(path), encoding="utf-8") as f:
            return f.read()
    fs, real = _fs(path)
    with fs.open(real, "r") as f:
        return str(f.read())


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename."""
    if is_local(path):
        target = local_path(path)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
        return
    fs, real = _fs(path)
    tmp = f"{real}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "w") as f:
        f.write(text)
    fs.mv(tmp, real)


def content_hash(path: str) -> str:
    """sha256 of a file, or of every file under a directory (names and bytes)."""
    digest = hashlib.sha256()
    fs, real = _fs(path)
    if fs.isdir(real):
        for name in sorted(fs.find(real)):
            digest.update(name[len(real) :].encode())
            with fs.open(name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    else:
        with fs.open(real, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def fingerprint(path: str) -> tuple[int, float] | None:
    """(size, mtime) of a local file, for the hash cache; None when absent or remote."""
    if not is_local(path):
        return None
    try:
        st = os.stat(local_path(path))
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)
