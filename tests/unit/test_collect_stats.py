"""Latency histogram accuracy and the progress line."""

from __future__ import annotations

import logging
import random

import pytest

from stages.collect.stats import LatencyHistogram, Progress, Stats


def test_histogram_quantiles_are_within_two_percent():
    rng = random.Random(0)
    values = [rng.lognormvariate(-1.0, 1.0) for _ in range(20_000)]
    hist = LatencyHistogram()
    for v in values:
        hist.add(v)
    ordered = sorted(values)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[int(q * len(ordered)) - 1]
        assert hist.quantile(q) == pytest.approx(exact, rel=0.02), q
    assert hist.quantile(1.0) == max(values)
    assert hist.count == 20_000 and len(hist.buckets) < 1_000  # bounded, whatever the count


def test_histograms_merge_and_round_trip_through_json():
    a, b = LatencyHistogram(), LatencyHistogram()
    for v in (0.1, 0.2, 0.3):
        a.add(v)
    for v in (1.0, 2.0):
        b.add(v)
    a.merge(LatencyHistogram.from_json(b.to_json()))
    assert a.count == 5 and a.max == 2.0
    assert a.quantile(0.5) == pytest.approx(0.3, rel=0.02)
    assert LatencyHistogram().quantile(0.5) == 0.0


def test_progress_lines_and_metrics(caplog: pytest.LogCaptureFixture):
    stats = Stats(total=10)
    stats.set_limit(8)
    stats.written, stats.failed, stats.in_flight, stats.tokens_out = 6, 1, 3, 60
    stats.errors["timeout"] += 2
    stats.latency.add(0.5)
    line = stats.line()
    assert line.startswith("7/10 rollouts | ")
    assert line.endswith("| in flight 3 (limit 8) | errors 2 | failed 1")
    metrics = stats.metrics()
    assert (metrics["written"], metrics["failed"], metrics["errors"]) == (6, 1, {"timeout": 2})
    assert metrics["latency_s"]["p50"] == pytest.approx(0.5, rel=0.02)
    assert metrics["concurrency"]["final"] == 8 and metrics["concurrency"]["max"] == 8
    progress = Progress(logging.getLogger("test.progress"), interval_s=0.0)
    progress.tty = False
    progress.interval_s = 0.0
    with caplog.at_level(logging.INFO, logger="test.progress"):
        progress.maybe_report(stats)
    (message,) = caplog.messages
    assert message.startswith("collect: 7/10 rollouts | ")
    assert message.endswith(" tok/s | in flight 3 (limit 8) | errors 2 | failed 1")
