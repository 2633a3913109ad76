"""The filter's rules: one prompt's group of rollout rows in, the kept rows and drop counts out.

Pure logic, no I/O: `stages.filter.scan` reads rows and groups them, and
`stages.filter.run` / `stages.filter.parallel` decide where each group is
filtered. The rules run in the order of `RULES`, each on the rows the earlier
ones kept, and a dropped row is counted once, under the first rule that dropped
it. `Rules.first_half` holds the rules that need only the group (1-5 in
`RULES`), `Rules.second_half` the rest: deduplication needs a view of the whole
file, so the two halves can run in different passes (see `filter_parallel`).

A row must be a JSON object with an integer `prompt_idx` and `sample_idx` and
a numeric `reward` (collect writes all three); anything else is a
`FilterInputError` naming the file and the byte offset of the line. An episode
row (collect with an environment) is one too: its `reward` is the episode's
total, and the length and duplicate rules read its assistant turns.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.filter import FilterConfig

RULES = (
    "uniform_group",
    "min_reward",
    "max_reward",
    "min_length",
    "max_length",
    "duplicate",
    "predicate",
    "top_k",
)


class FilterInputError(ValueError):
    """A row the filter cannot read, or a predicate it cannot load."""


@dataclass(slots=True)
class Row:
    """One rollout: where its line starts in its file, the line itself and the parsed fields."""

    offset: int
    line: bytes
    data: dict[str, Any]
    prompt_idx: int
    sample_idx: int
    reward: float


def _int_field(data: dict[str, Any], name: str, where: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FilterInputError(f"{where}: expected an integer '{name}', found {value!r}")
    return value


def parse_row(line: bytes, offset: int, source: str) -> Row:
    """Parse one JSONL line; `source` names the file in errors."""
    where = f"{source}: byte {offset}"
    try:
        data = json.loads(line.decode("utf-8"))  # str: json skips detecting the encoding
    except ValueError as exc:  # UnicodeDecodeError included
        raise FilterInputError(f"{where}: not a JSON line: {exc}") from None
    if not isinstance(data, dict):
        raise FilterInputError(f"{where}: expected a JSON object, found {type(data).__name__}")
    reward = data.get("reward")
    if not isinstance(reward, int | float) or (isinstance(reward, float) and math.isnan(reward)):
        raise FilterInputError(f"{where}: expected a numeric 'reward', found {reward!r}")
    return Row(
        offset,
        line,
        data,
        _int_field(data, "prompt_idx", where),
        _int_field(data, "sample_idx", where),
        float(reward),
    )


class RewardHist:
    """A mergeable histogram of rewards in bounded memory.

    A reward falls in the bin [k, k+1) * 10**-decimals (6 decimals to start);
    when more than `MAX_BINS` bins are in use they coarsen tenfold (floor
    division, so coarsening is exact), and memory stays bounded however many
    distinct rewards the file holds. `items()` gives each bin's lower edge.
    """

    MAX_BINS = 4096

    def __init__(self) -> None:
        self.decimals = 6
        self.bins: dict[int, int] = {}
        self.n = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf
        self._memo: dict[float, int] = {}  # value -> bin, for the few values rewards usually take

    def add(self, value: float) -> None:
        b = self._memo.get(value)
        if b is None:
            b = math.floor(round(value * 10**self.decimals, 6))
            if len(self._memo) < self.MAX_BINS:
                self._memo[value] = b
        self.bins[b] = self.bins.get(b, 0) + 1
        self.n += 1
        self.total += value
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value
        while len(self.bins) > self.MAX_BINS:
            self._coarsen(self.decimals - 1)

    def _coarsen(self, decimals: int) -> None:
        while self.decimals > decimals:
            merged: dict[int, int] = {}
            for b, c in self.bins.items():
                merged[b // 10] = merged.get(b // 10, 0) + c
            self.bins, self.decimals = merged, self.decimals - 1
        self._memo.clear()

    def merge(self, other: RewardHist) -> None:
        """Add `other`'s counts to this histogram."""
        other_bins = other.bins
        if other.decimals < self.decimals:
            self._coarsen(other.decimals)
        elif other.decimals > self.decimals:
            copy = RewardHist()
            copy.bins, copy.decimals = dict(other.bins), other.decimals
            copy._coarsen(self.decimals)
            other_bins = copy.bins
        for b, c in other_bins.items():
            self.bins[b] = self.bins.get(b, 0) + c
        self.n += other.n
        self.total += other.total
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)
        while len(self.bins) > self.MAX_BINS:
            self._coarsen(self.decimals - 1)

    def items(self) -> list[tuple[float, int]]:
        """(reward, count) pairs in ascending reward."""
        return [(b / 10**self.decimals, c) for b, c in sorted(self.bins.items())]

    def summary(self) -> dict[str, float | int | None]:
        if not self.n:
            return {"n": 0, "mean": None, "min": None, "max": None}
        mean = round(self.total / self.n, 6)  # partitions add in another order: keep it stable
        return {"n": self.n, "mean": mean, "min": self.low, "max": self.high}


@dataclass
class Counts:
    """What the rules saw and did; counts from partitions add up with `merge`."""

    rows_in: int = 0
    rows_kept: int = 0
    groups_in: int = 0
    groups_kept: int = 0
    length_fallback: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    rewards_in: RewardHist = field(default_factory=RewardHist)
    rewards_kept: RewardHist = field(default_factory=RewardHist)

    def merge(self, other: Counts) -> None:
        self.rows_in += other.rows_in
        self.rows_kept += other.rows_kept
        self.groups_in += other.groups_in
        self.groups_kept += other.groups_kept
        self.length_fallback += other.length_fallback
        for rule, n in other.dropped.items():
            self.dropped[rule] += n
        self.rewards_in.merge(other.rewards_in)
        self.rewards_kept.merge(other.rewards_kept)


def load_predicate(spec: str, pipeline_dir: str | None) -> Callable[[dict[str, Any]], Any]:
    """Import a user's `module:function`; the pipeline's folder is importable."""
    module_name, _, fn_name = spec.partition(":")
    if pipeline_dir and pipeline_dir not in sys.path:
        sys.path.insert(0, pipeline_dir)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FilterInputError(
            f"predicate '{spec}': cannot import '{module_name}': {exc}"
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise FilterInputError(f"predicate '{spec}': '{module_name}' has no function '{fn_name}'")
    return fn  # type: ignore[no-any-return]


def normalize(text: str) -> str:
    """Whitespace runs become one space, ends trimmed, case folded."""
    return " ".join(text.split()).casefold()


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def completion_text(data: dict[str, Any]) -> str:
    """What the model wrote in a row: its `completion`, or an episode's assistant turns one
    after another (collect with an environment writes `messages` and `turns` instead)."""
    messages = data.get("messages")
    if "completion" not in data and "turns" in data and isinstance(messages, list):
        return "\n".join(
            _text(m.get("content"))
            for m in messages
            if isinstance(m, dict) and m.get("role") == "assistant"
        )
    return _text(data.get("completion"))


def prompt_text(data: dict[str, Any]) -> str:
    """The prompt a row answers: `prompt`, else its `messages`, else its `prompt_idx`."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{_text(m.get('role'))}\x1f{_text(m.get('content'))}")
            else:
                parts.append(_text(m))
        return "\x1e".join(parts)
    return f"\x00prompt_idx {data.get('prompt_idx')}"


class Rules:
    """A `FilterConfig` compiled into checks; one instance per process (it holds the predicate)."""

    def __init__(self, cfg: FilterConfig, pipeline_dir: str | None = None) -> None:
        self.cfg = cfg
        self.dedup = cfg.dedup
        self.predicate = load_predicate(cfg.predicate, pipeline_dir) if cfg.predicate else None
        self._length_rules = cfg.min_length is not None or cfg.max_length is not None
        self._last_prompt: tuple[str, bytes] = ("", b"")  # rows of a prompt share its text

    def _prompt_bytes(self, data: dict[str, Any]) -> bytes:
        prompt = prompt_text(data)
        if prompt != self._last_prompt[0]:
            text = normalize(prompt) if self.dedup == "normalized" else prompt
            encoded = text.encode()
            self._last_prompt = (prompt, len(encoded).to_bytes(8, "little") + encoded)
        return self._last_prompt[1]

    def key(self, row: Row) -> bytes:
        """16-byte blake2b of the (prompt, completion) pair, normalised when `dedup` says so."""
        completion = completion_text(row.data)
        if self.dedup == "normalized":
            completion = normalize(completion)
        h = hashlib.blake2b(self._prompt_bytes(row.data), digest_size=16)
        h.update(completion.encode())
        return h.digest()

    def length(self, row: Row, counts: Counts) -> int:
        """The completion's length in the configured unit (characters when tokens are missing)."""
        completion = completion_text(row.data)
        if self.cfg.length_unit == "tokens":
            usage = row.data.get("usage")
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(tokens, int) and not isinstance(tokens, bool):
                return tokens
            counts.length_fallback += 1
        return len(completion)

    def row_reason(self, row: Row, counts: Counts) -> str | None:
        """The first of the per-row bound rules that drops `row`, or None."""
        cfg = self.cfg
        if cfg.min_reward is not None and row.reward < cfg.min_reward:
            return "min_reward"
        if cfg.max_reward is not None and row.reward > cfg.max_reward:
            return "max_reward"
        if self._length_rules:
            n = self.length(row, counts)
            if cfg.min_length is not None and n < cfg.min_length:
                return "min_length"
            if cfg.max_length is not None and n > cfg.max_length:
                return "max_length"
        return None

    def first_half(self, group: list[Row], counts: Counts) -> list[Row]:
        """Rules that need only the group: uniform groups, reward and length bounds."""
        counts.groups_in += 1
        counts.rows_in += len(group)
        for row in group:
            counts.rewards_in.add(row.reward)
        if self.cfg.drop_uniform_groups and len({row.reward for row in group}) == 1:
            counts.dropped["uniform_group"] += len(group)
            return []
        kept = []
        for row in group:
            reason = self.row_reason(row, counts)
            if reason is None:
                kept.append(row)
            else:
                counts.dropped[reason] += 1
        return kept

    def second_half(
        self, rows: Iterable[Row], is_dup: Callable[[Row], bool], counts: Counts
    ) -> list[Row]:
        """Duplicates (`is_dup` gives the global view), the predicate, then top-k; file order kept."""
        kept = []
        for row in rows:
            if self.dedup != "none" and is_dup(row):
                counts.dropped["duplicate"] += 1
            elif self.predicate is not None and not self.predicate(row.data):
                counts.dropped["predicate"] += 1
            else:
                kept.append(row)
        k = self.cfg.top_k_per_prompt
        if k is not None and len(kept) > k:
            best = sorted(kept, key=lambda r: (-r.reward, r.sample_idx))[:k]
            chosen = {id(r) for r in best}
            counts.dropped["top_k"] += len(kept) - k
            kept = [r for r in kept if id(r) in chosen]
        counts.rows_kept += len(kept)
        counts.groups_kept += bool(kept)
        for row in kept:
            counts.rewards_kept.add(row.reward)
        return kept

    def apply(self, group: list[Row], is_dup: Callable[[Row], bool], counts: Counts) -> list[Row]:
        """Every rule, in order, on one prompt's group."""
        return self.second_half(self.first_half(group, counts), is_dup, counts)


class SeenSet:
    """In-memory duplicate check: a set of 16-byte digests.

    About 100 bytes per distinct pair (10^7 rows ~ 1 GB, 10^8 ~ 10 GB): fine
    for one process up to ~10^8 rows on a large machine. Larger files, and
    every file filtered on a Dask cluster, use the hash-partitioned passes of
    `filter_parallel` instead, whose memory does not grow with the file.
    """

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.seen: set[bytes] = set()

    def __call__(self, row: Row) -> bool:
        key = self.rules.key(row)
        if key in self.seen:
            return True
        self.seen.add(key)
        return False
