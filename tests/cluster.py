"""A real Dask cluster on 127.0.0.1 for tests: `dask scheduler` and `dask worker` processes.

Each worker can stand in for a GPU node (`--resources GPU=n`, its own `PIPE_NODE` name and
`CUDA_VISIBLE_DEVICES` list), so placement runs for real without GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stages.lib.net import free_port

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SimWorker:
    """One `dask worker`: its GPU count, node name and device ids (None: not set)."""

    gpus: int = 0
    node: str | None = None
    devices: str | None = None
    nthreads: int = 1


def alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def dask_cluster(workers: Sequence[SimWorker], cwd: Path) -> Iterator[str]:
    """Start the scheduler and `workers`; yield the scheduler's address; stop them by PID."""
    port = free_port()
    dask = str(Path(sys.executable).parent / "dask")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
    procs = [subprocess.Popen(scheduler, env=ENV, **quiet)]  # type: ignore[call-overload]
    address = f"tcp://127.0.0.1:{port}"
    for i, w in enumerate(workers):
        env = dict(ENV)
        if w.node:
            env["PIPE_NODE"] = w.node
        if w.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = w.devices
        cmd = [dask, "worker", address, "--nthreads", str(w.nthreads), "--host", "127.0.0.1"]
        cmd += ["--name", f"w{i}", "--no-dashboard"]
        if w.gpus:
            cmd += ["--resources", f"GPU={w.gpus}"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, **quiet))  # type: ignore[call-overload]
    try:
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(len(workers), timeout=60)
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def pipe_run(
    cwd: Path, text: str, *args: str, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """`pipe run p.yaml ARGS` in `cwd` of the pipeline `text` (dedented), one torch thread."""
    import textwrap

    (cwd / "p.yaml").write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml", *args],
        cwd=cwd,
        env={**ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_rank(module: str, device: str, *args: str) -> dict[str, object]:
    """`python -m MODULE ARGS` as rank 0 of a one-rank job (DeepSpeed's CPU accelerator on
    the CPU); the JSON of the line it prints starting with `RESULT `."""
    import json

    env = {
        **ENV,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(lines[0].removeprefix("RESULT "))
    return result
