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


def sha256_file(path: str) -> str:
    """sha256 of a file's bytes, all 64 hex digits."""
    digest = hashlib.sha256()
    fs, real = _fs(path)
    with fs.open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(path: str) -> str:
    """sha256 of a file's bytes, its first 16 hex digits (a cache key's part)."""
    return sha256_file(path)[:16]


def isdir(path: str) -> bool:
    if is_local(path):
        return os.path.isdir(local_path(path))
    fs, real = _fs(path)
    return bool(fs.isdir(real))


SMALL = 1 << 20  # files below this are hashed whole: configs, tokenizers, templates
SKIPPED_DIRS = {".cache"}  # the Hub's download bookkeeping (`huggingface_hub` local_dir)
# remote stat fields that change when an object is rewritten (s3, gcs, hf, http)
_STAMPS = ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "md5Hash")


def folder_key(path: str) -> str:
    """A key over every file under a folder: its name relative to the folder, size and
    modification time, and for files under 1 MiB (`SMALL`) a hash of their bytes.

    Rewriting a file in place leaves the folder's own mtime alone, so the key looks at
    the files. Large files (weights) are not read: a rewrite moves their mtime. Skipped:
    `.cache/` folders and `*.lock` files, which downloads leave behind and which say nothing
    of the checkpoint. A file that is a link counts as its target (a Hub snapshot links its
    files to blobs); links to folders are not walked.
    """
    digest = hashlib.sha256()
    for rel, size, stamp, opener in sorted(_files(path), key=lambda f: f[0]):
        digest.update(f"{rel}\0{size}\0{stamp}\n".encode())
        if size < SMALL:
            with opener() as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()[:16]


def _skipped(rel: str) -> bool:
    *dirs, name = rel.split("/")
    return name.endswith(".lock") or any(d in SKIPPED_DIRS for d in dirs)


def _files(path: str) -> list[tuple[str, int, str, Any]]:
    """(relative name, size, stamp, opener) of every file under `path`, `_skipped` left out."""
    out: list[tuple[str, int, str, Any]] = []
    if is_local(path):
        root = local_path(path)
        for top, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            for name in names:
                full = os.path.join(top, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                try:
                    st = os.stat(full)
                except OSError:  # a dangling link
                    continue
                if not _skipped(rel):
                    out.append((rel, st.st_size, str(st.st_mtime_ns), _open_local(full)))
        return out
    fs, real = _fs(path)
    root = real.rstrip("/")
    for name, info in fs.find(root, detail=True).items():
        rel = name[len(root) :].lstrip("/")
        if not _skipped(rel):
            stamp = "|".join(str(info[k]) for k in _STAMPS if info.get(k) is not None)
            out.append((rel, int(info.get("size") or 0), stamp, _open_remote(fs, name)))
    return out


def _open_local(full: str) -> Any:
    return lambda: open(full, "rb")


def _open_remote(fs: Any, name: str) -> Any:
    return lambda: fs.open(name, "rb")


def file_stamp(path: str) -> tuple[int, float] | None:
    """(size, mtime) of a local file, for the hash cache; None when absent or remote."""
    if not is_local(path):
        return None
    try:
        st = os.stat(local_path(path))
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)
