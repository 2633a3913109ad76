"""Tracking: a run's plan, stages and metric events -> the trackers of its `tracking:` block.

Input: the `Plan`, the live `RunReport` (its stage records change as the run goes) and
each stage's `track.jsonl` (appended by `stages.lib.io.metrics.Metrics` wherever a metric is
made: a rank, a collector, a controller). Output: the calls of `engine.run.tracking.base.Tracker`
on every tracker named, from the driver only: one writer per tracker, no tracker
library or credential on a worker.

How it fits the execute loop without slowing it: `execute` is not touched. A poller
thread on the driver looks at the report's stage statuses once a second (a stage going
`running` opens its child run, a final status closes it, with its PNGs and reports as
artifacts and its result as a summary), tails the events files of the stages that run,
and puts each call on one bounded queue per tracker; a thread per tracker drains its
queue. A slow tracker only fills its own queue (full: events are dropped, one warning),
a failing one warns once and is left alone: the stage folders stay the source of truth.
Stages the cache skipped are recorded as such and nothing of theirs is logged again.
`close` waits a bounded time for the queues to drain.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.load.tracking_block import TrackingSpec
from engine.run.report import RunReport
from engine.run.tracking.base import RunInfo, StageInfo, Tracker, redact

if TYPE_CHECKING:
    from engine.plan.dag import Plan

log = logging.getLogger("pipe.tracking")
EVENTS = "track.jsonl"  # stages.lib.io.metrics.EVENTS
# plots, reports, and the records to audit a run by (`stages.lib.io.audit`)
ARTIFACTS = (
    "*.png",
    "*.md",
    "report.json",
    "*_report.json",
    "metrics.json",
    "samples.jsonl",
    "first_batch.jsonl",
)
RAN = ("running", "succeeded", "failed", "cancelled")
NEVER_RAN = ("cached", "not-selected", "skipped", "not-run")
POLL_S = 1.0
QUEUE = 10_000
Call = tuple[str, tuple[Any, ...]]  # a `Tracker` method's name and its arguments
CLOSE_S = float(os.environ.get("PIPE_TRACKING_CLOSE_S", "120"))


def numbers(data: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, float]:
    """The finite numeric leaves of nested mappings (booleans excluded), keys joined."""
    out: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(numbers(value, f"{prefix}{key}{sep}", sep))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            out[f"{prefix}{key}"] = float(value)
    return out


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> values as text (lists and scalars whole, JSON where not a string)."""
    if isinstance(data, Mapping) and data:
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data if isinstance(data, str) else json.dumps(data)}


def _source(sources: Mapping[str, Any], dotted: str) -> str:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        src = sources.get(".".join(parts[:i]))
        if src is not None:
            return str(src.render())
    return "kind default"


def stage_info(plan: Plan, name: str, key: str) -> StageInfo:
    resolved = plan.stages[name].resolved
    params = flatten(resolved.config.model_dump(mode="json"))
    sources = {k: _source(resolved.sources, k) for k in params}
    return StageInfo(name, resolved.kind, key, params, sources)


def run_info(plan: Plan, report: RunReport) -> RunInfo:
    params = flatten(plan.as_dict())
    sources: dict[str, str] = {}
    for name in plan.order:
        resolved = plan.stages[name].resolved
        prefix = f"stages.{name}.config."
        for key in params:
            if key.startswith(prefix):
                sources[key] = _source(resolved.sources, key[len(prefix) :])
    run_dir = os.path.abspath(plan.resolved.run_dir)
    tags = {"pipe.scheduler": report.scheduler, "pipe.file": report.pipeline}
    return RunInfo(report.run_id, plan.name, run_dir, params, sources, tags)


class _Writer:
    """One tracker, its bounded queue and its thread; the first failure disables it."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.calls: queue.Queue[Call | None] = queue.Queue(QUEUE)
        self.failed = self.full = False
        self.link = ""
        self.thread = threading.Thread(target=self._drain, name=f"pipe-{tracker.name}", daemon=True)
        self.thread.start()

    def put(self, call: Call) -> None:
        if self.failed:
            return
        try:
            self.calls.put_nowait(call)
        except queue.Full:
            if not self.full:
                self.full = True
                log.warning("tracking: %s is behind; dropping events", self.tracker.name)

    def _drain(self) -> None:
        while (call := self.calls.get()) is not None:
            if self.failed:
                continue
            try:
                method, args = call
                getattr(self.tracker, method)(*args)
                if method == "start":
                    self.link = self.tracker.link()
            except Exception as exc:
                self.failed = True
                log.warning(
                    "tracking: %s failed (%s); the run goes on without it, "
                    "the stage folders keep every record",
                    self.tracker.name,
                    redact(f"{type(exc).__name__}: {exc}")[:500],
                )


class Recorder:
    """Feeds the trackers from the driver while a run executes."""

    def __init__(self, plan: Plan, report: RunReport, trackers: list[Tracker]) -> None:
        self.plan, self.report = plan, report
        self.writers = [_Writer(t) for t in trackers]
        self.state: dict[str, str] = {}  # stage -> open | closed
        self.offsets = {n: _size(self._events(n)) for n in report.stages}
        self.partial: dict[str, str] = {}
        self.stop = threading.Event()
        info = run_info(plan, report)
        for w in self.writers:
            w.put(("start", (info,)))
        self.poller = threading.Thread(target=self._poll, name="pipe-tracking", daemon=True)
        self.poller.start()

    def _events(self, name: str) -> str:
        return f"{self.report.stages[name].stage_dir.rstrip('/')}/{EVENTS}"

    def _put(self, call: Call) -> None:
        for w in self.writers:
            w.put(call)

    def _poll(self) -> None:
        while not self.stop.wait(POLL_S) and self._scan_safely():
            pass

    def _scan_safely(self) -> bool:
        """`scan`, a failure of which ends the tracking (one warning), never the run."""
        try:
            self.scan()
        except Exception as exc:
            log.warning("tracking: stopped (%s: %s); the run goes on", type(exc).__name__, exc)
            self.stop.set()
            return False
        return True

    def scan(self) -> None:
        """One look at every stage: open, feed and close child runs as statuses change."""
        for name, rec in self.report.stages.items():
            status, state = rec.status, self.state.get(name)
            if state == "closed":
                continue
            if status in NEVER_RAN and state is None:
                info = stage_info(self.plan, name, rec.key)
                self._put(("skipped", (info, status)))
                self.state[name] = "closed"
                continue
            if status not in RAN:
                continue
            if state is None:
                info = stage_info(self.plan, name, rec.key)
                self._put(("opened", (info,)))
                self.state[name] = "open"
            self._tail(name)
            if status != "running":
                self._close(name, status, rec.metrics)

    def _tail(self, name: str) -> None:
        path = self._events(name)
        size = _size(path)
        start = self.offsets.get(name, 0)
        if size < start:  # the file was replaced: read it from the top
            start, self.partial[name] = 0, ""
        if size == start:
            return
        try:
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read(size - start).decode("utf-8", "replace")
        except OSError:  # gone since: the next look reads what is there
            return
        text = self.partial.pop(name, "") + chunk
        self.offsets[name] = size
        lines = text.split("\n")
        self.partial[name] = lines.pop()  # an unfinished last line waits for the next look
        for line in lines:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                event = json.loads(line)
                values = {k: float(v) for k, v in event["metrics"].items()}
                step, wall = int(event["step"]), float(event.get("t", time.time()))
                self._put(("metrics", (name, step, values, wall)))

    def _close(self, name: str, status: str, metrics: Mapping[str, Any]) -> None:
        folder = self.report.stages[name].stage_dir
        found = sorted({p for pat in ARTIFACTS for p in glob.glob(f"{glob.escape(folder)}/{pat}")})
        for path in found:
            self._put(("artifact", (name, path)))
        summary = numbers(metrics)
        self._put(("closed", (name, status, summary)))
        self.state[name] = "closed"

    def close(self) -> dict[str, str]:
        """Log what is left, end the runs, wait (bounded) for the trackers; their links."""
        stopped = self.stop.is_set()
        self.stop.set()
        self.poller.join()
        if not stopped:
            self._scan_safely()
        status = self.report.status
        for w in self.writers:
            w.put(("finish", (status,)))
            with contextlib.suppress(queue.Full):
                w.calls.put_nowait(None)
        deadline = time.monotonic() + CLOSE_S
        links = {}
        for w in self.writers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                log.warning(
                    "tracking: %s still writing after %.0f s; left behind", w.tracker.name, CLOSE_S
                )
            elif w.link and not w.failed:
                links[w.tracker.name] = w.link
        return links


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def make_trackers(spec: TrackingSpec, run_dir: str, pipeline: str) -> list[Tracker]:
    """The trackers `spec` names, each built (nothing imported or contacted yet)."""
    out: list[Tracker] = []
    if spec.tensorboard is not None:
        from engine.run.tracking.tensorboard import TensorBoardTracker

        out.append(TensorBoardTracker(spec.tensorboard, run_dir))
    if spec.mlflow is not None:
        from engine.run.tracking.mlflow import MlflowTracker

        out.append(MlflowTracker(spec.mlflow, run_dir, pipeline))
    if spec.wandb is not None:
        from engine.run.tracking.wandb import WandbTracker

        out.append(WandbTracker(spec.wandb, run_dir, pipeline))
    return out


def start_tracking(plan: Plan, report: RunReport) -> Recorder | None:
    """A `Recorder` for the trackers the pipeline names; None when it names none."""
    spec = plan.resolved.loaded.spec.tracking
    if not spec.named():
        return None
    trackers = make_trackers(spec, os.path.abspath(plan.resolved.run_dir), plan.name)
    log.info("tracking: %s", ", ".join(t.name for t in trackers))
    return Recorder(plan, report, trackers)


def wants_dashboard(spec: Any) -> bool:
    """Serve Dask's dashboard when a tracker is set or `PIPE_DASHBOARD=1` asks for it: it
    costs the driver ~1 s of start-up (bokeh), so a plain run goes without it."""
    flag = os.environ.get("PIPE_DASHBOARD", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    return flag in ("1", "true", "yes", "on") or bool(spec.named())
