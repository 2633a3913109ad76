"""Run records: `report.json` per run, with one record per stage.

Per stage: status (succeeded, cached, failed, skipped, not-run, not-selected, cancelled),
the worker it ran on (and its Slurm job id under `scheduler: slurm`), start, end, duration,
attempts, cache hit, the error, its folder and metrics. Written to
`<run-dir>/history/<run-id>/` and, for the latest run, `<run-dir>/report.json`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.fsio import atomic_write_text, makedirs


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


@dataclass
class StageRecord:
    """What happened to one stage in one run."""

    name: str
    kind: str
    key: str
    stage_dir: str
    status: str = "pending"
    attempts: int = 0
    cache_hit: bool = False
    worker: str | None = None
    workers: list[str] = field(default_factory=list)
    placement: list[dict[str, Any]] = field(default_factory=list)
    slurm_jobs: list[str] = field(default_factory=list)  # the Slurm jobs of its workers
    start: float | None = None
    end: float | None = None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return round(self.end - self.start, 4)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["duration_s"] = self.duration_s
        data["log"] = f"{self.stage_dir}/log.txt"
        return data


@dataclass
class RunReport:
    """The record of one `pipe run`."""

    run_id: str
    pipeline: str
    name: str
    scheduler: str
    dashboard: str | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    interrupted: bool = False
    stages: dict[str, StageRecord] = field(default_factory=dict)
    tracking: dict[str, str] = field(default_factory=dict)  # tracker -> where to look

    def add(self, name: str, kind: str, key: str, stage_dir: str) -> StageRecord:
        rec = StageRecord(name, kind, key, stage_dir)
        self.stages[name] = rec
        return rec

    def finish(self) -> None:
        self.ended = time.time()

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.stages.items() if r.status == "failed"]

    @property
    def status(self) -> str:
        if self.interrupted:
            return "cancelled"
        return "failed" if self.failed else "succeeded"

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "pipeline": self.pipeline,
            "name": self.name,
            "status": self.status,
            "scheduler": self.scheduler,
            "dashboard": self.dashboard,
            "started": self.started,
            "ended": self.ended,
            "duration_s": None if self.ended is None else round(self.ended - self.started, 3),
            "stages": {n: r.as_dict() for n, r in self.stages.items()},
            "tracking": self.tracking,
        }

    def history(self, run_dir: str) -> str:
        """This run's records folder: `<run-dir>/history/<run-id>`."""
        return f"{run_dir.rstrip('/')}/history/{self.run_id}"

    def write(self, run_dir: str) -> str:
        """Write the report to the run's history folder and as the latest; return the history
        path."""
        text = json.dumps(self.as_dict(), indent=2, default=str) + "\n"
        history = self.history(run_dir)
        makedirs(history)
        atomic_write_text(f"{history}/report.json", text)
        atomic_write_text(f"{run_dir.rstrip('/')}/report.json", text)
        return f"{history}/report.json"
