"""The reward histogram of the filter's report, mergeable across partitions.

Input: rewards, one at a time (`add`), or another histogram (`merge`). Output: (reward,
count) bins (`items`, for `reward_histogram.png`) and a summary (`n`, `mean`, `min`,
`max`) in bounded memory, whatever the number of distinct rewards.
"""

from __future__ import annotations

import math


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
