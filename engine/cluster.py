"""Where stages run: an embedded `LocalCluster`, or an existing Dask scheduler.

`connect(address, workers)` returns a `Cluster` holding a `distributed.Client`
(and the `LocalCluster` it started, if any). The address comes from, in order,
`--scheduler`, `DASK_SCHEDULER_ADDRESS`, then the pipeline's `cluster.scheduler`
(`local` starts a cluster sized by `cluster.workers`, one thread and one torch
thread per worker process, GPUs declared as a worker resource when CUDA is
visible). `tls://` addresses use Dask's security settings from its config.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

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

    @property
    def dashboard(self) -> str | None:
        link = getattr(self.client, "dashboard_link", None)
        return str(link) if link and self.local is not None and _has_bokeh() else None

    def workers(self) -> dict[str, dict[str, float]]:
        """Each worker's address and declared resources."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {addr: dict(w.get("resources") or {}) for addr, w in info.items()}

    def worker_info(self) -> dict[str, dict[str, Any]]:
        """Each worker's host, resources and the environment placement reads (`PIPE_NODE`,
        `CUDA_VISIBLE_DEVICES`): what `engine.placement.view_from_workers` takes."""
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

    def close(self) -> None:
        self.client.close()
        if self.local is not None:
            self.local.close()


def _placement_env() -> dict[str, str | None]:
    """What placement and the memory check read of a worker: its node name, its devices,
    and the memory of its smallest GPU (nvidia-smi; none without one)."""
    env: dict[str, str | None] = {
        k: os.environ.get(k) for k in ("PIPE_NODE", "CUDA_VISIBLE_DEVICES")
    }
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


def _set_devices(devices: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = devices


def _has_bokeh() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def visible_gpus() -> int:
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES, else nvidia-smi), without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def scheduler_address(cli: str | None, pipeline: str) -> str:
    return cli or os.environ.get("DASK_SCHEDULER_ADDRESS") or pipeline


def connect(address: str, workers: int, timeout_s: float = 60.0) -> Cluster:
    """Start the embedded cluster (`local`) or connect to the scheduler at `address`."""
    from distributed import Client

    if address == "local":
        from distributed import LocalCluster

        os.environ.update({k: os.environ.get(k, v) for k, v in THREAD_ENV.items()})
        gpus = visible_gpus()
        resources = (
            {"GPU": gpus // workers}
            if gpus and gpus >= workers
            else ({"GPU": gpus} if gpus else None)
        )
        local = LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=workers if not (gpus and gpus < workers) else 1,
            threads_per_worker=max(1, int(resources["GPU"])) if resources else 1,
            processes=True,
            dashboard_address=":0",  # a free port (the default 8787 clashes between runs)
            resources=resources,
            silence_logs=logging.WARNING,
        )
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
        return Cluster(client, local)
    from distributed.security import Security

    security = Security() if address.startswith("tls://") else None  # type: ignore[no-untyped-call]
    client = Client(address, security=security, timeout=timeout_s)  # type: ignore[no-untyped-call]
    client.wait_for_workers(1, timeout=timeout_s)
    return Cluster(client)
