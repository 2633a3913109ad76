"""Execute: `Plan` + placement -> `RunReport`, each stage Dask tasks placed where its slots are.

Stages are submitted as soon as everything they need has finished. A GPU
stage runs as one task per worker its slots are on (`engine.plan.placement`), each
restricted to that worker with `resources={"GPU": devices there}`, and not
before every device it holds is free: stages whose slots share devices run one
after the other, whatever the DAG allows. A stage without GPUs is one task on
any worker. Up-to-date stages (same cache key, outputs present) are skipped
(`engine.run.select` chooses the stages to run and records the others). A
failed stage (any of its tasks) is retried as a whole up to `retries` times
(each attempt counted in the report): the driver raises the attempt's abort
flag, so the other tasks stop their processes, and waits for them; its
dependents are skipped and named. Without `--keep-going` no new stage starts
after a failure (running ones finish); with it, independent branches run to
the end. Ctrl-C cancels running stages and the report says what finished.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.cluster.connect import Cluster
from engine.plan.dag import Plan
from engine.run.report import RunReport, StageRecord
from engine.run.select import RunOptions, absolute, descendants
from engine.run.task import LOG_TOPIC, StageAborted, StagePayload, run_packed_stage
from engine.stage import Slot, kinds

log = logging.getLogger("pipe.run")


@dataclass
class _Attempt:
    """The tasks of one attempt of one stage."""

    futures: set[Any]
    link: str  # prefix of the attempt's Dask variables (engine.run.task.DaskLink)
    results: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    workers: set[str] = field(default_factory=set)  # where failed tasks ran


@dataclass
class _Run:
    """State of one execution."""

    plan: Plan
    cluster: Cluster
    options: RunOptions
    run_dir: str
    report: RunReport
    placement: Mapping[str, tuple[Slot, ...]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    futures: dict[Any, str] = field(default_factory=dict)
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    busy: dict[tuple[str | None, int], str] = field(default_factory=dict)
    retrying: list[str] = field(default_factory=list)
    completed: Any = None  # distributed.as_completed: results are fetched as tasks finish
    stopped: str | None = None
    n_workers: int = 1

    def record(self, name: str) -> StageRecord:
        return self.report.stages[name]

    def stage_dir(self, name: str) -> str:
        return absolute(f"{self.run_dir.rstrip('/')}/{name}")

    def devices(self, name: str) -> set[tuple[str | None, int]]:
        return {(s.worker, d) for s in self.placement.get(name, ()) for d in s.devices}

    def free(self, name: str) -> bool:
        """Whether every device the stage holds is free now."""
        return not any(key in self.busy for key in self.devices(name))

    def submit(self, name: str) -> None:
        st = self.plan.stages[name]
        rec = self.record(name)
        rec.attempts += 1
        rec.status = "running"
        slots = self.placement.get(name, ())
        rec.placement = [s.as_dict() for s in slots]
        base = StagePayload(
            name=name,
            kind=kinds()[st.resolved.kind],
            config=st.resolved.config,
            stage_dir=self.stage_dir(name),
            run_dir=absolute(self.run_dir),
            pipeline_dir=absolute(str(self.plan.resolved.loaded.base_dir)),
            key=self.keys[name],
            attempt=rec.attempts,
            gpus=st.resolved.gpus,
            workers=self.n_workers,
            outputs={k: absolute(v) for k, v in st.outputs.items()},
            producers=producers(self.plan),
            slots=slots,
            run_id=self.report.run_id,
            date=self.plan.date.isoformat() if self.plan.date is not None else "",
        )
        tasks: list[tuple[str | None, str | None]] = [(None, None)]
        if slots:
            tasks = list(dict.fromkeys((s.node, s.worker) for s in slots))
        futures = set()
        for rank, (_, worker) in enumerate(tasks):
            held = held_gpus(slots, worker)
            future = self.cluster.client.submit(
                run_packed_stage,
                pickle.dumps(replace(base, node_rank=rank)),
                key=f"{name}-{self.report.run_id}-{rec.attempts}-{rank}",
                resources={"GPU": held} if held else None,
                workers=[worker] if worker else None,
                allow_other_workers=False,
                pure=False,
            )
            self.futures[future] = name
            self.completed.add(future)
            futures.add(future)
        self.attempts[name] = _Attempt(futures, base.link_prefix)
        for key in self.devices(name):
            self.busy[key] = name
        where = f", {st.resolved.gpus} GPU(s) on {len(tasks)} worker(s)" if slots else ""
        log.info("%s: started (attempt %d%s)", name, rec.attempts, where)

    def release(self, name: str) -> None:
        for key in self.devices(name):
            if self.busy.get(key) == name:
                del self.busy[key]


def producers(plan: Plan) -> dict[str, str]:
    """Every output path of the plan's stages (absolute) -> the reference that names it,
    without its '@': the stage for its main output, `stage.field` for another."""
    out: dict[str, str] = {}
    for name, st in plan.stages.items():
        for i, (out_field, path) in enumerate(st.outputs.items()):
            out.setdefault(absolute(path), name if i == 0 else f"{name}.{out_field}")
    return out


def held_gpus(slots: Any, worker: str | None) -> int:
    """The GPUs a stage's task on `worker` holds: its slots' distinct devices there. Roles
    colocated on one device (`colocate`) share it: counting each role's slot would ask Dask
    for more GPUs than the worker has, and the task would wait forever."""
    return len({d for s in slots if s.worker == worker for d in s.devices})


def execute(
    plan: Plan,
    cluster: Cluster,
    report: RunReport,
    options: RunOptions,
    keys: dict[str, str],
    pending: list[str],
    placement: Mapping[str, tuple[Slot, ...]] | None = None,
) -> RunReport:
    """Run the `pending` stages of the plan on the cluster, GPU stages on their slots;
    fill and return `report`."""
    run = _Run(plan, cluster, options, plan.resolved.run_dir, report, placement or {}, keys=keys)
    run.n_workers = max(1, len(cluster.workers()))
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

    run.completed = as_completed(  # type: ignore[no-untyped-call]
        [], with_results=True, raise_errors=False
    )
    while pending or run.futures or run.retrying:
        for name in list(run.retrying):
            if run.free(name):
                run.retrying.remove(name)
                run.submit(name)
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
            elif state == "go" and run.stopped is None and run.free(name):
                pending.remove(name)
                run.submit(name)
        if run.stopped is not None and not run.futures:
            for name in pending:
                run.record(name).status = "not-run"
                run.record(name).error = (
                    f"not started: stage '{run.stopped}' failed "
                    "(use --keep-going to run independent stages)"
                )
            pending.clear()
            break
        if not run.futures:
            if pending or run.retrying:  # nothing runs that could free what they wait for
                raise RuntimeError(f"stages wait for devices nothing holds: {pending}")
            continue
        batch = [next(run.completed)]
        if run.completed.has_ready():
            batch += run.completed.next_batch(block=False)
        for future, result in batch:
            _finished(run, future, result, run.futures.pop(future))
        _release(run, pending)


def _release(run: _Run, pending: list[str]) -> None:
    """Give back the workers (Slurm jobs) nothing left to run needs: not placed for a stage
    still to run, idle, and not the last one while a stage without GPUs remains."""
    left = [*pending, *run.futures.values(), *run.retrying]
    if not left:
        return
    keep = {s.worker for name in left for s in run.placement.get(name, ()) if s.worker}
    run.cluster.release(keep, need_one=any(not run.placement.get(name) for name in left))


def _finished(run: _Run, future: Any, result: Any, name: str) -> None:
    """One task of `name` ended; once all of its attempt's tasks have, the stage has."""
    attempt = run.attempts[name]
    attempt.futures.discard(future)
    if future.status == "finished":
        attempt.results.append(result)
    else:
        error = result if isinstance(result, BaseException) else future.exception()
        if getattr(error, "pipe_worker", None):
            attempt.workers.add(str(error.pipe_worker))  # type: ignore[union-attr]
        # the failure that started it is the stage's error, not the others' stopping
        if attempt.error is None or (
            isinstance(attempt.error, StageAborted) and not isinstance(error, StageAborted)
        ):
            first = attempt.error is None
            attempt.error = error
            if first and attempt.futures:  # the others stop their processes and fail too
                _abort(run, attempt, f"{type(error).__name__}: {error}")
    if attempt.futures:
        return
    run.release(name)
    rec = run.record(name)
    st = run.plan.stages[name].resolved
    if attempt.error is None:
        first = min(attempt.results, key=lambda r: r.start)
        lead = min(attempt.results, key=lambda r: r.node_rank)
        rec.status = "succeeded"
        rec.worker, rec.start = lead.worker, first.start
        rec.end = max(r.end for r in attempt.results)
        rec.workers = sorted({r.worker for r in attempt.results})
        rec.metrics = lead.metrics
        log.info("%s: succeeded on %s in %.2f s", name, ", ".join(rec.workers), rec.end - rec.start)
        return
    exc = attempt.error
    rec.error = f"{type(exc).__name__}: {exc}"
    if rec.attempts <= st.retries:
        log.warning("%s: attempt %d failed (%s); retrying", name, rec.attempts, rec.error)
        run.retrying.append(name)
        return
    rec.status = "failed"
    rec.end = time.time()
    rec.workers = sorted(attempt.workers | {r.worker for r in attempt.results})
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


def _abort(run: _Run, attempt: _Attempt, reason: str) -> None:
    """Raise the attempt's abort flag: its other tasks stop their processes and fail."""
    from distributed import Variable

    with contextlib.suppress(Exception):  # the scheduler may be going away
        flag = f"{attempt.link}abort"
        Variable(flag, client=run.cluster.client).set(reason)  # type: ignore[no-untyped-call]
