"""`pipe run`: load -> resolve -> plan -> execute, with the run's records.

Checks everything it can before a cluster starts; connects (or starts the
embedded `LocalCluster`); resolves `cluster.gpus: auto` from the workers'
resources; writes `<run-dir>/history/<run-id>/plan.lock.yaml`, the driver log
and `report.json` (the latest also at `<run-dir>/report.json`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

from engine.cluster.connect import Cluster
from engine.errors import Diagnostic, Location, PipeError, did_you_mean
from engine.fsio import atomic_write_text, makedirs
from engine.load.load import LoadedPipeline, load_pipeline
from engine.plan.dag import Plan, plan
from engine.plan.dated import keep as keep_date
from engine.plan.dated import release as release_date
from engine.plan.topology import view_from_workers
from engine.resolve.pins import Pinning
from engine.resolve.resolve import resolve
from engine.run.execute import execute
from engine.run.report import RunReport, new_run_id
from engine.run.select import RunOptions, prepare
from engine.run.tracking.recorder import start_tracking, wants_dashboard

if TYPE_CHECKING:
    from engine.cluster.slurm import SlurmRequest

log = logging.getLogger("pipe.run")


@dataclass(frozen=True)
class RunRequest:
    """What the user asked `pipe run` for."""

    pipeline: str
    overrides: tuple[str, ...] = ()
    scheduler: str | None = None
    run_dir: str | None = None
    options: RunOptions = field(default_factory=RunOptions)
    dashboard: bool = False  # the embedded cluster serves Dask's dashboard (bokeh installed)


def _check_names(loaded: LoadedPipeline, options: RunOptions) -> None:
    names = list(loaded.spec.stages)
    errors = []
    for flag, value in [*(("--only", n) for n in options.only), ("--from", options.from_stage)]:
        if value is not None and value not in loaded.spec.stages:
            errors.append(
                Diagnostic(
                    Location(f"{flag} {value}"),
                    "",
                    f"no stage named '{value}'{did_you_mean(value, names)}",
                )
            )
    if errors:
        raise PipeError(errors)


def run_pipeline(req: RunRequest) -> RunReport:
    """Run a pipeline end to end; raise `PipeError` for a user's mistake.

    A pipeline without GPU stages is planned before any cluster starts. One with GPU
    stages (or `cluster.gpus: auto`) is placed on the live workers once connected, and
    refused (`PipeError`, nothing started) when it does not fit them. `scheduler: slurm`
    first counts the jobs the plan needs (`engine.cluster.slurm.request`), then submits them.
    """
    with _sigterm_interrupts():
        return _run_pipeline(req)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a batch system's or CI's time limit, `kill`) ends a run as Ctrl-C does: the
    running stages cancelled, the Slurm jobs cancelled, the report written, exit 1; a
    second SIGTERM ends the process at once. Left alone off the main thread, or where
    SIGTERM is ignored or someone else handles it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.warning("SIGTERM: stopping the run as for Ctrl-C")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_pipeline(req: RunRequest) -> RunReport:
    from engine.cluster.connect import scheduler_address

    loaded = load_pipeline(req.pipeline, req.overrides)
    _check_names(loaded, req.options)
    address = scheduler_address(req.scheduler, loaded.spec.cluster.scheduler)
    gpus, source = _declared(loaded, address)
    pinning = Pinning()  # one pin per hub id for the run, whichever plan uses it
    planned = plan(
        resolve(loaded, run_dir=req.run_dir, gpus=gpus, gpus_from=source, pinning=pinning)
    )
    connection = _Connection(address, loaded.spec.cluster.workers, _slurm(address, planned))
    connection.dashboard = req.dashboard or wants_dashboard(loaded.spec.tracking)
    if (loaded.spec.cluster.gpus != "auto" or (source and not gpus)) and not any(
        s.resolved.gpus for s in planned.stages.values()
    ):
        return _execute(planned, req, connection, None)
    with connection as cluster:
        view = view_from_workers(cluster.worker_info(), loaded.spec.cluster.gpus_per_node)
        gpus, source = None, ""
        if loaded.spec.cluster.gpus == "auto":
            gpus, source = len(view.devices()), "from the workers' resources"
        placed = plan(
            resolve(loaded, run_dir=req.run_dir, gpus=gpus, gpus_from=source, pinning=pinning),
            view,
        )
        if placed.placement is not None and placed.placement.stages:
            log.info("placement:\n%s", placed.placement.render_text(view).rstrip())
        return _execute(placed, req, connection, cluster)


def _slurm(address: str, planned: Plan) -> SlurmRequest | None:
    """The Slurm jobs to submit for `scheduler: slurm` (none otherwise)."""
    if address != "slurm":
        return None
    from engine.cluster.slurm import request

    slurm = request(planned)
    log.info(
        "slurm: %d job(s) of %d GPU(s) each, logs in %s", slurm.jobs, slurm.gpus, slurm.log_dir
    )
    return slurm


def _declared(loaded: LoadedPipeline, address: str) -> tuple[int | None, str]:
    """`cluster.gpus: auto` before connecting: the embedded cluster's GPUs are this machine's
    (`local_gpus`, what `connect` gives its workers); a remote cluster's are read once
    connected, planned till then as none (a stand-in: no source, nothing dropped)."""
    if loaded.spec.cluster.gpus != "auto":
        return None, ""
    if address == "local":
        from engine.cluster.connect import local_gpus

        gpus, source, _ = local_gpus(loaded.spec.cluster.gpus_per_node)
        return gpus, source
    return 0, ""


class _Connection:
    """Connect (or start the embedded cluster) on entry, close on exit."""

    def __init__(self, address: str, workers: int, slurm: SlurmRequest | None = None) -> None:
        self.address, self.workers, self.slurm = address, workers, slurm
        self.wanted: int | None = None  # workers the stages to run use (embedded cluster)
        self.dashboard = False  # --dashboard, or a `tracking:` block (engine.run.tracking)
        self.cluster: Cluster | None = None

    def __enter__(self) -> Cluster:
        from engine.cluster.connect import connect

        t0 = time.perf_counter()
        self.cluster = connect(
            self.address,
            self.workers,
            slurm=self.slurm,
            wanted=self.wanted,
            dashboard=self.dashboard,
        )
        n = len(self.cluster.workers())
        log.info(
            "cluster: %s (%d workers) ready in %.1f s", self.address, n, time.perf_counter() - t0
        )
        if self.cluster.dashboard:
            log.info("dashboard: %s", self.cluster.dashboard)
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.close()


def _execute(
    planned: Plan, req: RunRequest, connection: _Connection, cluster: Cluster | None
) -> RunReport:
    for note in planned.resolved.notes:
        log.warning("%s", note.render())
    run_dir = planned.resolved.run_dir
    report = RunReport(new_run_id(), req.pipeline, planned.name, connection.address)
    history = report.history(run_dir)
    makedirs(history)
    atomic_write_text(f"{history}/plan.lock.yaml", planned.to_yaml())
    if planned.date is not None:  # a resume after midnight renders this run's date
        keep_date(run_dir, planned.date)
    handler = logging.FileHandler(f"{history}/driver.log") if "://" not in history else None
    root = logging.getLogger("pipe")
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    try:
        log.info("run %s: %d stages, records in %s", report.run_id, len(planned.order), history)
        keys, pending = prepare(planned, req.options, report)
        recorder = start_tracking(planned, report)  # None without a `tracking:` block
        try:
            if pending and cluster is None:
                connection.wanted = workers_used(planned, pending, connection.workers)
                with connection as started:
                    _run_on(started, planned, req, report, keys, pending)
            elif pending and cluster is not None:
                _run_on(cluster, planned, req, report, keys, pending)
            report.finish()
            if all(r.status in ("succeeded", "cached") for r in report.stages.values()):
                release_date(run_dir)
        finally:
            if recorder is not None:
                report.tracking = recorder.close()
        path = report.write(run_dir)
        _summary(report, path)
    finally:
        if handler is not None:
            root.removeHandler(handler)
            handler.close()
    return report


def workers_used(planned: Plan, pending: list[str], workers: int) -> int:
    """Workers the `pending` stages use together (each its kind's `workers_used`), at most
    `workers`: a one-stage pipeline starts one worker process, not `cluster.workers`."""
    used = sum(planned.stages[n].resolved.config.workers_used(workers) for n in pending)
    return max(1, min(workers, used))


def _run_on(
    cluster: Cluster,
    planned: Plan,
    req: RunRequest,
    report: RunReport,
    keys: dict[str, str],
    pending: list[str],
) -> None:
    report.dashboard = cluster.dashboard
    jobs = cluster.jobs()  # before execute: workers are only released from here on
    slots = planned.placement.stages if planned.placement is not None else {}
    try:
        execute(planned, cluster, report, req.options, keys, pending, slots)
    finally:
        for rec in report.stages.values():
            where = rec.workers or [p["worker"] for p in rec.placement if p.get("worker")]
            rec.slurm_jobs = sorted({jobs[w] for w in where if w in jobs}, key=int)


def _summary(report: RunReport, path: str) -> None:
    counts: dict[str, int] = {}
    for rec in report.stages.values():
        counts[rec.status] = counts.get(rec.status, 0) + 1
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    log.info(
        "run %s %s in %.1f s: %s; report: %s",
        report.run_id,
        report.status,
        (report.ended or 0) - report.started,
        parts,
        path,
    )
