"""Streaming over a rollout file: byte ranges -> rows -> prompt groups -> kept lines.

Input: a rollout JSONL path and a byte range. Output: kept lines written to an
open binary file, with `Counts`. Memory holds one prompt's group at a time.

Group rules need every sample of a prompt together. collect writes its rows
ordered by (prompt_idx, sample_idx), so rows of a prompt are contiguous; this
is checked as it streams (`prompt_idx` never decreases, O(1) memory) and a file
out of that order raises `OutOfOrder`. The caller then sorts the file with
`sort_by_prompt`, an external sort: rows are partitioned by `prompt_idx` modulo
the number of partitions into temporary files of about `part_bytes`, each is
sorted in memory, and a streaming k-way merge writes one file ordered by
(prompt_idx, sample_idx).

`split_ranges` cuts a file into byte ranges that start at a prompt boundary,
so each range can be filtered on its own (see `filter_parallel`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

from stages.filter.pairs import write_group
from stages.filter.rows import Row, parse_row
from stages.filter.rules import Counts, Rules

log = logging.getLogger(__name__)
BUFFER = 1 << 20


class OutOfOrder(Exception):
    """Rows of a prompt are not contiguous (prompt_idx went down)."""

    def __init__(self, offset: int, prompt_idx: int, previous: int) -> None:
        super().__init__(f"byte {offset}: prompt_idx {prompt_idx} after {previous}")
        self.offset, self.prompt_idx, self.previous = offset, prompt_idx, previous


def iter_rows(
    path: str, start: int = 0, end: int | None = None, only: set[int] | None = None
) -> Iterator[Row]:
    """Rows whose lines start in [start, end) (and at an offset in `only`, when given)."""
    stop = os.path.getsize(path) if end is None else end
    name = os.path.basename(path)
    with open(path, "rb", buffering=BUFFER) as f:
        f.seek(start)
        offset = start
        while offset < stop:
            line = f.readline()
            if not line:
                return
            if (only is None or offset in only) and line.strip():
                yield parse_row(line, offset, name)
            offset += len(line)


def iter_groups(rows: Iterator[Row]) -> Iterator[list[Row]]:
    """Consecutive rows of one prompt_idx; raise `OutOfOrder` when prompt_idx goes down."""
    group: list[Row] = []
    for row in rows:
        if group and row.prompt_idx != group[0].prompt_idx:
            if row.prompt_idx < group[0].prompt_idx:
                raise OutOfOrder(row.offset, row.prompt_idx, group[0].prompt_idx)
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def write_line(out: BinaryIO, line: bytes) -> None:
    out.write(line if line.endswith(b"\n") else line + b"\n")


def filter_range(
    path: str,
    start: int,
    end: int | None,
    rules: Rules,
    is_dup: Callable[[Row], bool],
    out: BinaryIO,
) -> tuple[Counts, int | None, int | None]:
    """Every rule on the rows of [start, end); kept lines go to `out` as they were read (or
    their pairs: `stages.filter.pairs`).

        Returns the counts and the first and last prompt_idx seen (None when the
        range holds no row), so a caller can check the order across ranges.
    """
    counts = Counts()
    first: int | None = None
    last: int | None = None
    for group in iter_groups(iter_rows(path, start, end)):
        if first is None:
            first = group[0].prompt_idx
        last = group[0].prompt_idx
        counts.pairs += write_group(out, rules.apply(group, is_dup, counts), rules.pairs)
    return counts, first, last


def _prompt_idx_of(line: bytes, offset: int, name: str) -> int:
    return parse_row(line, offset, name).prompt_idx


def _group_boundary(f: BinaryIO, target: int, name: str) -> int | None:
    """Offset of the first line at or after `target` that starts a new prompt, or None at EOF."""
    f.seek(target - 1)
    f.readline()  # the rest of the line that holds byte target-1
    pos = f.tell()
    current: int | None = None
    while True:
        line = f.readline()
        if not line:
            return None
        if line.strip():
            pidx = _prompt_idx_of(line, pos, name)
            if current is not None and pidx != current:
                return pos
            current = pidx
        pos += len(line)


def split_ranges(path: str, parts: int) -> list[tuple[int, int]]:
    """Cut the file into at most `parts` byte ranges, each starting where a prompt's rows start."""
    size = os.path.getsize(path)
    cuts = [0]
    name = os.path.basename(path)
    with open(path, "rb") as f:
        for i in range(1, parts):
            target = size * i // parts
            if target <= cuts[-1]:
                continue
            cut = _group_boundary(f, target, name)
            if cut is None:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
    cuts.append(size)
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _sort_key(line: bytes) -> tuple[int, int, int]:
    head = line[: line.index(b"\t")].split(b" ")
    return int(head[0]), int(head[1]), int(head[2])


def _partition(path: str, tmp_dir: str, n: int) -> list[str]:
    names = [os.path.join(tmp_dir, f"sort-{i:05d}.jsonl") for i in range(n)]
    files = [open(p, "wb", buffering=1 << 16) for p in names]  # noqa: SIM115 (closed below)
    try:
        for row in iter_rows(path):
            prefix = f"{row.prompt_idx} {row.sample_idx} {row.offset}\t".encode()
            write_line(files[row.prompt_idx % n], prefix + row.line)
    finally:
        for f in files:
            f.close()
    return names


def _sort_partition(name: str) -> None:
    with open(name, "rb") as f:
        lines = f.readlines()
    lines.sort(key=_sort_key)
    with open(name, "wb") as f:
        f.writelines(lines)


def sort_by_prompt(path: str, tmp_dir: str, part_bytes: int) -> str:
    """Write `path`'s rows ordered by (prompt_idx, sample_idx, file position); return the new
    path."""
    n = max(1, math.ceil(os.path.getsize(path) / part_bytes))
    log.info("sorting %s by prompt_idx through %d temporary partitions", path, n)
    names = _partition(path, tmp_dir, n)
    for name in names:
        _sort_partition(name)
    out_path = os.path.join(tmp_dir, "sorted.jsonl")
    readers = [open(p, "rb", buffering=1 << 16) for p in names]  # noqa: SIM115 (closed below)
    try:
        with open(out_path, "wb", buffering=BUFFER) as out:
            for line in heapq.merge(*readers, key=_sort_key):
                out.write(line[line.index(b"\t") + 1 :])
    finally:
        for r in readers:
            r.close()
    for name in names:
        os.remove(name)
    return out_path
