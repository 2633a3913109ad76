"""Process groups that fail instead of killing: the ranks' group is built with an explicit
timeout (DeepSpeed's and torch's defaults differ: 10 or 30 minutes), and the NCCL weight-sync
group with blocking waits and error handling that spares the process (the Dask worker)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

INIT = """\
import torch
from torch.distributed import distributed_c10d as c10d
from stages.lib.distributed.rank import init_distributed
init_distributed({trainer!r}, "cpu", 1 if {trainer!r} == "deepspeed" else 2)
pg = c10d._get_default_group()
print(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


@pytest.mark.parametrize("trainer", ["deepspeed", "torch"])
def test_rank_process_groups_get_explicit_timeout(trainer: str):
    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PIPE_COLLECTIVE_TIMEOUT_S": "77",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    if trainer == "torch":  # a torch job of one rank builds no group: two ranks here
        env["WORLD_SIZE"] = "2"
    script = textwrap.dedent(INIT.format(trainer=trainer))
    if trainer == "torch":
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script],
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    else:
        outs = [
            subprocess.run(
                [sys.executable, "-c", script],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout
        ]
    assert [float(o.strip().splitlines()[-1]) for o in outs] == [77.0] * len(outs)


def test_collective_timeout_default_is_half_an_hour(monkeypatch: pytest.MonkeyPatch):
    from stages.lib.distributed.rank import collective_timeout_s

    monkeypatch.delenv("PIPE_COLLECTIVE_TIMEOUT_S", raising=False)
    assert collective_timeout_s() == 1800.0


def test_nccl_sync_group_blocks_and_spares_the_process(monkeypatch: pytest.MonkeyPatch):
    """The settings the NCCL sync group is built under: blocking waits (a wait past the
    timeout raises SyncFailed in the step) and error handling 2 (abort the communicator,
    keep the process); a user's own setting stays. Built on CUDA only: the group itself is
    in the gpu-marked rl tests."""
    from stages.rl.sync import transports as sync

    assert sync.NCCL_ENV == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    }
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_nccl_available() or not torch.cuda.is_available():
        for key in sync.NCCL_ENV:
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        with pytest.raises(Exception):  # noqa: B017 - no NCCL here: the group fails to build
            sync._pg(None, 0, 1, 5.0, nccl=True)
        assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the user's, kept
