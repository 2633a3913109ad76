"""Adaptive concurrency against simulated backends (discrete-event, simulated time).

The backend model: `capacity(t)` requests served at once, each taking
`service(n)` seconds with n in service (fixed for the bench's fake server,
growing with n for a batching server like vLLM), the rest waiting in FIFO
order; optionally a 429 when more than `reject_above` are queued or in service.
The client keeps `limit` workers, each sending its next request right after
its previous one finished, as the collector does.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from stages.lib.api.adaptive import AdaptiveLimit


@dataclass
class Run:
    done: list[float] = field(default_factory=list)  # completion times
    limits: list[tuple[float, int]] = field(default_factory=list)
    rejects: int = 0

    def rate(self, a: float, b: float) -> float:
        return (bisect.bisect_left(self.done, b) - bisect.bisect_left(self.done, a)) / (b - a)

    def limits_between(self, a: float, b: float) -> list[int]:
        return [limit for t, limit in self.limits if a <= t < b]


def simulate(
    capacity: Callable[[float], int],
    service: Callable[[int], float],
    duration: float,
    *,
    jitter: float = 0.0,
    reject_above: int | None = None,
    seed: int = 0,
) -> Run:
    rng, ctl, run = random.Random(seed), AdaptiveLimit(), Run()
    events: list[tuple[float, int, str, float]] = []
    queue: list[float] = []
    state = {"n": 0, "in_service": 0, "workers": 0}

    def push(t: float, kind: str, sent: float = 0.0) -> None:
        state["n"] += 1
        heapq.heappush(events, (t, state["n"], kind, sent))

    def serve(t: float) -> None:
        while queue and state["in_service"] < capacity(t):
            state["in_service"] += 1
            took = service(state["in_service"]) * (1 + jitter * (rng.random() - 0.5))
            push(t + took, "done", queue.pop(0))

    def send(t: float) -> None:
        ctl.on_send(t)
        if reject_above is not None and state["in_service"] + len(queue) >= reject_above:
            push(t + 0.002, "reject", t)
        else:
            queue.append(t)
            serve(t)

    def spawn(t: float) -> None:
        while state["workers"] < ctl.limit:
            state["workers"] += 1
            send(t)

    spawn(0.0)
    while events:
        t, _, kind, sent = heapq.heappop(events)
        if t > duration:
            break
        if kind == "send":
            send(t)
            continue
        if kind == "done":
            state["in_service"] -= 1
            serve(t)
            ctl.on_done(t, t - sent, sent)
            run.done.append(t)
        else:
            run.rejects += 1
            ctl.on_done(t, t - sent, -1.0)
            ctl.on_overload(t)
        run.limits.append((t, ctl.limit))
        if state["workers"] > ctl.limit:
            state["workers"] -= 1  # this worker retires
        else:
            push(t + 0.0005, "send")  # client-side time between requests
        spawn(t)
    return run


def test_finds_the_knee_of_the_bench_server_fast():
    # capacity 128, 200 ms: at most 640 rollouts/s; acceptance 1 asks 90% over 4,000 rollouts
    run = simulate(lambda t: 128, lambda n: 0.2, 30)
    assert run.done[3999] <= 4000 / (0.93 * 640)
    assert run.rate(5, 30) >= 0.98 * 640  # probes under the knee cost a little
    late = sorted(run.limits_between(10, 30))
    assert 128 <= late[len(late) // 2] <= 256  # cruising just above the knee
    assert min(late) >= 100 and max(late) <= 320  # probes included


def test_tracks_the_knee_with_noisy_latency():
    run = simulate(lambda t: 128, lambda n: 0.2, 30, jitter=0.3, seed=1)
    assert run.rate(5, 30) >= 0.96 * 640
    assert 110 <= sum(run.limits_between(10, 30)) / len(run.limits_between(10, 30)) <= 220


def test_follows_a_backend_whose_capacity_drops():
    run = simulate(lambda t: 128 if t < 20 else 32, lambda n: 0.1, 90)
    assert run.rate(60, 90) >= 0.95 * 320  # still saturating the smaller backend
    late = sorted(run.limits_between(70, 90))
    assert 32 <= late[len(late) // 2] <= 80  # cruising near the new knee, not 4x above it
    assert min(late) >= 28 and max(late) <= 100  # probes included


def test_backs_off_on_rate_limits():
    run = simulate(lambda t: 64, lambda n: 0.1, 30, reject_above=96)
    assert run.rate(5, 30) >= 0.95 * 640
    assert max(run.limits_between(10, 30)) <= 128
    assert run.rejects < 0.02 * len(run.done)


def test_climbs_while_a_batching_backend_still_pays_off():
    # latency grows with the batch: 32 in flight -> 21/s, 128 -> 43/s, 256 -> 51/s
    run = simulate(lambda t: 1000, lambda n: 1.0 * (1 + n / 64), 240, jitter=0.3)
    assert max(run.limits_between(150, 240)) >= 128
    assert run.rate(150, 240) >= 40


def test_a_tiny_backend_is_not_left_with_a_deep_queue():
    # A 4-slot backend queues from the first round (64 in flight), so no request shows
    # its unloaded latency; probes bring the limit down a step per cruise, never idling it.
    run = simulate(lambda t: 4, lambda n: 0.5, 600)
    assert run.rate(100, 600) >= 0.98 * 8
    late = sorted(run.limits_between(500, 600))
    assert late[len(late) // 2] <= 16 and max(late) <= 20


def test_a_small_backend_converges_within_a_minute():
    run = simulate(lambda t: 16, lambda n: 0.05, 120)
    assert run.rate(10, 120) >= 0.98 * 320
    late = sorted(run.limits_between(60, 120))
    assert 16 <= late[len(late) // 2] <= 32
