"""The embedded cluster's workers fork from a server that preloaded distributed and the stage
API, with the driver's environment; a later cluster in the same process whose environment
changed spawns its workers instead (engine/cluster/worker_start.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, sys
from engine.cluster.connect import connect

def probe():
    return {"probe": os.environ.get("PIPE_PROBE"), "parent": os.getppid(),
            "preloaded": "engine.run.task" in sys.modules, "threads": os.environ.get("OMP_NUM_THREADS")}

out = []
for value in ("one", "one", "two"):
    os.environ["PIPE_PROBE"] = value
    cluster = connect("local", 1)
    try:
        (seen,) = cluster.client.run(probe).values()
        import dask
        seen["method"] = dask.config.get("distributed.worker.multiprocessing-method")
    finally:
        cluster.close()
    seen["driver"] = os.getpid()
    out.append(seen)
import dask
out.append(dask.config.get("distributed.worker.multiprocessing-method"))
print(json.dumps(out))
"""


def test_workers_fork_from_a_preloaded_server_until_the_environment_changes() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPE_WORKER_START", "OMP_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    first, again, changed, after = json.loads(proc.stdout.strip().splitlines()[-1])
    for forked in (first, again):
        assert forked["method"] == "forkserver"
        assert forked["probe"] == "one" and forked["threads"] == "1"
        assert forked["preloaded"]  # imported by the server before the fork
        assert forked["parent"] != forked["driver"]  # the server's child, not the driver's
    assert first["parent"] == again["parent"]  # the same server, kept for the process
    assert changed["method"] == "spawn"
    assert changed["probe"] == "two"
    assert not changed["preloaded"]
    assert changed["parent"] == changed["driver"]
    assert after == "spawn"  # Dask's default again once the cluster closed


def test_the_switch_asks_for_spawn_and_an_unknown_value_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.cluster import worker_start

    monkeypatch.setenv("PIPE_WORKER_START", "spawn")
    assert worker_start.start() == "spawn"
    monkeypatch.setenv("PIPE_WORKER_START", "fork")
    monkeypatch.setattr(sys, "platform", "darwin")  # spawn there: no server started here
    with caplog.at_level("WARNING", logger="pipe.cluster"):
        assert worker_start.start() == "spawn"
    assert "PIPE_WORKER_START=fork: expected spawn or forkserver" in caplog.text
