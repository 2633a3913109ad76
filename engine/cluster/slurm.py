"""Workers as Slurm batch jobs (`cluster.scheduler: slurm`), through `dask_jobqueue.SLURMCluster`.

Input: a `Plan` and its `cluster.slurm` block. Output: a `SlurmRequest` (how many jobs,
GPUs per job, the sbatch options), its job script (`pipe plan --format json`), and, for
`pipe run`, a started `SLURMCluster` with a `Client` once every job's worker connected.

- Jobs: one per node the placement map uses when the plan is placed on a declared
  cluster of `gpus_per_node`-GPU nodes (`cluster.gpus` of them; with `gpus: auto`, the
  largest stage's GPUs); one job without GPUs when no stage needs any. Each job asks
  for `--gres=gpu:G` (G = gpus_per_node, or `cluster.gpus` when smaller) and its worker
  declares `--resources GPU=G`; its devices are the job's `CUDA_VISIBLE_DEVICES` and its
  node, for placement, is `<host>:<job id>` (two jobs on one host are two allocations).
- Nothing is queued before `sbatch --test-only` accepted the script: Slurm's own refusal
  (no such partition, more GPUs than a node has) fails the run at once. Then the workers
  must connect within `start_timeout_s`; otherwise the run fails with each job's state
  and squeue's pending reason, and every job is cancelled.
- `release(...)`: jobs whose worker is idle and holds nothing the rest of the run needs
  are cancelled while the run goes on (execute calls it as stages finish); closing the
  cluster cancels the rest, also after a failure or Ctrl-C.

`dask_jobqueue` is imported only here and only for `scheduler: slurm`.

One name, two sides of one concept (Slurm: the `cluster.slurm` block as the pipeline file
declares it; this file: the jobs started from it; `engine/load/slurm.py` the other side).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from engine.cluster.worker_setup import PRELOAD
from engine.errors import RunFailed
from engine.load.slurm import SlurmSpec
from engine.plan.dag import Plan, plan
from engine.plan.topology import ClusterView, Worker
from engine.resolve.resolve import resolve

log = logging.getLogger("pipe.slurm")

# the worker's node name for placement: each job is its own allocation, even beside another
NODE_LINE = 'export PIPE_NODE="$(hostname -s):${SLURM_JOB_ID}"'


@dataclass(frozen=True)
class SlurmRequest:
    """What `pipe run` submits: `jobs` batch jobs of `gpus` GPUs each."""

    spec: SlurmSpec
    jobs: int
    gpus: int
    log_dir: str

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `SLURMCluster` (and of its job class)."""
        s = self.spec
        gres = [f"--gres=gpu:{self.gpus}"] if self.gpus else []
        return {
            "queue": s.partition,
            "account": s.account,
            "walltime": s.walltime,
            "cores": s.cores,
            "processes": 1,
            "memory": s.memory,
            "job_name": "pipe-worker",
            "job_extra_directives": [*gres, *s.job_extra_directives],
            "job_script_prologue": [*s.job_script_prologue, NODE_LINE],
            "worker_extra_args": [
                *(["--resources", f"GPU={self.gpus}"] if self.gpus else []),
                *("--preload", PRELOAD),  # no tracker credentials on workers
            ],
            "interface": s.interface,
            "log_directory": self.log_dir,
        }

    def job_script(self, scheduler: str = "tcp://SCHEDULER:PORT") -> str:
        """The script each job runs (the scheduler's address is known once the run starts)."""
        job = _jobqueue().SLURMJob(scheduler=scheduler, name="pipe-worker", **self.options())
        return str(job.job_script())  # type: ignore[no-untyped-call]

    def as_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "gpus_per_job": self.gpus, "job_script": self.job_script()}


def _jobqueue() -> Any:
    """`dask_jobqueue.slurm`, leaving Ctrl-C alone: importing dask_jobqueue (its runner module)
    makes SIGINT a silent `sys.exit()`, so an interrupted run would exit 0 without its report."""
    import signal

    previous = signal.getsignal(signal.SIGINT)
    import dask_jobqueue.slurm

    if signal.getsignal(signal.SIGINT) is not previous:
        with contextlib.suppress(ValueError):  # not the main thread: nothing was changed there
            signal.signal(signal.SIGINT, previous)
    return dask_jobqueue.slurm


def request(planned: Plan) -> SlurmRequest:
    """The jobs `planned` needs: placed on a declared cluster of whole nodes, one job per node
    it uses (`PipeError` when it cannot be placed, like `pipe plan --cluster`)."""
    loaded = planned.resolved.loaded
    spec = loaded.spec.cluster
    run_dir = planned.resolved.run_dir
    log_dir = os.path.abspath(f"{run_dir.rstrip('/')}/slurm")
    asks = [s.resolved.gpus for s in planned.stages.values() if s.resolved.gpus]
    total = spec.gpus if isinstance(spec.gpus, int) else max(asks, default=0)
    if not asks and not (spec.gpus == "auto" or planned.resolved.roles):
        return SlurmRequest(spec.slurm, 1, 0, log_dir)
    if total <= 0:
        return SlurmRequest(spec.slurm, 1, 0, log_dir)
    per_job = min(spec.gpus_per_node, total)
    nodes = math.ceil(total / per_job)
    view = ClusterView(
        tuple(Worker(None, f"node{i}", tuple(range(per_job))) for i in range(nodes)), per_job
    )
    gpus = total if spec.gpus == "auto" else None
    placed = plan(
        resolve(loaded, run_dir=run_dir, gpus=gpus, pinning=planned.resolved.pinning), view
    )
    used: set[str] = set()
    if placed.placement is not None:
        groups = [*placed.placement.stages.values(), *placed.placement.pools.values()]
        used = {s.node for slots in groups for s in slots}
    return SlurmRequest(spec.slurm, max(1, len(used)), per_job, log_dir)


def preflight(req: SlurmRequest) -> None:
    """`sbatch --test-only` on the job script: Slurm refuses what it can never run (an unknown
    partition, more GPUs than a node has) without queueing anything."""
    if shutil.which("sbatch") is None:
        raise RunFailed("scheduler: slurm, but there is no 'sbatch' here (is Slurm installed?)")
    os.makedirs(req.log_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".sh", dir=req.log_dir, delete=False) as f:
        f.write(req.job_script())
    try:
        out = subprocess.run(
            ["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=60
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        reason = "; ".join(line.strip() for line in out.stderr.splitlines() if line.strip())
        raise RunFailed(f"slurm refused the worker job: {reason or f'exit {out.returncode}'}")


def start(req: SlurmRequest) -> tuple[Any, Any]:
    """Submit `req.jobs` jobs; return `(client, SLURMCluster)` once all their workers connected.
    `RunFailed` (jobs cancelled) when Slurm refuses them or they do not start in time."""
    from distributed import Client

    SLURMCluster = _jobqueue().SLURMCluster

    preflight(req)
    t0 = time.perf_counter()
    host = {"host": "127.0.0.1"} if req.spec.interface in ("lo", "lo0") else {}
    cluster = SLURMCluster(**req.options(), scheduler_options={"dashboard_address": ":0", **host})
    client = None
    try:
        cluster.scale(jobs=req.jobs)  # type: ignore[no-untyped-call]
        client = Client(cluster)  # type: ignore[no-untyped-call]
        _wait(cluster, client, req, t0)
    except BaseException:
        close(client, cluster)
        raise
    return client, cluster


def job_ids(cluster: Any) -> list[str]:
    return [str(j.job_id) for j in list(cluster.workers.values()) if getattr(j, "job_id", None)]


def _wait(cluster: Any, client: Any, req: SlurmRequest, t0: float) -> None:
    """Until every job's worker connected; `RunFailed` after `start_timeout_s`, or as soon as a
    job ended without one."""
    deadline = t0 + req.spec.start_timeout_s
    first = False
    seen: set[str] = set()
    while True:
        n = len(client.scheduler_info(n_workers=-1)["workers"])
        if n and not first:
            first = True
            log.info("slurm: first worker after %.1f s (%s)", time.perf_counter() - t0, _since())
        if n >= req.jobs:
            log.info("slurm: %d job(s) running: %s", n, ", ".join(job_ids(cluster)))
            return
        states = squeue(job_ids(cluster))
        seen |= set(states)
        gone = sorted(seen - set(states))
        if gone:
            raise RunFailed(
                f"slurm job(s) {', '.join(gone)} ended before their worker connected; "
                f"see {req.log_dir}/pipe-worker-<job id>.err"
            )
        if time.perf_counter() > deadline:
            waiting = ", ".join(f"job {j}: {s}" for j, s in sorted(states.items())) or "not queued"
            raise RunFailed(
                f"slurm: {n} of {req.jobs} worker(s) connected within start_timeout_s "
                f"{req.spec.start_timeout_s:g} s ({waiting}); cancelled the jobs"
            )
        time.sleep(0.5)


def _since() -> str:
    try:
        import psutil

        return f"{time.time() - psutil.Process().create_time():.1f} s after pipe started"
    except Exception:
        return "pipe's start unknown"


def squeue(ids: list[str]) -> dict[str, str]:
    """`{job id: "STATE (reason)"}` of those still in the queue."""
    if not ids:
        return {}
    cmd = ["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%r"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    states = {}
    for line in out.stdout.splitlines():
        job, state, reason = [*line.split("|"), "", ""][:3]
        states[job.strip()] = f"{state} ({reason})" if reason and reason != "None" else state
    return states


def release(cluster: Any, client: Any, keep: set[str], need_one: bool) -> list[str]:
    """Cancel the jobs whose worker is idle and not in `keep`; leave one when `need_one` and no
    other would remain. Returns the job ids cancelled.

    Workers released before count as gone even while their job is still closing (otherwise a
    second call sees two idle workers, keeps the closing one and cancels the last), and the
    scheduler retires a worker before its job is cancelled, so no task is handed to it."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    live = {a: w for a, w in info.items() if w.get("name") in cluster.worker_spec}
    busy = {a for a, keys in client.processing().items() if keys}
    idle = sorted(a for a in live if a not in keep and a not in busy)
    if need_one and len(idle) == len(live) and idle:
        idle = idle[1:]
    if not idle:
        return []
    client.retire_workers(workers=idle, close_workers=False)
    names = [live[a].get("name") for a in idle]
    ids = [str(cluster.workers[n].job_id) for n in names if n in cluster.workers]
    for name in names:
        cluster.worker_spec.pop(name, None)
    cluster.scale(jobs=len(cluster.worker_spec))  # closes the jobs no longer in the spec
    log.info("slurm: released job(s) %s (nothing left for them)", ", ".join(ids))
    return ids


def close(client: Any, cluster: Any, wait_s: float = 30.0) -> None:
    """Close the client and cancel every job (scancel), whatever state they are in; then wait,
    at most `wait_s`, until they have left the queue.

    A cancelled job stays in squeue as COMPLETING while Slurm kills its processes (SIGTERM,
    then SIGKILL after the cluster's KillWait, 30 s by default) and it still holds its cores
    and GPUs then; `pipe run` returns once they are free, so the next run (or the user's
    squeue) finds nothing of ours. Past the bound it says which are left and returns."""
    ids = job_ids(cluster)
    for thing in (client, cluster):
        if thing is not None:
            try:
                thing.close()
            except Exception as exc:  # the scheduler may already be gone
                log.debug("closing %s: %s", type(thing).__name__, exc)
    if not ids or not shutil.which("squeue"):
        return
    left = squeue(ids)
    if left:  # belt and braces: nothing of ours stays queued
        subprocess.run(["scancel", *left], capture_output=True, timeout=30, check=False)
    deadline = time.monotonic() + wait_s
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = squeue(list(left))
    if left:
        states = ", ".join(f"{job} {state}" for job, state in sorted(left.items()))
        log.warning(
            "slurm: job(s) still in the queue %.0f s after scancel (%s); Slurm ends them",
            wait_s,
            states,
        )
