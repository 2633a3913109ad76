"""Adaptive concurrency (`num_samples_in_parallel: auto`): find and track the backend's knee.

Input: one event per request (sent; done, with its latency; overloaded, by a
429 or a timeout) and the time it happened. Output: `limit`, the number of
requests the collector should keep in flight. No capacity is given.

1. Startup (slow start, from 64): the limit grows by one per completed
   request, doubling every round trip, until a round's mean latency (a round
   ends once half the limit's worth of requests sent after it began have
   completed) exceeds 1.5x the lowest seen: a queue is forming.
   The limit goes back to the knee the latency gradient estimates (`limit x
   base latency / latency`, +10%), but not below the last limit without
   queueing.
2. Steady state: throughput is measured over windows (a full round, after a
   round of transition when the limit changed) as mean requests in flight /
   mean latency (Little's law, robust to the bursts of a batching backend).
   After each cruise (one window to settle, two to measure) the limit is
   probed: up 25%, kept if throughput grows 5% (then up again); or down
   15% (or to the latency gradient's estimate of the knee, `limit x base
   latency / latency`, when latency is inflated), kept if throughput holds
   within 3% while latency falls 10% (less a quarter of the step, kept as
   headroom over the knee). Probes alternate direction after a failed one, so
   the limit climbs while concurrency pays and sinks when it only adds
   queueing, following a backend whose capacity changes.
3. A 429 or a timeout cuts the limit to 70%, at most once per round trip.

It starts at 64: vLLM-class servers take that many at once, and each
doubling from lower costs a round trip at part throughput. A backend smaller
than that queues from the first round, so no request shows its unloaded
latency; the limit then comes down by probes only, one step per cruise
(minutes for a backend of a few slots at seconds a request). Set
`num_samples_in_parallel` explicitly for such a backend.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("pipe.adaptive")

STARTUP, CRUISE, PROBE_UP, PROBE_DOWN = "startup", "cruise", "probe_up", "probe_down"


class AdaptiveLimit:
    """A concurrency limit driven by measured latency and throughput."""

    def __init__(self, initial: int = 64, minimum: int = 1, maximum: int = 4096) -> None:
        self.limit = max(minimum, min(maximum, initial))
        self.minimum, self.maximum = minimum, maximum
        self.phase = STARTUP
        self.in_flight = 0
        self.srtt = 0.0  # smoothed latency
        self.base_rtt = math.inf  # lowest window mean latency (slowly forgotten)
        self.base_rate = 0.0  # throughput at the current limit
        self.base_lat = 0.0  # mean latency at the current limit
        self.down_next = True  # direction of the next probe
        self.prev_limit = self.limit
        self.cruises = 0
        self.last_cut = -math.inf
        self.changes = 0
        self._changed = False
        self._area = 0.0  # integral of in-flight over time
        self._area_t = 0.0
        self._win_start = 0.0  # requests sent before this do not count
        self._win_area: tuple[float, float] | None = None  # (area, time) at the window start
        self._win_n = 0
        self._win_lat = 0.0

    # events -------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        self._area += self.in_flight * (now - self._area_t)
        self._area_t = now
        if self._win_area is None and now >= self._win_start:
            self._win_area = (self._area, now)

    def on_send(self, now: float) -> None:
        self._tick(now)
        self.in_flight += 1

    def on_done(self, now: float, latency: float, sent_at: float) -> None:
        self._tick(now)
        self.in_flight -= 1
        self.srtt = latency if self.srtt == 0.0 else 0.9 * self.srtt + 0.1 * latency
        if sent_at < self._win_start:
            return
        if self.phase == STARTUP and latency <= 1.5 * self.base_rtt and self.limit < self.maximum:
            self._set(self.limit + 1)  # slow start: one more per completion, x2 per round trip
        self._win_n += 1
        self._win_lat += latency
        needed = self.limit // 2 if self.phase == STARTUP else self.limit
        if self._win_n >= max(needed, 8):
            self._end_window(now)

    def on_overload(self, now: float) -> None:
        """A 429 or a timeout: cut to 70%, at most once per round trip."""
        if now - self.last_cut < max(self.srtt, 0.05):
            return
        self.last_cut = now
        if self.phase == STARTUP:
            log.info("collect auto concurrency: overload at limit %d during startup", self.limit)
        self.phase = CRUISE
        self.base_rate = 0.0
        self.cruises = 0
        self._set(max(self.minimum, math.floor(self.limit * 0.7)))
        self._new_window(now)

    # windows ------------------------------------------------------------------------
    def _end_window(self, now: float) -> None:
        mean_lat = self._win_lat / self._win_n
        area0, t0 = self._win_area or (self._area, now)
        in_flight = (self._area - area0) / (now - t0) if now > t0 else float(self.limit)
        rate = in_flight / max(mean_lat, 1e-9)
        self.base_rtt = min(self.base_rtt * 1.02, mean_lat)
        if self.phase == STARTUP:
            self._startup(mean_lat)
        else:
            self._steady(rate, mean_lat)
        self._new_window(now)

    def _new_window(self, now: float) -> None:
        """Count only requests sent from now on; after a change in steady state, a round later."""
        skip = self.srtt if self._changed and self.phase != STARTUP else 0.0
        self._changed = False
        self._win_start = now + skip
        self._win_area = None
        self._win_n = 0
        self._win_lat = 0.0
        self._tick(now)

    def _startup(self, mean_lat: float) -> None:
        if mean_lat <= 1.5 * self.base_rtt and self.limit < self.maximum:
            return  # no queue yet: slow start goes on
        # a queue is forming: back to the gradient's knee estimate (+10%), but not below
        # the last limit that showed no queueing
        knee = self.limit * self.base_rtt / max(mean_lat, 1e-9)
        before = self.limit
        self.phase = CRUISE
        self.cruises = 0
        self._set(max(self.minimum, before // 2, math.ceil(knee * 1.1)))
        self.down_next = True
        log.info(
            "collect auto concurrency: queueing at limit %d (latency %.3fs vs base %.3fs), "
            "knee near %.0f; limit %d",
            before,
            mean_lat,
            self.base_rtt,
            knee,
            self.limit,
        )

    def _steady(self, rate: float, mean_lat: float) -> None:
        if self.phase == CRUISE:
            self._cruise(rate, mean_lat)
        elif self.phase == PROBE_UP:
            if rate >= self.base_rate * 1.05:  # more concurrency paid: keep it, try more
                self.base_rate, self.base_lat = rate, mean_lat
                self._probe_up()
            else:
                self._back(down_next=True)
        elif rate >= self.base_rate * 0.97 and mean_lat <= self.base_lat * 0.9:
            self._settle_down()
        else:
            self._back(down_next=False)

    def _settle_down(self) -> None:
        """As fast with less queueing: keep most of the step down, a quarter as headroom.

        The headroom keeps the limit above the knee when the probe landed just under
        it (within measurement noise), so short stalls on the client do not idle the
        backend; repeated successful probes still converge geometrically on the knee.
        """
        settled = self.limit + math.ceil((self.prev_limit - self.limit) * 0.25)
        if settled >= self.prev_limit:
            self._back(down_next=False)
            return
        self._set(settled)
        self.phase = CRUISE
        self.cruises = 0
        self.down_next = True

    def _cruise(self, rate: float, mean_lat: float) -> None:
        """Three windows at the limit: one to settle, two to measure; then probe."""
        self.cruises += 1
        if self.cruises == 1:
            return
        if self.cruises == 2:
            self.base_rate, self.base_lat = rate, mean_lat
            return
        self.base_rate = 0.5 * (self.base_rate + rate)
        self.base_lat = 0.5 * (self.base_lat + mean_lat)
        self.cruises = 0
        if self.down_next:
            self._probe_down(mean_lat if mean_lat > 1.3 * self.base_rtt else None)
        else:
            self._probe_up()

    def _back(self, *, down_next: bool) -> None:
        """The probe did not pay: return to the limit before it and cruise."""
        self._set(self.prev_limit)
        self.phase = CRUISE
        self.cruises = 0
        self.down_next = down_next

    def _probe_up(self) -> None:
        if self.limit >= self.maximum:
            self._back(down_next=True)
            return
        self.phase = PROBE_UP
        self.prev_limit = self.limit
        self._set(min(self.maximum, max(self.limit + 1, math.ceil(self.limit * 1.25))))

    def _probe_down(self, mean_lat: float | None) -> None:
        """Try 85% of the limit, or the latency gradient's estimate when it is lower."""
        target = math.floor(self.limit * 0.85)
        if mean_lat is not None:
            gradient = math.ceil(self.limit * self.base_rtt / max(mean_lat, 1e-9) * 1.1)
            target = min(target, max(gradient, self.limit // 2))
        if target < self.minimum or target >= self.limit:
            self.phase = CRUISE
            self.cruises = 0
            self.down_next = False
            return
        self.phase = PROBE_DOWN
        self.prev_limit = self.limit
        self._set(target)

    def _set(self, limit: int) -> None:
        if limit != self.limit:
            if self.phase != STARTUP:  # slow start moves by one per completion: too chatty
                log.debug("collect auto concurrency: %d -> %d (%s)", self.limit, limit, self.phase)
            self.limit = limit
            self.changes += 1
            self._changed = True
