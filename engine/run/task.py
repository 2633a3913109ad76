"""The Dask task that runs one stage on a worker.

Input: a `StagePayload` (the kind, its resolved, frozen config with absolute paths, folders,
the cache key, and the stage's placement: its slots and which of its tasks this is); Dask
pickles it, the config stays typed. Output: a `TaskResult` (metrics, worker, start and end).
Models the config names by hub id are fetched on the worker first (`engine.run.snapshots`): the
stage runs on their local snapshot folders. The stage's log goes to `<stage_dir>/log.txt` and,
as Dask events on the topic `pipe-log`, to the driver; what libraries log or warn meanwhile
goes to `log.txt` alone (`engine.run.notices`). A stamp `<stage_dir>/.pipe-stage.json`
holding the cache key is written only after the stage succeeded and removed before it starts,
so a killed stage never looks complete.

A stage placed on several workers runs as one task per worker (rank order of
its slots); they reach each other through a `DaskLink` (Dask variables named
after the run, stage and attempt): node 0 publishes what the others need (e.g.
the torch.distributed master address), any task can ask all to stop, and task
0 writes the metrics and the stamp only once every other task reported done.
The others log to `log.<rank>.txt`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.fsio import atomic_write_text, exists, makedirs, remove
from engine.run.notices import routed
from engine.run.snapshots import local_models
from engine.run.usage import Sampler, sampling
from engine.run.usage_summary import plot_usage, read_usage, summarize
from engine.stage import DATE_ENV, STAGE_END, Slot, StageConfig, StageContext, StageKind

STAMP = ".pipe-stage.json"
LOG_TOPIC = "pipe-log"

# A process that ran or drove stages skips the interpreter's last full garbage collection at
# exit (everything is frozen first; atexit handlers and finalisation still run): with
# reasoning-gym loaded that scan took 0.45 s of a worker's exit, and the driver waits for it
atexit.register(gc.freeze)


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
    producers: dict[str, str] = field(default_factory=dict)  # StageContext.producers
    slots: tuple[Slot, ...] = ()
    node_rank: int = 0
    run_id: str = ""
    date: str = ""  # the run's date, ISO (engine.plan.dated)

    @property
    def tasks(self) -> int:
        return len(dict.fromkeys((s.node, s.worker) for s in self.slots)) or 1

    @property
    def link_prefix(self) -> str:
        return f"pipe-{self.run_id}-{self.name}-{self.attempt}-"


class StageAborted(RuntimeError):
    """Another task of the same stage failed, or the driver stopped the stage."""


class DaskLink:
    """`NodeLink` over Dask variables: values by name, and one abort flag per attempt."""

    POLL_S = 0.5

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.client: Any = None
        with contextlib.suppress(ValueError):  # made in the task's thread: its worker's client,
            from distributed import get_client  # so threads the stage starts can use the link

            self.client = get_client()

    def _var(self, key: str) -> Any:
        from distributed import Variable

        return Variable(self.prefix + key, client=self.client)  # type: ignore[no-untyped-call]

    def publish(self, key: str, value: str) -> None:
        self._var(key).set(value)

    def lookup(self, key: str, timeout_s: float) -> str:
        """The value published under `key`; `StageAborted` if the stage stops first, and
        `TimeoutError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        var = self._var(key)
        while True:
            reason = self.aborted()
            if reason is not None:
                raise StageAborted(reason)
            try:
                return str(var.get(timeout=self.POLL_S))
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no '{key}' from the stage's other tasks in {timeout_s:.0f} s"
                    ) from None

    def abort(self, reason: str) -> None:
        self._var("abort").set(reason)

    def aborted(self) -> str | None:
        try:
            return str(self._var("abort").get(timeout=0.05))
        except TimeoutError:
            return None

    def clear(self, keys: Sequence[str]) -> None:
        for key in (*keys, "abort"):
            with contextlib.suppress(Exception):
                self._var(key).delete()


@dataclass(frozen=True)
class TaskResult:
    """What came back from a finished stage."""

    metrics: dict[str, Any]
    worker: str
    start: float
    end: float
    node_rank: int = 0


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
        name = "log.txt" if payload.node_rank == 0 else f"log.{payload.node_rank}.txt"
        fh = logging.FileHandler(os.path.join(payload.stage_dir, name))
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handlers.append(fh)
    if worker is not None:
        handlers.append(_EventHandler(worker, payload.name))
    for h in handlers:
        logger.addHandler(h)
    return logger, handlers


def run_packed_stage(packed: bytes) -> TaskResult:
    """`run_stage` on a pickled payload, unpickled here, inside the task: a kind the worker
    cannot import (a plugin missing there) fails the stage with a message instead of
    breaking the worker's connection to the scheduler (which would leave the run waiting)."""
    import pickle

    try:
        payload = pickle.loads(packed)
    except Exception as exc:
        where = _address(_worker())
        raise RuntimeError(
            f"the stage cannot be loaded on {where}: {type(exc).__name__}: {exc} "
            "(is the stage kind installed there, at the same version?)"
        ) from None
    return run_stage(payload)


def run_stage(payload: StagePayload) -> TaskResult:
    """Run one stage (or one task of a stage placed on several workers): clear its stamp,
    call its function, write metrics and the stamp."""
    makedirs(payload.stage_dir)
    stamp = f"{payload.stage_dir.rstrip('/')}/{STAMP}"
    leader = payload.node_rank == 0
    if leader and exists(stamp):
        remove(stamp)
    worker = _worker()
    logger, handlers = _stage_logger(payload, worker)
    link = DaskLink(payload.link_prefix) if payload.tasks > 1 else None
    start = time.time()
    try:
        config, hub_names = local_models(payload.config, logger)
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
            slots=payload.slots,
            node_rank=payload.node_rank,
            link=link,
            producers={**payload.producers, **hub_names},
            date=payload.date,
        )
        if payload.date:  # the processes the stage starts render the same date
            os.environ[DATE_ENV] = payload.date
        where = f" (task {payload.node_rank} of {payload.tasks})" if link else ""
        logger.info(
            "stage %s (%s) attempt %d starts%s",
            payload.name,
            payload.kind.name,
            payload.attempt,
            where,
        )
        files = [h for h in handlers if isinstance(h, logging.FileHandler)]
        devices = _task_devices(payload)
        with sampling(payload.stage_dir, _address(worker), devices, payload.node_rank) as usage:
            try:
                with routed(files):  # libraries' notices and warnings: to log.txt, not the terminal
                    metrics = payload.kind.call(config, ctx) or {}
            except BaseException as exc:
                if link is not None:
                    link.abort(f"task {payload.node_rank} on {_address(worker)} failed: {exc}")
                raise
            finally:
                release_stage_memory()
        if not isinstance(metrics, dict):
            metrics = {"result": metrics}
        end = time.time()
        if link is not None and not leader:
            link.publish(f"done-{payload.node_rank}", "ok")
            return TaskResult(metrics, _address(worker), start, end, payload.node_rank)
        if link is not None:
            for rank in range(1, payload.tasks):
                link.lookup(f"done-{rank}", timeout_s=24 * 3600)
        _add_usage(metrics, usage, payload, logger)
        atomic_write_text(
            f"{payload.stage_dir.rstrip('/')}/metrics.json",
            json.dumps(metrics, indent=2, default=str) + "\n",
        )
        record: dict[str, Any] = {"key": payload.key, "outputs": payload.outputs, "finished": end}
        if hub_names:  # the snapshot folders read (their paths name the commits)
            record["hub"] = {folder: name for folder, name in hub_names.items()}
        atomic_write_text(stamp, json.dumps(record, indent=2) + "\n")
        logger.info("stage %s done in %.2f s", payload.name, end - start)
    except BaseException as exc:
        logger.exception("stage %s failed", payload.name)
        with contextlib.suppress(Exception):  # travels with the pickled error: where it ran
            exc.pipe_worker = _address(worker)  # type: ignore[attr-defined]
        raise
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    return TaskResult(metrics, _address(worker), start, end)


def _task_devices(payload: StagePayload) -> tuple[int, ...]:
    """The device ids this task's slots hold (the GPUs its usage rows report)."""
    tasks = list(dict.fromkeys((s.node, s.worker) for s in payload.slots))
    if payload.node_rank >= len(tasks):
        return ()
    mine = tasks[payload.node_rank]
    return tuple(
        sorted({d for s in payload.slots if (s.node, s.worker) == mine for d in s.devices})
    )


def _add_usage(
    metrics: dict[str, Any], usage: Sampler | None, payload: StagePayload, logger: logging.Logger
) -> None:
    """The stage's usage (every task's rows where the folder is local) as `metrics["usage"]`,
    and `usage.png` when the stage ran long enough to plot."""
    if usage is None:
        return
    local = "://" not in payload.stage_dir
    rows = read_usage(payload.stage_dir) if local else usage.rows
    summary = summarize(rows)
    if not summary:
        return
    metrics.setdefault("usage", summary)
    if local:
        try:
            plot_usage(rows, os.path.join(payload.stage_dir, "usage.png"), f"{payload.name}: usage")
        except Exception as exc:  # a plot never fails a finished stage
            logger.warning("usage plot not written: %s: %s", type(exc).__name__, exc)


def _address(worker: Any) -> str:
    return str(worker.address) if worker is not None else "local"


def release_stage_memory() -> None:
    """At a stage's end, in the long-lived worker: what the stage's code registered with
    `engine.stage.at_stage_end` runs (the local generator's model cache empties), then, when
    this process used CUDA, the cached blocks go back to the driver. The next stage on this
    GPU may be a vLLM server, whose start checks that its share of the GPU is free. torch is
    not imported here: a stage that never loaded it has nothing on a GPU."""

    for release in list(STAGE_END):
        try:
            release()
        except Exception:  # a release that fails must not fail a finished stage
            logging.getLogger("pipe.task").exception("releasing a stage's memory failed")
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
