"""Counters, a bounded latency histogram, and the progress line of a collect run.

Input: events from the collector (a rollout written, a request failed, a
retry). Output: the progress text (a bar on a terminal, a plain log line every
~10 s otherwise) and the metrics dict the stage returns. Memory is bounded
whatever the run's size: latencies go into log-spaced buckets (2% wide), so
percentiles are exact to within 2%.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from typing import Any

from stages.lib.io.metrics import Metrics

_MIN_S = 1e-4
_GROWTH = math.log(1.02)
TRACK_S = 5.0  # seconds between the points a collect run sends its trackers


class LatencyHistogram:
    """Log-bucketed latencies: add() in O(1), quantile() within 2% of the exact value."""

    def __init__(self) -> None:
        self.buckets: Counter[int] = Counter()
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        b = int(math.log(seconds / _MIN_S) / _GROWTH) if seconds > _MIN_S else 0
        self.buckets[b] += 1
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds

    def merge(self, other: LatencyHistogram) -> None:
        self.buckets.update(other.buckets)
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)

    def quantile(self, q: float) -> float:
        """The q-quantile (bucket midpoint, capped at the largest value seen); 0.0 if empty."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen >= rank:
                return min(self.max, _MIN_S * math.exp((b + 0.5) * _GROWTH))
        return self.max

    def to_json(self) -> dict[str, Any]:
        return {"buckets": dict(self.buckets), "total": self.total, "max": self.max}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LatencyHistogram:
        hist = cls()
        hist.buckets.update({int(k): int(v) for k, v in data["buckets"].items()})
        hist.count = sum(hist.buckets.values())
        hist.total, hist.max = float(data["total"]), float(data["max"])
        return hist


class Stats:
    """What a collect run has done so far."""

    def __init__(self, total: int | None = None) -> None:
        self.started = time.perf_counter()
        self.total = total  # pairs to do this run, when known
        self.written = 0
        self.failed = 0
        self.skipped_resumed = 0
        self.skipped_failed = 0
        self.retries = 0
        self.in_flight = 0
        self.tokens_in = 0
        self.tokens_out = 0
        self.verify_s = 0.0
        self.verify_errors = 0
        self.errors: Counter[str] = Counter()
        self.latency = LatencyHistogram()
        self.limit = 0
        self.limit_max = 0
        self._limit_area = 0.0
        self._limit_since = self.started

    def set_limit(self, limit: int) -> None:
        now = time.perf_counter()
        self._limit_area += self.limit * (now - self._limit_since)
        self._limit_since = now
        self.limit = limit
        self.limit_max = max(self.limit_max, limit)

    def elapsed(self) -> float:
        return max(1e-9, time.perf_counter() - self.started)

    def line(self) -> str:
        """One progress line: done/total, rollouts/s, tokens/s, in flight, limit, errors."""
        secs = self.elapsed()
        done = self.written + self.failed
        of = f"/{self.total}" if self.total is not None else ""
        errors = sum(self.errors.values())
        return (
            f"{done}{of} rollouts | {self.written / secs:.1f} rollouts/s | "
            f"{self.tokens_out / secs:.0f} tok/s | in flight {self.in_flight} "
            f"(limit {self.limit}) | errors {errors} | failed {self.failed}"
        )

    def metrics(self) -> dict[str, Any]:
        """The JSON-serialisable metrics of this run."""
        secs = self.elapsed()
        self.set_limit(self.limit)
        lat = self.latency
        return {
            "written": self.written,
            "failed": self.failed,
            "skipped_resumed": self.skipped_resumed,
            "skipped_failed": self.skipped_failed,
            "retries": self.retries,
            "wall_s": round(secs, 3),
            "rollouts_per_s": round(self.written / secs, 3),
            "tokens_per_s": round(self.tokens_out / secs, 1),
            "latency_s": {
                "mean": round(lat.total / lat.count, 4) if lat.count else 0.0,
                "p50": round(lat.quantile(0.50), 4),
                "p95": round(lat.quantile(0.95), 4),
                "p99": round(lat.quantile(0.99), 4),
                "max": round(lat.max, 4),
            },
            "tokens": {"prompt": self.tokens_in, "completion": self.tokens_out},
            "errors": dict(sorted(self.errors.items())),
            "verify_s": round(self.verify_s, 3),
            "verify_errors": self.verify_errors,
            "concurrency": {
                "final": self.limit,
                "max": self.limit_max,
                "mean": round(self._limit_area / secs, 1),
            },
        }


class Progress:
    """A bar on a terminal (stderr), a plain log line every `interval_s` otherwise."""

    def __init__(
        self, log: logging.Logger, interval_s: float = 10.0, track: Metrics | None = None
    ) -> None:
        self.log = log
        self.tty = sys.stderr.isatty()
        self.interval_s = 0.5 if self.tty else interval_s
        self._next = time.perf_counter() + self.interval_s
        self.track = track  # the run's trackers get a point every TRACK_S, and the last
        self._track_next = time.perf_counter() + TRACK_S

    def maybe_report(self, stats: Stats) -> None:
        now = time.perf_counter()
        if self.track is not None and now >= self._track_next:
            self._track_next = now + TRACK_S
            self.track.log(int(stats.elapsed()), over_time(stats))
        if now < self._next:
            return
        self._next = now + self.interval_s
        if self.tty:
            sys.stderr.write(f"\r{_bar(stats)}{stats.line()}\x1b[K")
            sys.stderr.flush()
        else:
            self.log.info("collect: %s", stats.line())

    def close(self, stats: Stats) -> None:
        if self.track is not None:
            self.track.log(int(stats.elapsed()), over_time(stats))
        if self.tty:
            sys.stderr.write(f"\r{_bar(stats)}{stats.line()}\x1b[K\n")
            sys.stderr.flush()
        self.log.info("collect done: %s", stats.line())


def over_time(stats: Stats) -> dict[str, float]:
    """What the trackers plot against time (step: seconds into the run)."""
    secs = stats.elapsed()
    return {
        "rollouts": stats.written + stats.failed,
        "rollouts_per_s": stats.written / secs,
        "tokens_per_s": stats.tokens_out / secs,
        "latency_p50_s": stats.latency.quantile(0.50),
        "latency_p95_s": stats.latency.quantile(0.95),
        "errors": sum(stats.errors.values()),
        "retries": stats.retries,
        "failed": stats.failed,
        "in_flight": stats.in_flight,
        "limit": stats.limit,
    }


def _bar(stats: Stats, width: int = 24) -> str:
    if not stats.total:
        return ""
    frac = min(1.0, (stats.written + stats.failed) / stats.total)
    full = int(frac * width)
    return "[" + "#" * full + " " * (width - full) + f"] {frac * 100:5.1f}% "
