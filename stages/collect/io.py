"""Rollout files while running: append, and resume after a kill.

Input: rollout lines and failure records from the collector. Output, for an
output path OUT:

- `OUT.partial`: rollouts appended (flushed in batches) while running.
- `OUT.partial.meta.json`: the resume key (a hash) of the settings that shape a
  rollout; a partial file written under other settings is discarded.
- `OUT.failures.jsonl`: rows that failed for good, appended while running (a
  history: one record per failed run of a pair), rewritten at the end to one
  record per pair that is not in the output.
- `OUT` itself is published from these by `stages.collect.publish`; its
  existence means the run is complete.

A rollout line always starts `{"prompt_idx": P, "sample_idx": S, `, so its key
is read without parsing the whole line. Memory stays bounded: keys done are a
bitmap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import IO, TYPE_CHECKING, Any

from stages.lib.io.jsonl import atomic_write

if TYPE_CHECKING:
    from stages.collect import CollectConfig

Key = tuple[int, int]
_PREFIX = b'{"prompt_idx": '
_SAMPLE = b' "sample_idx": '


def partial_path(output: str) -> str:
    return f"{output}.partial"


def failures_path(output: str) -> str:
    return f"{output}.failures.jsonl"


def meta_path(output: str) -> str:
    return f"{output}.partial.meta.json"


class DoneSet:
    """A bitmap of pairs with start <= prompt_idx < end (None: no end),
    0 <= sample_idx < repeats."""

    def __init__(self, start: int, repeats: int, end: int | None = None) -> None:
        self.start = start
        self.end = end
        self.repeats = repeats
        self.bits = bytearray()
        self.count = 0

    def _pos(self, prompt_idx: int, sample_idx: int) -> int:
        if prompt_idx < self.start or not 0 <= sample_idx < self.repeats:
            return -1
        if self.end is not None and prompt_idx >= self.end:
            return -1
        return (prompt_idx - self.start) * self.repeats + sample_idx

    def add(self, prompt_idx: int, sample_idx: int) -> bool:
        """Mark a pair; False if it was marked already or lies outside the set's range."""
        pos = self._pos(prompt_idx, sample_idx)
        if pos < 0:
            return False
        byte, bit = pos >> 3, 1 << (pos & 7)
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits))))
        if self.bits[byte] & bit:
            return False
        self.bits[byte] |= bit
        self.count += 1
        return True

    def has(self, prompt_idx: int, sample_idx: int) -> bool:
        pos = self._pos(prompt_idx, sample_idx)
        byte = pos >> 3
        return pos >= 0 and byte < len(self.bits) and bool(self.bits[byte] & (1 << (pos & 7)))

    def all_done(self, prompt_idx: int) -> bool:
        return all(self.has(prompt_idx, s) for s in range(self.repeats))


def rollout_key(line: bytes) -> Key | None:
    """(prompt_idx, sample_idx) of a rollout line, or None when the line is not one."""
    if line.startswith(_PREFIX):
        comma = line.find(b",", len(_PREFIX))
        if comma > 0 and line.startswith(_SAMPLE, comma + 1):
            start = comma + 1 + len(_SAMPLE)
            end = line.find(b",", start)
            with contextlib.suppress(ValueError):
                return int(line[len(_PREFIX) : comma]), int(line[start:end])
    try:
        record = json.loads(line)
        return int(record["prompt_idx"]), int(record["sample_idx"])
    except (ValueError, KeyError, TypeError):
        return None


def resume_key(cfg: CollectConfig) -> str:
    """Hash of the settings that shape each rollout (not the slice, parallelism or retries)."""
    backend = cfg.backend.model_dump(include={"kind", "model", "endpoint"})
    shaping = {
        "input": cfg.input,
        "num_repeats": cfg.num_repeats,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_output_tokens": cfg.max_output_tokens,
        "seed": cfg.seed,
        "backend": backend,
        "verifier": cfg.verifier.model_dump(),
    }
    if cfg.environment is not None:  # episodes, not rollouts: their own partial files
        shaping["environment"] = cfg.environment.model_dump(
            exclude={"timeout_s", "max_failed_share", "concurrency"}
        )
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def done_path(output: str) -> str:
    return f"{output}.done.json"


def read_done(output: str) -> str | None:
    """What a complete output was made with (`stages.collect.run.made_with`), or None (an
    output written before this record existed, or by hand: not trusted)."""
    try:
        with open(done_path(output)) as handle:
            return str(json.load(handle).get("made_with"))
    except (OSError, ValueError, AttributeError):
        return None


def write_done(output: str, stamp: str) -> None:
    atomic_write(done_path(output), json.dumps({"made_with": stamp}) + "\n")


def clear_output(output: str) -> None:
    """Remove a complete output made with other settings, its failures and its record."""
    for path in (output, failures_path(output), done_path(output)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def prepare(output: str, stamp: str) -> bool:
    """Keep partial files written under `stamp`, else clear them; True when resuming."""
    meta = meta_path(output)
    try:
        with open(meta) as handle:
            same = json.load(handle).get("resume_key") == stamp
    except (OSError, ValueError):
        same = False
    if same:
        return os.path.exists(partial_path(output)) or os.path.exists(failures_path(output))
    for path in (partial_path(output), failures_path(output)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    atomic_write(meta, json.dumps({"resume_key": stamp}) + "\n")
    return False


def scan_partial(path: str, done: DoneSet) -> int:
    """Mark every rollout in the partial file done; repair a torn tail. Returns pairs marked.

    A torn last line (a kill mid-write) is cut off in place; a bad line with good
    lines after it (a damaged disk block) is dropped by rewriting the file.
    """
    if not os.path.exists(path):
        return 0
    before = done.count
    good_end, tail_bad, inner_bad = 0, False, False
    with open(path, "rb") as handle:
        for line in handle:
            key = rollout_key(line) if line.endswith(b"}\n") else None
            if key is None:
                tail_bad = True
                continue
            if tail_bad:
                inner_bad = True
            else:
                good_end += len(line)
            done.add(*key)
    if inner_bad:
        _rewrite_good(path)
    elif tail_bad:
        os.truncate(path, good_end)
    return done.count - before


def _rewrite_good(path: str) -> None:
    tmp = f"{path}.repair"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for line in src:
            if line.endswith(b"}\n") and rollout_key(line) is not None:
                dst.write(line)
    os.replace(tmp, path)


def read_failures(path: str) -> dict[Key, dict[str, Any]]:
    """The latest failure record of each pair in a failures file (torn lines skipped)."""
    records: dict[Key, dict[str, Any]] = {}
    if not os.path.exists(path):
        return records
    with open(path, "rb") as handle:
        for line in handle:
            try:
                record = json.loads(line)
                key = (int(record["prompt_idx"]), int(record["sample_idx"]))
            except (ValueError, KeyError, TypeError):
                continue
            records[key] = record
    return records


class Sink:
    """Appends rollout lines (in batches) and failure records (at once) to their files."""

    def __init__(self, output: str, batch: int = 256, interval_s: float = 1.0) -> None:
        self._out: IO[str] = open(partial_path(output), "a", encoding="utf-8")  # noqa: SIM115
        self._fail_path = failures_path(output)
        self._fail: IO[str] | None = None
        self._buf: list[str] = []
        self.batch = batch
        self.interval_s = interval_s
        self._last = time.monotonic()

    def rollout(self, line: str) -> None:
        self._buf.append(line)
        if len(self._buf) >= self.batch:
            self.flush()

    def failure(self, record: dict[str, Any]) -> None:
        if self._fail is None:
            self._fail = open(self._fail_path, "a", encoding="utf-8")  # noqa: SIM115
        self._fail.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fail.flush()

    def flush_if_due(self) -> None:
        if self._buf and time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._out.write("".join(self._buf))
            self._buf.clear()
        self._out.flush()
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        if self._fail is not None:
            self._fail.close()
