"""Metric events: how a stage hands its per-step metrics to the run's trackers.

Input: `Metrics(stage_dir).log(step, {"loss": 0.41, ...})` from wherever a metric is
made: a training rank, a collector's progress tick, a controller's step, a stage's
last lines. Output: one JSON line per call appended to `<stage_dir>/track.jsonl`
(`{"step", "t", "metrics"}`, numbers only). The driver's tracking writer
(`engine.run.tracking.recorder`) tails that file while the stage runs and forwards the events to
TensorBoard, MLflow and W&B; it is the only writer to a tracker, so no process that
emits needs a tracker library or a credential.

Why a file and not a Dask topic: most emitters are not Dask tasks (training ranks are
subprocesses of the stage, collect shards may run in their own), and a line appended
to the stage's folder works from any of them without a client, survives a driver that
restarts, and the driver already reads the stage folders (the cache check). One
`write` per event of a short line (O_APPEND) keeps concurrent emitters of one stage
from interleaving. Emitting never fails a stage: an unwritable file is noted once in
the log and the stage's own records stay the source of truth. A stage folder on remote
storage (`s3://...`) gets no events: only the stage's summary reaches the trackers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

EVENTS = "track.jsonl"
log = logging.getLogger("pipe.stage")


class Metrics:
    """Append metric events for the stage whose folder is `stage_dir`."""

    def __init__(self, stage_dir: str | None) -> None:
        local = bool(stage_dir) and "://" not in str(stage_dir)
        self.path = os.path.join(str(stage_dir), EVENTS) if local else None
        self._warned = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One event: the finite numbers of `metrics` (nested mappings flattened with '/')
        at `step`; nothing when none is a number."""
        values = numbers(metrics)
        if self.path is None or not values:
            return
        line = json.dumps({"step": int(step), "t": round(time.time(), 3), "metrics": values})
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("metrics for the trackers not written (%s); the stage goes on", exc)


def numbers(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric leaves of `metrics` (booleans excluded), keys joined with '/'."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numbers(value, name + "/"))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[name] = float(value)
    return out
