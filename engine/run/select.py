"""Select: which stages a run runs, and their cache keys (`pipe run --only/--from/--force`).

Input: the plan, the user's `--only` / `--from` / `--force`, and the run folder's records.
Output: every stage's cache key (`engine.run.cache`), the stages to run in plan order, and
the report's record of every other one: up to date (cached) or not selected. A forced stage
that had completed is set aside into the run's history first, so it starts from nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine.errors import PipeError
from engine.fsio import exists, move
from engine.plan.checksums import HashCache
from engine.plan.dag import Plan
from engine.run.cache import completed, stage_keys, up_to_date
from engine.run.report import RunReport

log = logging.getLogger("pipe.run")


@dataclass(frozen=True)
class RunOptions:
    """Which stages to run and how to react to failures."""

    only: tuple[str, ...] = ()
    from_stage: str | None = None
    force: bool = False
    keep_going: bool = False


def descendants(plan: Plan, name: str) -> set[str]:
    """`name` and every stage that needs it, directly or not."""
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


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is."""
    return path if "://" in path or os.path.isabs(path) else os.path.abspath(path)


def prepare(plan: Plan, options: RunOptions, report: RunReport) -> tuple[dict[str, str], list[str]]:
    """Cache keys, and the stages to run; cached and unselected stages are recorded as such."""
    run_dir = plan.resolved.run_dir
    hashes = HashCache(f"{run_dir.rstrip('/')}/.pipe-hashes.json")
    keys = stage_keys(plan, hashes)
    hashes.save()
    chosen, forced = selection(plan, options)
    pending: list[str] = []
    for name in plan.order:
        stage_dir = absolute(f"{run_dir.rstrip('/')}/{name}")
        rec = report.add(name, plan.stages[name].resolved.kind, keys[name], stage_dir)
        done = up_to_date(stage_dir, keys[name], plan.stages[name].outputs)
        if name not in forced and done:
            rec.status, rec.cache_hit = "cached", True
            log.info("%s: up to date, skipped (cache hit)", name)
        elif name not in chosen:
            rec.status = "not-selected"
        else:
            if done:  # forced: run again from scratch, not resumed from its own last checkpoint
                _set_aside(plan, name, stage_dir, report.history(run_dir))
            pending.append(name)
    _check_needs(plan, report, pending)
    return keys, pending


def _check_needs(plan: Plan, report: RunReport, pending: list[str]) -> None:
    """Refuse, before anything starts, a selected stage that needs a stage neither selected
    nor ever completed in this run folder (`--only grpo` in a fresh folder): it would fail
    reading an output that is not there. A need completed under other settings or code runs
    as `--only` asks, with a warning: its output is there, only out of date."""
    run_dir = plan.resolved.run_dir.rstrip("/")
    missing: list[tuple[str, str]] = []
    for name in pending:
        for need in plan.stages[name].resolved.needs:
            if report.stages[need].status != "not-selected":
                continue
            if completed(report.stages[need].stage_dir, plan.stages[need].outputs) is not None:
                log.warning(
                    "%s: needs %s, whose output in %s is out of date (other settings or code): "
                    "used as it is, as --only asks",
                    name,
                    need,
                    run_dir,
                )
            else:
                missing.append((name, need))
    if missing:
        what = "; ".join(f"'{name}' needs '{need}'" for name, need in missing)
        add = " ".join(f"--only {need}" for need in sorted({need for _, need in missing}))
        raise PipeError.single(
            None,
            "--only",
            f"{what}, which has no complete output in {run_dir}: add {add}, or run without --only",
        )


def _set_aside(plan: Plan, name: str, stage_dir: str, history: str) -> None:
    """Move a completed stage's folder, and its outputs outside it, into the run's history
    (`replaced/<stage>/`): a forced stage starts from nothing (a train or rl stage would
    otherwise resume from its final checkpoint and do nothing), and the completed run is
    kept, not lost."""
    kept = f"{history}/replaced/{name}"
    for i, path in enumerate(sorted(plan.stages[name].outputs.values())):
        if not path.startswith(stage_dir.rstrip("/") + "/") and exists(path):
            move(path, f"{kept}/outputs/{i}-{path.rstrip('/').rsplit('/', 1)[-1]}")
    move(stage_dir, f"{kept}/{name}")
    log.info("%s: forced; its completed run is kept in %s", name, kept)
