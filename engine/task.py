"""The Dask task that runs one stage on a worker.

Input: a `StagePayload` (the kind, its resolved, frozen config with absolute
paths, folders, the cache key); Dask pickles it, the config stays typed. Output: a `TaskResult` (metrics, worker, start and end). The stage's
log goes to `<stage_dir>/log.txt` and, as Dask events on the topic `pipe-log`,
to the driver. A stamp `<stage_dir>/.pipe-stage.json` holding the cache key is
written only after the stage succeeded and removed before it starts, so a
killed stage never looks complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.fsio import atomic_write_text, exists, makedirs, remove
from engine.stage import StageConfig, StageContext, StageKind

STAMP = ".pipe-stage.json"
LOG_TOPIC = "pipe-log"


@dataclass(frozen=True)
class StagePayload:
    """Everything a worker needs to run a stage."""

    name: str
    kind: StageKind
    config: StageConfig
    stage_dir: str
    run_dir: str
    pipeline_dir: str
    key: str
    attempt: int
    gpus: int
    workers: int
    outputs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskResult:
    """What came back from a finished stage."""

    metrics: dict[str, Any]
    worker: str
    start: float
    end: float


class _EventHandler(logging.Handler):
    """Forward a stage's log records to the driver as Dask worker events."""

    def __init__(self, worker: Any, stage: str) -> None:
        super().__init__(logging.INFO)
        self.worker = worker
        self.stage = stage

    def emit(self, record: logging.LogRecord) -> None:
        event = {"stage": self.stage, "level": record.levelname, "msg": record.getMessage()}
        with contextlib.suppress(Exception):  # the driver may be gone; the file log still has it
            self.worker.log_event(LOG_TOPIC, event)


def _worker() -> Any:
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def _stage_logger(
    payload: StagePayload, worker: Any
) -> tuple[logging.Logger, list[logging.Handler]]:
    logger = logging.getLogger(f"pipe.stage.{payload.name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handlers: list[logging.Handler] = []
    if "://" not in payload.stage_dir:
        fh = logging.FileHandler(os.path.join(payload.stage_dir, "log.txt"))
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handlers.append(fh)
    if worker is not None:
        handlers.append(_EventHandler(worker, payload.name))
    for h in handlers:
        logger.addHandler(h)
    return logger, handlers


def run_stage(payload: StagePayload) -> TaskResult:
    """Run one stage: clear its stamp, call its function, write metrics and the stamp."""
    makedirs(payload.stage_dir)
    stamp = f"{payload.stage_dir.rstrip('/')}/{STAMP}"
    if exists(stamp):
        remove(stamp)
    worker = _worker()
    logger, handlers = _stage_logger(payload, worker)
    start = time.time()
    try:
        cfg = payload.config
        ctx = StageContext(
            name=payload.name,
            kind=payload.kind.name,
            stage_dir=payload.stage_dir,
            run_dir=payload.run_dir,
            pipeline_dir=payload.pipeline_dir,
            attempt=payload.attempt,
            gpus=payload.gpus,
            workers=payload.workers,
            log=logger,
        )
        logger.info(
            "stage %s (%s) attempt %d starts", payload.name, payload.kind.name, payload.attempt
        )
        metrics = payload.kind.call(cfg, ctx) or {}
        if not isinstance(metrics, dict):
            metrics = {"result": metrics}
        end = time.time()
        atomic_write_text(
            f"{payload.stage_dir.rstrip('/')}/metrics.json",
            json.dumps(metrics, indent=2, default=str) + "\n",
        )
        record = {"key": payload.key, "outputs": payload.outputs, "finished": end}
        atomic_write_text(stamp, json.dumps(record, indent=2) + "\n")
        logger.info("stage %s done in %.2f s", payload.name, end - start)
    except BaseException:
        logger.exception("stage %s failed", payload.name)
        raise
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    address = worker.address if worker is not None else "local"
    return TaskResult(metrics, address, start, end)
