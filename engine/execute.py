"""Execute: `Plan` -> `RunReport`, each stage a Dask task placed where its resources are.

Stages are submitted as soon as everything they need has finished, with
`resources={"GPU": n}` when they need GPUs. Up-to-date stages (same cache key,
outputs present) are skipped. A failed stage is retried up to `retries` times
(each attempt counted in the report); its dependents are skipped and named.
Without `--keep-going` no new stage starts after a failure (running ones
finish); with it, independent branches run to the end. A stage asking for more
GPUs than any worker offers fails before anything launches. Ctrl-C cancels
running stages and the report says what finished.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.cache import HashCache, stage_keys, up_to_date
from engine.cluster import Cluster
from engine.plan import Plan
from engine.report import RunReport, StageRecord
from engine.stage import kinds
from engine.task import LOG_TOPIC, StagePayload, run_stage

log = logging.getLogger("pipe.run")


@dataclass(frozen=True)
class RunOptions:
    """Which stages to run and how to react to failures."""

    only: tuple[str, ...] = ()
    from_stage: str | None = None
    force: bool = False
    keep_going: bool = False


def descendants(plan: Plan, name: str) -> set[str]:
    out = {name}
    for other in plan.order:
        if any(n in out for n in plan.stages[other].resolved.needs):
            out.add(other)
    return out


def selection(plan: Plan, options: RunOptions) -> tuple[set[str], set[str]]:
    """(stages considered, stages forced to run)."""
    if options.only:
        chosen = set(options.only)
    elif options.from_stage:
        chosen = descendants(plan, options.from_stage)
    else:
        chosen = set(plan.order)
    forced = set(chosen) if options.force else set()
    if options.from_stage:
        forced |= descendants(plan, options.from_stage)
    return chosen, forced


def _abs(path: str) -> str:
    return path if "://" in path or os.path.isabs(path) else os.path.abspath(path)


@dataclass
class _Run:
    """State of one execution."""

    plan: Plan
    cluster: Cluster
    options: RunOptions
    run_dir: str
    report: RunReport
    keys: dict[str, str] = field(default_factory=dict)
    futures: dict[Any, str] = field(default_factory=dict)
    completed: Any = None  # distributed.as_completed: results are fetched as tasks finish
    stopped: str | None = None
    n_workers: int = 1

    def record(self, name: str) -> StageRecord:
        return self.report.stages[name]

    def stage_dir(self, name: str) -> str:
        return _abs(f"{self.run_dir.rstrip('/')}/{name}")

    def submit(self, name: str) -> None:
        st = self.plan.stages[name]
        rec = self.record(name)
        rec.attempts += 1
        rec.status = "running"
        payload = StagePayload(
            name=name,
            kind=kinds()[st.resolved.kind],
            config=st.resolved.config,
            stage_dir=self.stage_dir(name),
            run_dir=_abs(self.run_dir),
            pipeline_dir=_abs(str(self.plan.resolved.loaded.base_dir)),
            key=self.keys[name],
            attempt=rec.attempts,
            gpus=st.resolved.gpus,
            workers=self.n_workers,
            outputs={k: _abs(v) for k, v in st.outputs.items()},
        )
        resources = {"GPU": st.resolved.gpus} if st.resolved.gpus else None
        future = self.cluster.client.submit(
            run_stage,
            payload,
            key=f"{name}-{self.report.run_id}-{rec.attempts}",
            resources=resources,
            pure=False,
        )
        self.futures[future] = name
        self.completed.add(future)
        gpus = f", {st.resolved.gpus} GPU(s)" if st.resolved.gpus else ""
        log.info("%s: started (attempt %d%s)", name, rec.attempts, gpus)


def prepare(plan: Plan, options: RunOptions, report: RunReport) -> tuple[dict[str, str], list[str]]:
    """Cache keys, and the stages to run; cached and unselected stages are recorded as such."""
    run_dir = plan.resolved.run_dir
    hashes = HashCache(f"{run_dir.rstrip('/')}/.pipe-hashes.json")
    keys = stage_keys(plan, hashes)
    hashes.save()
    chosen, forced = selection(plan, options)
    pending: list[str] = []
    for name in plan.order:
        stage_dir = _abs(f"{run_dir.rstrip('/')}/{name}")
        rec = report.add(name, plan.stages[name].resolved.kind, keys[name], stage_dir)
        if name not in forced and up_to_date(stage_dir, keys[name], plan.stages[name].outputs):
            rec.status, rec.cache_hit = "cached", True
            log.info("%s: up to date, skipped (cache hit)", name)
        elif name not in chosen:
            rec.status = "not-selected"
        else:
            pending.append(name)
    return keys, pending


def execute(
    plan: Plan,
    cluster: Cluster,
    report: RunReport,
    options: RunOptions,
    keys: dict[str, str],
    pending: list[str],
) -> RunReport:
    """Run the `pending` stages of the plan on the cluster; fill and return `report`."""
    run = _Run(plan, cluster, options, plan.resolved.run_dir, report, keys=keys)
    run.n_workers = max(1, len(cluster.workers()))
    _check_placement(run, pending)
    client = cluster.client
    client.subscribe_topic(LOG_TOPIC, _forward)
    try:
        _loop(run, pending)
    except KeyboardInterrupt:
        log.warning("interrupted: cancelling %d running stage(s)", len(run.futures))
        client.cancel(list(run.futures))
        for name in run.futures.values():
            run.record(name).status = "cancelled"
        report.interrupted = True
    finally:
        with contextlib.suppress(Exception):  # the scheduler may already be gone
            client.unsubscribe_topic(LOG_TOPIC)
    report.finish()
    return report


def _forward(event: Any) -> None:
    _, msg = event
    if isinstance(msg, dict):
        logging.getLogger(f"pipe.stage.{msg.get('stage')}").log(
            logging.WARNING
            if msg.get("level") in ("WARNING", "ERROR", "CRITICAL")
            else logging.INFO,
            "  [%s] %s",
            msg.get("stage"),
            msg.get("msg"),
        )


def _check_placement(run: _Run, pending: list[str]) -> None:
    """Fail, before anything launches, every stage that no worker can hold."""
    workers = run.cluster.workers()
    offer = {addr: int(res.get("GPU", 0)) for addr, res in workers.items()}
    most = max(offer.values(), default=0)
    for name in list(pending):
        need = run.plan.stages[name].resolved.gpus
        if need > most:
            what = ", ".join(f"{a} GPU={g}" for a, g in sorted(offer.items())) or "no workers"
            rec = run.record(name)
            rec.status = "failed"
            rec.error = (
                f"stage '{name}' needs {need} GPU(s); no worker offers that many (workers: {what})"
            )
            log.error("%s: cannot be placed: %s", name, rec.error)
            pending.remove(name)
            if not run.options.keep_going:
                run.stopped = name


def _ready(run: _Run, name: str) -> str:
    """'go', 'wait', or 'skip' given the states of what `name` needs."""
    states = [run.record(n).status for n in run.plan.stages[name].resolved.needs]
    if any(s in ("failed", "skipped", "cancelled") for s in states):
        return "skip"
    if all(s in ("succeeded", "cached", "not-selected") for s in states):
        return "go"
    return "wait"


def _loop(run: _Run, pending: list[str]) -> None:
    from distributed import as_completed

    run.completed = as_completed([], with_results=True, raise_errors=False)  # type: ignore[no-untyped-call]
    while pending or run.futures:
        for name in list(pending):
            state = _ready(run, name)
            if state == "skip":
                pending.remove(name)
                rec = run.record(name)
                rec.status = "skipped"
                rec.error = (
                    "skipped: "
                    + ", ".join(
                        n
                        for n in run.plan.stages[name].resolved.needs
                        if run.record(n).status in ("failed", "skipped")
                    )
                    + " did not finish"
                )
                log.warning("%s: skipped (%s)", name, rec.error[len("skipped: ") :])
            elif state == "go" and run.stopped is None:
                pending.remove(name)
                run.submit(name)
        if run.stopped is not None and not run.futures:
            for name in pending:
                run.record(name).status = "not-run"
                run.record(
                    name
                ).error = f"not started: stage '{run.stopped}' failed (use --keep-going to run independent stages)"
            pending.clear()
            break
        if not run.futures:
            continue
        batch = [next(run.completed)]
        if run.completed.has_ready():
            batch += run.completed.next_batch(block=False)
        for future, result in batch:
            _finished(run, future, result, run.futures.pop(future))


def _finished(run: _Run, future: Any, result: Any, name: str) -> None:
    rec = run.record(name)
    st = run.plan.stages[name].resolved
    if future.status == "finished":
        rec.status = "succeeded"
        rec.worker, rec.start, rec.end = result.worker, result.start, result.end
        rec.metrics = result.metrics
        log.info("%s: succeeded on %s in %.2f s", name, result.worker, result.end - result.start)
        return
    exc = result if isinstance(result, BaseException) else future.exception()
    rec.error = f"{type(exc).__name__}: {exc}"
    if rec.attempts <= st.retries:
        log.warning("%s: attempt %d failed (%s); retrying", name, rec.attempts, rec.error)
        run.submit(name)
        return
    rec.status = "failed"
    rec.end = time.time()
    dependents = sorted(descendants(run.plan, name) - {name})
    log.error(
        "%s: failed after %d attempt(s): %s (log: %s/log.txt)%s",
        name,
        rec.attempts,
        rec.error,
        rec.stage_dir,
        f"; skipping {', '.join(dependents)}" if dependents else "",
    )
    if not run.options.keep_going:
        run.stopped = name
