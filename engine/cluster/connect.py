"""Where stages run: an embedded `LocalCluster`, Slurm batch jobs, or an existing Dask scheduler.

`connect(address, workers)` returns a `Cluster` holding a `distributed.Client`
(and the `LocalCluster` or `SLURMCluster` it started, if any; `slurm` starts the
jobs of a `engine.cluster.slurm.SlurmRequest`). The address comes from, in order,
`--scheduler`, `DASK_SCHEDULER_ADDRESS`, then the pipeline's `cluster.scheduler`
(`local` starts a cluster sized by `cluster.workers`, or smaller when the stages
to run use fewer and no GPU is visible, one thread and one torch thread per worker
process, GPUs declared as a worker resource when CUDA is visible). `tls://` addresses
use Dask's security settings from its config.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.cluster.worker_setup import PRELOAD
from engine.plan.topology import ClusterView, Worker

if TYPE_CHECKING:
    from engine.cluster.slurm import SlurmRequest

log = logging.getLogger("pipe.cluster")

THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class Cluster:
    """A connected Dask client and, for the embedded default, the cluster it owns."""

    client: Any
    local: Any = None
    slurm: Any = None  # the dask_jobqueue.SLURMCluster whose jobs run the workers
    serves_dashboard: bool = True  # the embedded cluster: only when asked (`connect`)
    start_method: Any = None  # the embedded cluster: Dask's worker start method, reset at close

    @property
    def dashboard(self) -> str | None:
        link = getattr(self.client, "dashboard_link", None)
        mine = (self.local is not None and self.serves_dashboard) or self.slurm is not None
        return str(link) if link and mine and _has_bokeh() else None

    def workers(self) -> dict[str, dict[str, float]]:
        """Each worker's address and declared resources."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {addr: dict(w.get("resources") or {}) for addr, w in info.items()}

    def worker_info(self) -> dict[str, dict[str, Any]]:
        """Each worker's host, resources and what placement and the memory check read there
        (`PIPE_NODE`, `CUDA_VISIBLE_DEVICES`, GPU and host memory): what
        `engine.plan.placement.view_from_workers` takes."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        env = self.client.run(_placement_env)
        return {
            addr: {
                "host": w.get("host"),
                "resources": dict(w.get("resources") or {}),
                "env": env.get(addr, {}),
            }
            for addr, w in info.items()
        }

    def jobs(self) -> dict[str, str]:
        """Each worker's Slurm job id (`SLURM_JOB_ID` in its environment), for the records."""
        if self.slurm is None:
            return {}
        env = self.client.run(_job_id)
        return {addr: str(job) for addr, job in env.items() if job}

    def release(self, keep: set[str], need_one: bool) -> list[str]:
        """Give back the Slurm jobs of idle workers not in `keep` (keeping one when `need_one`);
        nothing to do on other clusters."""
        if self.slurm is None:
            return []
        from engine.cluster.slurm import release

        return release(self.slurm, self.client, keep, need_one)

    def close(self) -> None:
        if self.slurm is not None:
            from engine.cluster.slurm import close

            close(self.client, self.slurm)
            return
        self.client.close()
        if self.local is not None:
            self.local.close()
        if self.start_method is not None:
            self.start_method.__exit__(None, None, None)
            self.start_method = None


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID")


def _placement_env() -> dict[str, str | None]:
    """What placement and the memory check read of a worker: its node name, its devices,
    the memory of the smallest GPU of its host (nvidia-smi, which numbers GPUs in PCI order
    while CUDA_VISIBLE_DEVICES may follow CUDA's: the host's smallest is the safe figure;
    none without one), and its host's memory (psutil's total; None if unreadable)."""
    env: dict[str, str | None] = {
        k: os.environ.get(k) for k in ("PIPE_NODE", "CUDA_VISIBLE_DEVICES")
    }
    env["HOST_MEMORY_BYTES"] = _host_memory()
    env["GPU_MEMORY_MIB"] = None
    if shutil.which("nvidia-smi") is not None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            sizes = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
            env["GPU_MEMORY_MIB"] = str(min(sizes)) if sizes else None
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def _host_memory() -> str | None:
    try:
        import psutil  # a dependency of distributed

        return str(int(psutil.virtual_memory().total))
    except (ImportError, OSError):
        return None


def _set_devices(devices: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = devices


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None  # found, not imported: ~0.3 s


def visible_gpus() -> int:
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES, else nvidia-smi), without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        proc = "/proc/driver/nvidia/gpus"  # the driver's own list, where its tool is missing
        return len(os.listdir(proc)) if os.path.isdir(proc) else 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def local_gpus(gpus_per_node: int) -> tuple[int, str, ClusterView | None]:
    """`cluster.gpus: auto` for the embedded cluster, before it starts: the GPUs `connect`
    will give its workers (`visible_gpus`), where that figure came from, and the machine as
    one node holding them (None without GPUs)."""
    gpus = visible_gpus()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = (
        "CUDA_VISIBLE_DEVICES"
        if env is not None
        else "nvidia-smi -L"
        if shutil.which("nvidia-smi")
        else "/proc/driver/nvidia/gpus, no nvidia-smi"
    )
    if not gpus:
        return 0, f"no GPU visible on this machine, by {why}", None
    names = [d.strip() for d in (env or "").split(",") if d.strip() and d.strip() != "-1"]
    ids = tuple(int(d) for d in names) if all(d.isdigit() for d in names) and names else ()
    worker = Worker(None, "local", ids or tuple(range(gpus)))
    return gpus, f"visible on this machine, by {why}", ClusterView((worker,), gpus_per_node)


def scheduler_address(cli: str | None, pipeline: str) -> str:
    return cli or os.environ.get("DASK_SCHEDULER_ADDRESS") or pipeline


def connect(
    address: str,
    workers: int,
    timeout_s: float = 60.0,
    slurm: SlurmRequest | None = None,
    wanted: int | None = None,
    dashboard: bool = False,
) -> Cluster:
    """Start the embedded cluster (`local`), submit the Slurm jobs of `slurm` (`slurm`), or
    connect to the scheduler at `address`. The embedded cluster starts `workers` worker
    processes, or `wanted` when fewer and no GPU is visible (a GPU machine splits its GPUs
    over the `workers` declared), and serves Dask's dashboard only with `dashboard` (bokeh
    installed, importing it cost the driver about 1 s and 1 CPU-s of every start)."""
    method = ""
    if address == "local":
        from engine.cluster import worker_start

        os.environ.update({k: os.environ.get(k, v) for k, v in THREAD_ENV.items()})
        method = worker_start.start()  # before distributed's import: the two run side by side
    from distributed import Client

    if address == "slurm":
        from engine.cluster.slurm import start

        if slurm is None:
            raise ValueError(
                "scheduler 'slurm' needs the jobs to submit (engine.cluster.slurm.request)"
            )
        client, jobs = start(slurm)
        return Cluster(client, slurm=jobs)

    if address == "local":
        from distributed import LocalCluster

        start_method = worker_start.configure(method)  # kept while the cluster runs (restarts)
        gpus = visible_gpus()
        if wanted is not None and not gpus:
            workers = max(1, min(workers, wanted))
        resources = (
            {"GPU": gpus // workers}
            if gpus and gpus >= workers
            else ({"GPU": gpus} if gpus else None)
        )
        try:
            local = LocalCluster(  # type: ignore[no-untyped-call]
                n_workers=workers if not (gpus and gpus < workers) else 1,
                threads_per_worker=max(1, int(resources["GPU"])) if resources else 1,
                processes=True,
                dashboard_address=":0",  # the HTTP server on a free port (8787 clashes)
                scheduler_kwargs={"dashboard": dashboard and _has_bokeh()},  # its bokeh pages
                resources=resources,
                silence_logs=logging.WARNING,
                preload=[
                    PRELOAD
                ],  # no tracker credentials on workers (engine.cluster.worker_setup)
            )
        except BaseException:
            start_method.__exit__(None, None, None)
            raise
        client = Client(local)  # type: ignore[no-untyped-call]
        if gpus:
            # each worker sees only its own GPUs (set before anything in it touches CUDA), so the
            # placement's device ids are distinct across workers
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            names = (
                [d.strip() for d in visible.split(",")]
                if visible
                else [str(i) for i in range(gpus)]
            )
            addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
            share = gpus // len(addresses)
            for i, addr in enumerate(addresses):
                mine = ",".join(names[i * share : (i + 1) * share])
                client.run(_set_devices, mine, workers=[addr])
        return Cluster(client, local, serves_dashboard=dashboard, start_method=start_method)
    from distributed.security import Security

    security = Security() if address.startswith("tls://") else None  # type: ignore[no-untyped-call]
    client = Client(address, security=security, timeout=timeout_s)  # type: ignore[no-untyped-call]
    client.wait_for_workers(1, timeout=timeout_s)
    return Cluster(client)
