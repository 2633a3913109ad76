"""`scheduler: slurm` against a real one-node Slurm (`make install-slurm`: Debian's slurm-wlm,
munge, fake GPU gres gpu:2): workers are dask-jobqueue batch jobs, the GPU stage lands on a
job's worker with GPU=2 and the job's CUDA_VISIBLE_DEVICES, report.json names the jobs, and
nothing stays queued: after success, a failed stage, Ctrl-C or SIGTERM, or jobs Slurm will not
start."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import ENV, ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

TOYS = [sys.executable, str(ROOT / "tests" / "pipe_with_toys.py")]
SLURM = "slurm: {walltime: '00:10:00', memory: 1GB, interface: lo, start_timeout_s: 60}"


def _sinfo_ok() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="module", autouse=True)
def slurm() -> Iterator[None]:
    """A running Slurm: the one `make install-slurm` started, else started here (and stopped
    after, by PID); skipped with the reason when there is none."""
    if shutil.which("sinfo") is None:
        pytest.skip("no Slurm here (no 'sinfo'): run `make install-slurm`")
    started = False
    if not _sinfo_ok():
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "slurm.sh"), "start"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0 or not _sinfo_ok():
            pytest.skip(f"Slurm is installed but does not start: {out.stderr.strip()[-300:]}")
        started = True
    yield
    if started:
        subprocess.run(["bash", str(ROOT / "scripts" / "slurm.sh"), "stop"], timeout=120)


@pytest.fixture(autouse=True)
def idle_node() -> None:
    """Each test starts on an empty queue: a job an earlier test cancelled may still be
    completing (its worker being killed) and hold a core the next test's jobs need."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(0.5)
    pytest.fail(f"Slurm's queue did not empty in 90 s: {out.stdout.strip()[:300]}")


def queued() -> list[str]:
    """Our worker jobs still in squeue (pending, running or completing)."""
    out = subprocess.run(
        ["squeue", "-h", "-n", "pipe-worker", "-o", "%i %T"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.split("\n")[:-1]


def write(tmp_path: Path, stages: str, cluster: str = "gpus: 2, gpus_per_node: 2") -> None:
    head = f"name: p\ncluster: {{scheduler: slurm, {cluster}, {SLURM}}}\nstages:\n"
    body = textwrap.indent(textwrap.dedent(stages), "  ")
    (tmp_path / "p.yaml").write_text(head + body)


def pipe(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOYS, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def report(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "runs/p/report.json").read_text())


TWO_STAGES = """\
prep: {kind: toy, config: {value: a}}
gpu: {kind: toy, needs: [prep], resources: {gpus: 2}, config: {value: b, record_devices: true}}
"""


def test_plan_shows_the_job_script_and_submits_nothing(tmp_path: Path):
    write(tmp_path, TWO_STAGES)
    result = pipe(tmp_path, "plan", "p.yaml", "--format", "json")
    assert result.returncode == 0, result.stderr
    slurm = json.loads(result.stdout)["slurm"]
    assert (slurm["jobs"], slurm["gpus_per_job"]) == (1, 2)
    script = slurm["job_script"]
    assert "#SBATCH --gres=gpu:2\n" in script
    assert "#SBATCH -t 00:10:00\n" in script
    assert " --resources GPU=2 " in script
    assert queued() == []


def test_the_gpu_stage_runs_on_a_slurm_job_with_two_gpus_and_no_job_is_left(tmp_path: Path):
    write(tmp_path, TWO_STAGES)
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr
    assert queued() == []
    seen = json.loads((tmp_path / "runs/p/gpu/devices.json").read_text())
    assert seen["cuda_visible_devices"] == "0,1"  # the job's gres, as Slurm gave it
    stages = report(tmp_path)["stages"]
    job = stages["gpu"]["slurm_jobs"]
    assert len(job) == 1 and job[0].isdigit()
    assert stages["prep"]["slurm_jobs"] == job
    assert stages["gpu"]["placement"][0]["devices"] == [0, 1]
    assert stages["gpu"]["placement"][0]["node"].endswith(f":{job[0]}")
    assert "slurm: 1 job(s) of 2 GPU(s) each" in result.stderr
    assert f"slurm: 1 job(s) running: {job[0]}" in result.stderr


def test_a_failed_stage_names_its_job_and_leaves_nothing_queued(tmp_path: Path):
    write(
        tmp_path,
        """\
        prep: {kind: toy, config: {value: a}}
        gpu: {kind: toy, needs: [prep], resources: {gpus: 2}, config: {always_fail: true}}
        """,
    )
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 1, result.stderr
    assert queued() == []
    stages = report(tmp_path)["stages"]
    assert stages["gpu"]["status"] == "failed"
    assert stages["gpu"]["error"] == "RuntimeError: gpu always fails"
    assert stages["gpu"]["slurm_jobs"] == stages["prep"]["slurm_jobs"] != []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_or_sigterm_cancels_the_jobs(tmp_path: Path, sig: signal.Signals):
    pid_file = tmp_path / "pid"
    write(
        tmp_path,
        f"""\
        gpu: {{kind: toy, resources: {{gpus: 2}}, config: {{sleep_s: 120, pid_file: {pid_file}}}}}
        """,
    )
    proc = subprocess.Popen(
        [*TOYS, "run", "p.yaml"],
        cwd=tmp_path,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a runner that started us in the background of a non-interactive
        # shell hands SIGINT down ignored, and Python then installs no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert pid_file.exists(), "the stage never started"
        assert len(queued()) == 1
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert queued() == []
    assert "interrupted: cancelling 1 running stage(s)" in err
    assert report(tmp_path)["stages"]["gpu"]["status"] == "cancelled"


@pytest.mark.parametrize(
    ("cluster", "reason"),
    [
        (
            "gpus: 2, gpus_per_node: 2, slurm: {partition: nope, interface: lo}",
            "sbatch: error: invalid partition specified: nope; "
            "allocation failure: Invalid partition name specified",
        ),
        (
            "gpus: 4, gpus_per_node: 4, slurm: {interface: lo}",  # the node has gpu:2
            "allocation failure: Requested node configuration is not available",
        ),
    ],
)
def test_jobs_slurm_refuses_fail_the_run_at_once_with_its_reason(
    tmp_path: Path, cluster: str, reason: str
):
    text = f"""\
        name: p
        cluster: {{scheduler: slurm, {cluster}}}
        stages:
          gpu: {{kind: toy, resources: {{gpus: 2}}}}
        """
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    t0 = time.monotonic()
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - t0 < 60
    assert result.stderr.splitlines()[-1] == f"error: slurm refused the worker job: {reason}"
    assert queued() == []


def test_a_job_that_stays_pending_fails_after_the_timeout_with_squeues_reason(tmp_path: Path):
    # longer than the partition's MaxTime (1 day): Slurm queues it, and it never starts
    text = """\
        name: p
        cluster:
          scheduler: slurm
          gpus: 2
          gpus_per_node: 2
          slurm: {walltime: 2-00:00:00, interface: lo, start_timeout_s: 5}
        stages:
          gpu: {kind: toy, resources: {gpus: 2}}
        """
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    t0 = time.monotonic()
    result = pipe(tmp_path, "run", "p.yaml")
    elapsed = time.monotonic() - t0
    assert result.returncode == 1, result.stderr
    assert 5 < elapsed < 40
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        "error: slurm: 0 of 1 worker(s) connected within start_timeout_s 5 s (job "
    )
    assert last.endswith(": PENDING (PartitionTimeLimit)); cancelled the jobs")
    assert queued() == []


def test_jobs_nothing_needs_any_more_are_released_while_the_run_goes_on(tmp_path: Path):
    write(
        tmp_path,
        """\
        a: {kind: toy, resources: {gpus: 1}, config: {value: a}}
        b: {kind: toy, resources: {gpus: 1}, config: {value: b}}
        after: {kind: toy, needs: [a, b], config: {value: c, sleep_s: 6}}
        """,
        cluster="gpus: 2, gpus_per_node: 1",
    )
    proc = subprocess.Popen(
        [*TOYS, "run", "p.yaml"], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True
    )
    counts = []
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            counts.append(len([j for j in queued() if j.endswith(" RUNNING")]))
            time.sleep(0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "slurm: 2 job(s) of 1 GPU(s) each" in err
    assert 2 in counts and counts.index(2) < len(counts) - 1 - counts[::-1].index(1)
    stages = report(tmp_path)["stages"]
    jobs = {s: stages[s]["slurm_jobs"][0] for s in ("a", "b", "after")}
    assert jobs["a"] != jobs["b"] and jobs["after"] in (jobs["a"], jobs["b"])
    released = ({jobs["a"], jobs["b"]} - {jobs["after"]}).pop()
    assert f"slurm: released job(s) {released} (nothing left for them)" in err
    assert queued() == []
