"""`engine.cluster.slurm.close` against Slurm's commands (squeue, scancel) stood in for by shell
scripts on PATH: a cancelled job lingers as COMPLETING while Slurm kills its processes, and
`pipe run` returns only once it has left the queue, or says which are left after its bound."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.cluster.slurm import close


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, completing_calls: int) -> Path:
    """squeue lists job 50 as COMPLETING for its first `completing_calls` calls, then nothing
    (as Slurm 22.05 does for a purged job: rc 1, nothing on stdout); scancel logs its args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{tmp_path}/calls" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "{tmp_path}/calls"\n'
        f'if [ "$n" -le {completing_calls} ]; then echo "50|COMPLETING|None"; exit 0; fi\n'
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n'
    )
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scancel"\n')
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def cluster_with_job(job_id: str) -> SimpleNamespace:
    """What close reads of a SLURMCluster: its jobs' ids; its close (dask-jobqueue's scancel)
    has already run."""
    return SimpleNamespace(workers={"w0": SimpleNamespace(job_id=job_id)}, close=lambda: None)


def test_close_waits_until_a_completing_job_has_left_the_queue(tmp_path, monkeypatch, caplog):
    d = fake_slurm(tmp_path, monkeypatch, completing_calls=3)
    with caplog.at_level(logging.WARNING, logger="pipe.slurm"):
        close(None, cluster_with_job("50"), wait_s=20)
    assert int((d / "calls").read_text()) == 4  # three times COMPLETING, then gone
    assert (d / "scancel").read_text().split() == ["50"]
    assert not [r for r in caplog.records if "still in the queue" in r.getMessage()]


def test_close_gives_up_after_its_bound_and_names_what_is_left(tmp_path, monkeypatch, caplog):
    fake_slurm(tmp_path, monkeypatch, completing_calls=10_000)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipe.slurm"):
        close(None, cluster_with_job("50"), wait_s=1.5)
    assert time.monotonic() - t0 < 10
    (warning,) = [r.getMessage() for r in caplog.records if "still in the queue" in r.getMessage()]
    assert "50 COMPLETING" in warning
