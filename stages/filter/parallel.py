"""Filter one large file as many Dask tasks: byte ranges in, part files out, concatenated in order.

Input: a rollout JSONL sorted by prompt (see `filter_scan`), a `distributed`
client (from `worker_client()` inside the stage's task), a temporary folder
every worker can reach. Output: the kept lines appended to an open file in
input order, and the merged `Counts`.

The file is cut into ranges of about `partition_mb` that start at prompt
boundaries (`split_ranges`), so the group rules see whole groups. Without
deduplication one pass does everything: each range task writes its kept lines
to a part file. Deduplication needs a view of the whole file, and a set of every
pair would grow with it, so it is hash-partitioned and takes three passes:

A. per range: the group-only rules (`Rules.first_half`, counted here); for
   each surviving row, its byte offset, and its 16-byte pair digest with the
   offset in a key file in sections by bucket (digest modulo bucket count);
B. per bucket: read that section of every key file in range order; a digest
   seen before marks its offset a duplicate (the first occurrence in the file
   wins); write the sorted duplicate offsets;
C. per range: only A's survivors are parsed again, and the rules after the
   group-only ones run on them (`Rules.second_half`), a row being a duplicate
   when its offset is in B's output; kept lines go to a part file.

Each task's memory is bounded by its range or bucket, not by the file; the
coordinating task holds only file names and counts. Tasks check that
prompt_idx never decreases within a range, and the coordinator checks across
ranges, raising `OutOfOrder` for the caller to sort and retry.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import shutil
from array import array
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

from stages.filter import FilterConfig
from stages.filter.pairs import write_group
from stages.filter.rows import Row
from stages.filter.rules import Counts, Rules
from stages.filter.scan import (
    BUFFER,
    OutOfOrder,
    filter_range,
    iter_groups,
    iter_rows,
)

log = logging.getLogger(__name__)
ENTRY = 24  # 16-byte digest + 8-byte offset


@dataclass(frozen=True)
class Job:
    """What every task of one filter run shares; bound with `partial` (Dask owns some kwargs)."""

    src: str
    cfg: FilterConfig
    pdir: str | None
    tmp: str


@dataclass
class KeysResult:
    """Pass A's output for one range."""

    key_file: str
    index: list[tuple[int, int]]  # (offset, length) of each bucket's section
    survivors_file: str  # offsets of the rows that passed the group-only rules
    counts: Counts
    first: int | None
    last: int | None


def _keys_task(job: Job, nb: int, idx: int, start: int, end: int) -> KeysResult:
    """Pass A: group-only rules; each survivor's offset, and its digest in a bucketed key file."""
    rules = Rules(job.cfg, job.pdir)
    buckets: list[list[bytes]] = [[] for _ in range(nb)]
    survivors = array("q")
    counts = Counts()
    first = last = None
    for group in iter_groups(iter_rows(job.src, start, end)):
        if first is None:
            first = group[0].prompt_idx
        last = group[0].prompt_idx
        for row in rules.first_half(group, counts):
            digest = rules.key(row)
            b = int.from_bytes(digest[:8], "little") % nb
            buckets[b].append(digest + row.offset.to_bytes(8, "little"))
            survivors.append(row.offset)
    key_file = os.path.join(job.tmp, f"keys-{idx:05d}.bin")
    index = []
    pos = 0
    with open(key_file, "wb") as f:
        for entries in buckets:
            data = b"".join(entries)
            f.write(data)
            index.append((pos, len(data)))
            pos += len(data)
    survivors_file = os.path.join(job.tmp, f"survivors-{idx:05d}.bin")
    with open(survivors_file, "wb") as f:
        survivors.tofile(f)
    return KeysResult(key_file, index, survivors_file, counts, first, last)


def _dups_task(job: Job, key_files: list[tuple[str, list[tuple[int, int]]]], b: int) -> str:
    """Pass B: offsets of the rows whose digest, in bucket `b`, appeared earlier in the file."""
    seen: set[bytes] = set()
    dups = array("q")
    for path, index in key_files:
        pos, length = index[b]
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read(length)
        for i in range(0, length, ENTRY):
            digest = data[i : i + 16]
            if digest in seen:
                dups.append(int.from_bytes(data[i + 16 : i + ENTRY], "little"))
            else:
                seen.add(digest)
    path = os.path.join(job.tmp, f"dups-{b:05d}.bin")
    with open(path, "wb") as f:
        dups.tofile(f)
    return path


def _dups_in(paths: list[str], start: int, end: int) -> set[int]:
    found: set[int] = set()
    for path in paths:
        offsets = _read_offsets(path)
        lo, hi = bisect.bisect_left(offsets, start), bisect.bisect_left(offsets, end)
        found.update(offsets[lo:hi])
    return found


def _read_offsets(path: str) -> array[int]:
    offsets = array("q")
    with open(path, "rb") as f:
        offsets.frombytes(f.read())
    return offsets


def _filter_task(
    job: Job, dup_files: list[str], idx: int, start: int, end: int, survivors: str | None
) -> tuple[str, Counts, int | None, int | None]:
    """Pass C, or the only pass: kept lines of one range to a part file.

    With pass A's `survivors`, only those rows are read again and only the
    rules after the group-only ones run; without, every rule runs on every row.
    """
    rules = Rules(job.cfg, job.pdir)
    dups = _dups_in(dup_files, start, end)

    def is_dup(row: Row) -> bool:
        return row.offset in dups

    path = os.path.join(job.tmp, f"part-{idx:05d}.jsonl")
    with open(path, "wb", buffering=BUFFER) as out:
        if survivors is None:
            counts, first, last = filter_range(job.src, start, end, rules, is_dup, out)
            return path, counts, first, last
        only = set(_read_offsets(survivors))
        counts = Counts()
        for group in iter_groups(iter_rows(job.src, start, end, only)):
            counts.pairs += write_group(out, rules.second_half(group, is_dup, counts), rules.pairs)
    return path, counts, None, None


def _check_order(
    bounds: list[tuple[int | None, int | None]], ranges: list[tuple[int, int]]
) -> None:
    previous: int | None = None
    for (first, last), (start, _) in zip(bounds, ranges, strict=True):
        if first is None or last is None:
            continue
        if previous is not None and first <= previous:
            raise OutOfOrder(start, first, previous)
        previous = last


def run_parallel(
    client: Any,
    src: str,
    cfg: FilterConfig,
    pdir: str | None,
    tmp: str,
    out: BinaryIO,
    logger: logging.Logger = log,
) -> tuple[Counts, int]:
    """Filter `src` as Dask tasks; append kept lines to `out`; return counts and the range count."""
    from stages.filter.scan import split_ranges

    size = os.path.getsize(src)
    ranges = split_ranges(src, max(2, math.ceil(size / (cfg.partition_mb * 2**20))))
    idxs = list(range(len(ranges)))
    starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
    job = Job(src, cfg, pdir, tmp)
    counts = Counts()
    dup_files: list[str] = []
    survivors: list[str | None] = [None] * len(ranges)
    if cfg.dedup != "none":
        nb = min(256, len(ranges))
        logger.info("filter: pass A over %d ranges (%d dedup buckets)", len(ranges), nb)
        keys = client.gather(
            client.map(partial(_keys_task, job, nb), idxs, starts, ends, pure=False)
        )
        _check_order([(k.first, k.last) for k in keys], ranges)
        for k in keys:
            counts.merge(k.counts)
        logger.info("filter: pass B, finding duplicates")
        key_files = [(k.key_file, k.index) for k in keys]
        dup_files = client.gather(
            client.map(partial(_dups_task, job, key_files), list(range(nb)), pure=False)
        )
        survivors = [k.survivors_file for k in keys]
    logger.info("filter: filtering %d ranges", len(ranges))
    parts = client.gather(
        client.map(partial(_filter_task, job, dup_files), idxs, starts, ends, survivors, pure=False)
    )
    _check_order([(p[2], p[3]) for p in parts], ranges)
    for path, part_counts, _, _ in parts:
        counts.merge(part_counts)
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out, BUFFER)
        os.remove(path)
    return counts, len(ranges)
