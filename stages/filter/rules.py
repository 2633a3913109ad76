"""The filter's rules: one prompt's group of rollout rows in, the kept rows and drop counts out.

Pure logic, no I/O: `stages.filter.scan` reads rows (`stages.filter.rows`) and groups them,
and `stages.filter.run` / `stages.filter.parallel` decide where each group is
filtered. The rules run in the order of `RULES`, each on the rows the earlier
ones kept, and a dropped row is counted once, under the first rule that dropped
it. `Rules.first_half` holds the rules that need only the group (1-5 in
`RULES`), `Rules.second_half` the rest: deduplication needs a view of the whole
file, so the two halves can run in different passes (see `filter_parallel`).
An episode row (collect with an environment) is filtered like any other: its `reward` is
the episode's total, and the length and duplicate rules read its assistant turns.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.filter.histogram import RewardHist
from stages.filter.rows import FilterInputError, Row, completion_text, prompt_text

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


@dataclass
class Counts:
    """What the rules saw and did; counts from partitions add up with `merge`."""

    rows_in: int = 0
    rows_kept: int = 0
    groups_in: int = 0
    groups_kept: int = 0
    length_fallback: int = 0
    pairs: int = 0  # pairs: true: pair rows written
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    rewards_in: RewardHist = field(default_factory=RewardHist)
    rewards_kept: RewardHist = field(default_factory=RewardHist)

    def merge(self, other: Counts) -> None:
        self.rows_in += other.rows_in
        self.rows_kept += other.rows_kept
        self.groups_in += other.groups_in
        self.groups_kept += other.groups_kept
        self.length_fallback += other.length_fallback
        self.pairs += other.pairs
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


class Rules:
    """A `FilterConfig` compiled into checks; one instance per process (it holds the predicate)."""

    def __init__(self, cfg: FilterConfig, pipeline_dir: str | None = None) -> None:
        self.cfg = cfg
        self.dedup = cfg.dedup
        self.pairs = cfg.pairs_per_prompt if cfg.pairs else None  # pairs written per prompt
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
        """Duplicates (`is_dup` gives the global view), the predicate, then top-k; file order
        kept."""
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
