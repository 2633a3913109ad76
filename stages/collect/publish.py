"""Publishing a collect's output: the partial file sorted, deduplicated and moved into place.

Input: the files of an output path OUT written while running (`stages.collect.io`:
`OUT.partial`, `OUT.failures.jsonl`, `OUT.partial.meta.json`), or the finished outputs of
shards. Output: `OUT`, the partial file sorted by (prompt_idx, sample_idx), deduplicated,
written to a temporary name and moved into place with os.replace (its existence means the
run is complete), the failures rewritten to one record per pair not in it, the partial
files removed; or the shards' outputs concatenated in order (`concat`).

Memory stays bounded: the sort spills sorted runs of `RUN_LINES` lines to disk and merges
them.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
from collections.abc import Callable, Iterator
from operator import itemgetter

from stages.collect.io import (
    Key,
    failures_path,
    meta_path,
    partial_path,
    read_failures,
    rollout_key,
)
from stages.lib.io.jsonl import atomic_write

RUN_LINES = 20_000


def finalize(output: str, keep: Callable[[int, int], bool] | None) -> tuple[int, int]:
    """Publish OUT from OUT.partial (sorted, deduplicated, pairs `keep` accepts; None: all).

    Failures not in the output are rewritten one per pair first, so that OUT
    existing always means both files are final. Returns (rollouts, failures).
    """
    failures = read_failures(failures_path(output))
    tmp = f"{output}.tmp"
    on_key = (lambda k: failures.pop(k, None)) if failures else None
    written = sort_rollouts(partial_path(output), tmp, keep, on_key)
    final = [r for k, r in sorted(failures.items()) if keep is None or keep(*k)]
    if final:
        atomic_write(failures_path(output), "".join(json.dumps(r) + "\n" for r in final))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(failures_path(output))
    os.replace(tmp, output)
    for path in (partial_path(output), meta_path(output)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return written, len(final)


_first = itemgetter(0)
_SHIFT = 24  # sort key: prompt_idx << 24 | sample_idx (sample_idx < 2**24)


def _keyed(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as handle:
        for line in handle:
            key = rollout_key(line)
            if key is not None:
                yield key[0] << _SHIFT | key[1], line


def sort_rollouts(
    src: str,
    dst: str,
    keep: Callable[[int, int], bool] | None,
    on_key: Callable[[Key], object] | None,
) -> int:
    """Write src's rollouts to dst sorted by key, one per key; returns lines written.

    `on_key` (optional) is called with each key written.
    """
    runs: list[str] = []
    buf: list[tuple[int, bytes]] = []
    source = _keyed(src) if os.path.exists(src) else iter(())
    mask = (1 << _SHIFT) - 1
    for item in source:
        if keep is None or keep(item[0] >> _SHIFT, item[0] & mask):
            buf.append(item)
            if len(buf) >= RUN_LINES:
                runs.append(_spill(buf, f"{dst}.run{len(runs)}"))
                buf = []
    buf.sort(key=_first)  # stable: of equal keys, the first written wins
    merged = heapq.merge(*(_keyed(r) for r in runs), buf, key=_first) if runs else iter(buf)
    written, last = 0, -1
    try:
        with open(dst, "wb") as out:
            for key, line in merged:
                if key != last:
                    out.write(line)
                    if on_key is not None:
                        on_key((key >> _SHIFT, key & mask))
                    written += 1
                    last = key
            out.flush()
            os.fsync(out.fileno())
    finally:
        for run in runs:
            os.remove(run)
    return written


def _spill(buf: list[tuple[int, bytes]], path: str) -> str:
    buf.sort(key=_first)
    with open(path, "wb") as out:
        out.writelines(line for _, line in buf)
    return path


def concat(parts: list[str], dst: str) -> None:
    """Concatenate files in order into dst, atomically (absent parts are skipped)."""
    tmp = f"{dst}.tmp"
    with open(tmp, "wb") as out:
        for part in parts:
            if os.path.exists(part):
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dst)
