"""`num_threads: auto`: pick a rank's torch thread count by measured speed, and keep checking.

Input: the most threads a rank may use, and after every step its real tokens
and seconds. Output: before every step, the thread count to run it with.

On an idle 2-core machine two torch threads train ~1.5x faster than one; when
other processes want the cores too, two threads wait on each other and train
several times slower than one (measured here under a load of 4-6: 0.85 vs
3.7-4.3 steps/s on the quickstart's warm-up, and probes down to 20x slower).
Neither is right everywhere, so the rank probes: a few steps with each
candidate count (a candidate under half the best rate so far is dropped after
one step, so a bad probe costs one slow step), then it keeps the faster by
tokens/s until the next probe. The probe repeats every `every` steps; while
the loser keeps losing by more than 2x, the wait doubles (up to 8x).
"""

from __future__ import annotations

import logging

log = logging.getLogger("pipe.train")


class ThreadTuner:
    """Chooses between 1 and `most` torch threads by probing; see the module docstring."""

    def __init__(self, most: int, *, window: int = 5, every: int = 300) -> None:
        self.candidates = [1, most] if most > 1 else [1]
        self.window, self.every, self.interval = window, every, every
        self.best = self.candidates[-1]
        self._queue: list[int] = []  # candidates still to measure in the current probe
        self._seen: dict[int, list[float]] = {}  # threads -> [tokens, seconds, steps]
        self._next_probe = 0

    def threads_for(self, step: int) -> int:
        """Thread count for step `step` (0-based, counted from the start of this run)."""
        if not self._queue and len(self.candidates) > 1 and step >= self._next_probe:
            self._queue, self._seen = list(self.candidates), {}
        return self._queue[0] if self._queue else self.best

    def _rate(self, threads: int) -> float:
        tokens, seconds, _ = self._seen[threads]
        return tokens / seconds if seconds > 0 else 0.0

    def record(self, step: int, tokens: int, seconds: float) -> None:
        """Account the step just run; at the end of a probe, choose."""
        if not self._queue:
            return
        current = self._queue[0]
        seen = self._seen.setdefault(current, [0.0, 0.0, 0.0])
        seen[0], seen[1], seen[2] = seen[0] + tokens, seen[1] + seconds, seen[2] + 1
        others = [self._rate(n) for n in self._seen if n != current]
        if seen[2] >= self.window or (others and self._rate(current) < max(others) / 2):
            self._queue.pop(0)
            if not self._queue:
                self._choose(step)

    def _choose(self, step: int) -> None:
        rates = {n: self._rate(n) for n in self._seen}
        self.best = max(rates, key=lambda n: rates[n])
        lopsided = min(rates.values()) < rates[self.best] / 2
        self.interval = min(2 * self.interval, 8 * self.every) if lopsided else self.every
        self._next_probe = step + 1 + self.interval
        log.info(
            "threads: %d (%s); next check in %d steps",
            self.best,
            ", ".join(f"{n}: {r:.0f} tokens/s" for n, r in sorted(rates.items())),
            self.interval,
        )
