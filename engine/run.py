"""`pipe run`: load -> resolve -> plan -> execute, with the run's records.

Checks everything it can before a cluster starts; connects (or starts the
embedded `LocalCluster`); resolves `cluster.gpus: auto` from the workers'
resources; writes `<run-dir>/history/<run-id>/plan.lock.yaml`, the driver log
and `report.json` (the latest also at `<run-dir>/report.json`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.cluster import Cluster
from engine.errors import Diagnostic, Location, PipeError, did_you_mean
from engine.execute import RunOptions, execute, prepare
from engine.fsio import atomic_write_text, makedirs
from engine.load import LoadedPipeline, load_pipeline
from engine.placement import view_from_workers
from engine.plan import Plan, plan
from engine.report import RunReport, new_run_id
from engine.resolve import resolve

log = logging.getLogger("pipe.run")


@dataclass(frozen=True)
class RunRequest:
    """What the user asked `pipe run` for."""

    pipeline: str
    overrides: tuple[str, ...] = ()
    scheduler: str | None = None
    run_dir: str | None = None
    options: RunOptions = field(default_factory=RunOptions)


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
    refused (`PipeError`, nothing started) when it does not fit them.
    """
    from engine.cluster import scheduler_address

    loaded = load_pipeline(req.pipeline, req.overrides)
    _check_names(loaded, req.options)
    address = scheduler_address(req.scheduler, loaded.spec.cluster.scheduler)
    planned = plan(resolve(loaded, run_dir=req.run_dir, gpus=_declared(loaded)))
    if loaded.spec.cluster.gpus != "auto" and not any(
        s.resolved.gpus for s in planned.stages.values()
    ):
        return _execute(planned, req, address, None)
    with _Connection(address, loaded.spec.cluster.workers) as cluster:
        view = view_from_workers(cluster.worker_info(), loaded.spec.cluster.gpus_per_node)
        gpus = None
        if loaded.spec.cluster.gpus == "auto":
            gpus = len(view.devices())
            log.info("cluster.gpus: auto -> %d (from the workers' resources)", gpus)
        placed = plan(resolve(loaded, run_dir=req.run_dir, gpus=gpus), view)
        if placed.placement is not None and placed.placement.stages:
            log.info("placement:\n%s", placed.placement.render_text(view).rstrip())
        return _execute(placed, req, address, cluster)


def _declared(loaded: LoadedPipeline) -> int | None:
    """Plan `cluster.gpus: auto` before connecting as if the workers had none."""
    return 0 if loaded.spec.cluster.gpus == "auto" else None


class _Connection:
    """Connect (or start the embedded cluster) on entry, close on exit."""

    def __init__(self, address: str, workers: int) -> None:
        self.address, self.workers = address, workers
        self.cluster: Cluster | None = None

    def __enter__(self) -> Cluster:
        from engine.cluster import connect

        t0 = time.perf_counter()
        self.cluster = connect(self.address, self.workers)
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


def _execute(planned: Plan, req: RunRequest, address: str, cluster: Cluster | None) -> RunReport:
    for note in planned.resolved.notes:
        log.warning("%s", note.render())
    run_dir = planned.resolved.run_dir
    report = RunReport(new_run_id(), req.pipeline, planned.name, address)
    history = f"{run_dir.rstrip('/')}/history/{report.run_id}"
    makedirs(history)
    atomic_write_text(f"{history}/plan.lock.yaml", planned.to_yaml())
    handler = logging.FileHandler(f"{history}/driver.log") if "://" not in history else None
    root = logging.getLogger("pipe")
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    try:
        log.info("run %s: %d stages, records in %s", report.run_id, len(planned.order), history)
        keys, pending = prepare(planned, req.options, report)
        slots = planned.placement.stages if planned.placement is not None else {}
        if pending and cluster is None:
            with _Connection(address, planned.resolved.loaded.spec.cluster.workers) as started:
                report.dashboard = started.dashboard
                execute(planned, started, report, req.options, keys, pending, slots)
        elif pending and cluster is not None:
            report.dashboard = cluster.dashboard
            execute(planned, cluster, report, req.options, keys, pending, slots)
        report.finish()
        path = report.write(run_dir)
        _summary(report, path)
    finally:
        if handler is not None:
            root.removeHandler(handler)
            handler.close()
    return report


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
