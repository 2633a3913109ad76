"""How the embedded cluster's worker processes start: forked from a fork server.

A worker spawned fresh (Dask's default) starts only once the driver has imported
`distributed` and started the scheduler, then imports `distributed` and the stage API
itself: two imports of about 0.3 s each, one after the other (BENCHMARKS.md, start-up).
Here the driver starts Python's fork server first, preloading `distributed`, the stage API
(`engine.run.task`) and `engine.cluster.worker_setup`, and imports `distributed` while the server
does: the two run side by side, and each worker is then forked from the server, already
importing nothing. The server is a fresh interpreter with no threads (`fork` from the
driver itself would copy the locks of its event-loop threads), started with the driver's
environment, working directory and `sys.path`; Dask's own restarts of a worker go through
it too. The kind's body is still imported by the task that runs it, in the worker.
Variables a process reads only as it starts (`MALLOC_TRIM_THRESHOLD_`, `PYTHONHASHSEED`)
are set, to the values Dask's Nanny sets for a spawned worker, before the server starts.

Spawn instead (Dask's default, the same as before): off Linux; with `PIPE_WORKER_START=spawn`;
when the process already had a fork server that `pipe` did not start; and for a later
embedded cluster in the same process (tests, notebooks) once the environment, working
directory or `sys.path` differ from those the server started with (its workers would start
from the stale ones).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from typing import Any

from engine.cluster import worker_setup

log = logging.getLogger("pipe.cluster")

# what the server imports before it forks a worker
PRELOADED = (
    "__main__",
    "distributed",
    "distributed.nanny",
    "engine.run.task",
    worker_setup.PRELOAD,
)
CONFIG_KEY = "distributed.worker.multiprocessing-method"

# what Dask's Nanny sets in its own environment before it spawns a worker (its default
# `distributed.nanny.pre-spawn-environ`, and the hash seed it fixes so that workers hash
# alike): read when a process starts, so the server must have them from its start
PRE_SPAWN = {"MALLOC_TRIM_THRESHOLD_": "65536", "PYTHONHASHSEED": "6640"}
IGNORED = ("__DASK_PARENT_PID",)  # bookkeeping of Dask's process titles

_started: tuple[Any, ...] | None = None  # what the server we started was started with


def _state() -> tuple[Any, ...]:
    env = {k: v for k, v in os.environ.items() if k not in IGNORED}
    return (env, os.getcwd(), tuple(sys.path))


def start() -> str:
    """The start method for the workers of an embedded cluster about to start, `forkserver`
    or `spawn`; for `forkserver`, the server is started now (call this before importing
    `distributed`) and Dask is told to use it as it is."""
    global _started
    asked = os.environ.get("PIPE_WORKER_START", "").strip().lower()
    if asked not in ("", "spawn", "forkserver"):
        log.warning("PIPE_WORKER_START=%s: expected spawn or forkserver; ignored", asked)
    if sys.platform != "linux" or asked == "spawn":
        return "spawn"
    server: Any = getattr(forkserver, "_forkserver", None)
    if _started is None:
        if server is None or getattr(server, "_forkserver_pid", None) is not None:
            return "spawn"  # someone else's server (or a Python without this layout)
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", PRE_SPAWN["MALLOC_TRIM_THRESHOLD_"])
        if os.environ.get("PYTHONHASHSEED") in (None, "0"):  # as the Nanny does
            os.environ["PYTHONHASHSEED"] = PRE_SPAWN["PYTHONHASHSEED"]
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
        forkserver.ensure_running()  # returns at once; the server imports on its own core
        _started = _state()
    elif _started != _state():
        log.debug("workers spawned: the environment changed since the fork server started")
        return "spawn"
    return "forkserver"


def configure(method: str) -> Any:
    """Tell Dask how to start workers (until the returned object's `__exit__`). With
    `forkserver`, Dask would otherwise import numpy, pandas and lz4 here to preload them in
    a server of its own; ours already runs with what a worker needs."""
    import dask

    if method == "forkserver":
        import distributed.utils

        if hasattr(distributed.utils, "_forkserver_preload_set"):
            distributed.utils._forkserver_preload_set = True
        else:  # a Dask that preloads differently: leave its defaults alone
            method = "spawn"
    return dask.config.set({CONFIG_KEY: method})
