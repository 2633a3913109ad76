"""Execute on real Dask clusters: an external scheduler with GPU workers, the embedded
LocalCluster, caching, retries, failures, a killed worker, and unplaceable stages."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import SimWorker, alive, dask_cluster
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

PIPE = [sys.executable, str(ROOT / "tests" / "pipe_with_toys.py")]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def pipe(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PIPE, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def write(tmp_path: Path, text: str) -> str:
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    return "p.yaml"


def report(tmp_path: Path, name: str = "p") -> dict[str, Any]:
    return json.loads((tmp_path / "runs" / name / "report.json").read_text())


@pytest.fixture
def gpu_cluster(tmp_path: Path):
    """A real `dask scheduler` and two `dask worker --resources GPU=1` processes on 127.0.0.1."""
    with dask_cluster([SimWorker(gpus=1), SimWorker(gpus=1)], tmp_path) as address:
        yield address


def test_external_scheduler_places_gpu_stages_on_both_workers(tmp_path: Path, gpu_cluster: str):
    write(
        tmp_path,
        """\
        name: p
        cluster: {gpus: auto}
        stages:
          prep: {kind: toy, config: {value: prep}}
          left: {kind: toy, needs: [prep], resources: {gpus: 1}, config: {value: l, sleep_s: 1.5}}
          right: {kind: toy, needs: [prep], resources: {gpus: 1}, config: {value: r, sleep_s: 1.5}}
          join: {kind: toy, needs: [left, right], resources: {gpus: 1}, config: {value: j, sleep_s: 0.5}}
        """,
    )
    result = pipe(tmp_path, "run", "p.yaml", "--scheduler", gpu_cluster)
    assert result.returncode == 0, result.stderr
    assert "cluster.gpus: auto -> 2 (from the workers' resources)" in result.stderr
    stages = report(tmp_path)["stages"]
    assert {s["status"] for s in stages.values()} == {"succeeded"}
    assert len({s["worker"] for s in stages.values()}) == 2
    assert stages["left"]["worker"] != stages["right"]["worker"]
    gpu = [s for n, s in stages.items() if n != "prep"]
    for a in gpu:
        for b in gpu:
            if a is not b and a["worker"] == b["worker"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)
    # join's input defaults to the main output of the first stage it needs (left)
    assert (tmp_path / "runs" / "p" / "join" / "out.txt").read_text() == "prep\nl\nj\n"


CHAIN = """\
    name: p
    cluster: {workers: 2}
    stages:
      a: {kind: toy, config: {value: a}}
      b: {kind: toy, needs: [a], config: {value: b}}
      c: {kind: toy, needs: [a], config: {value: c}}
      d: {kind: toy, needs: [b], config: {value: d}}
"""


def _files(tmp_path: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for name in "abcd":
        path = tmp_path / "runs" / "p" / name / "out.txt"
        out[name] = (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def test_second_run_is_all_cache_hits_and_touches_nothing(tmp_path: Path):
    write(tmp_path, CHAIN)
    first = pipe(tmp_path, "run", "p.yaml")
    assert first.returncode == 0, first.stderr
    assert not (tmp_path / "runs" / "p" / ".pipe-date").exists()  # finished: date released
    before = _files(tmp_path)
    second = pipe(tmp_path, "run", "p.yaml")
    assert second.returncode == 0, second.stderr
    stages = report(tmp_path)["stages"]
    assert {n: (s["status"], s["cache_hit"]) for n, s in stages.items()} == {
        n: ("cached", True) for n in "abcd"
    }
    assert _files(tmp_path) == before
    assert "cluster:" not in second.stderr  # nothing to run: no cluster started
    third = pipe(tmp_path, "run", "p.yaml", "--set", "stages.b.config.value=B")
    assert third.returncode == 0, third.stderr
    stages = report(tmp_path)["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {
        "a": "cached",
        "b": "succeeded",
        "c": "cached",
        "d": "succeeded",
    }
    after = _files(tmp_path)
    assert after["a"] == before["a"] and after["c"] == before["c"]
    assert (tmp_path / "runs" / "p" / "d" / "out.txt").read_text() == "a\nB\nd\n"
    history = sorted((tmp_path / "runs" / "p" / "history").iterdir())
    assert len(history) == 3
    assert {p.name for p in history[-1].iterdir()} == {
        "plan.lock.yaml",
        "report.json",
        "driver.log",
    }


def test_a_checkpoint_rewritten_in_place_reruns_the_stage_that_reads_it(tmp_path: Path):
    """The folder's own mtime and size stay when a file in it is rewritten in place."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("config\n")
    (ckpt / "model.safetensors").write_text("old weights\n")
    write(tmp_path, "name: p\nstages:\n  ev: {kind: toy, config: {input: ckpt, value: e}}\n")
    first = pipe(tmp_path, "run", "p.yaml")
    assert first.returncode == 0, first.stderr
    folder = os.stat(ckpt).st_mtime_ns
    weights = ckpt / "model.safetensors"
    with open(weights, "r+") as f:
        f.write("new weights\n")  # same size
    later = os.stat(weights).st_mtime_ns + 1_000_000_000  # as a write a second later leaves it
    os.utime(weights, ns=(later, later))
    assert os.stat(ckpt).st_mtime_ns == folder
    second = pipe(tmp_path, "run", "p.yaml")
    assert second.returncode == 0, second.stderr
    assert report(tmp_path)["stages"]["ev"]["status"] == "succeeded"
    out = tmp_path / "runs" / "p" / "ev" / "out.txt"
    assert out.read_text() == "config\nnew weights\ne\n"
    third = pipe(tmp_path, "run", "p.yaml")
    assert third.returncode == 0, third.stderr
    assert report(tmp_path)["stages"]["ev"]["status"] == "cached"


def test_retries_failures_and_keep_going(tmp_path: Path):
    write(
        tmp_path,
        """\
        name: p
        cluster: {workers: 2}
        stages:
          flaky: {kind: toy, retries: 1, config: {value: f, fail_times: 1}}
          broken: {kind: toy, retries: 1, config: {always_fail: true}}
          after: {kind: toy, needs: [broken], config: {value: x}}
          later: {kind: toy, needs: [after], config: {value: y}}
          other: {kind: toy, needs: [flaky], config: {value: o, sleep_s: 0.5}}
        """,
    )
    result = pipe(tmp_path, "run", "p.yaml", "--keep-going")
    assert result.returncode == 1
    stages = report(tmp_path)["stages"]
    assert (stages["flaky"]["status"], stages["flaky"]["attempts"]) == ("succeeded", 2)
    assert (stages["broken"]["status"], stages["broken"]["attempts"]) == ("failed", 2)
    assert stages["broken"]["error"] == "RuntimeError: broken always fails"
    assert stages["after"]["status"] == "skipped"
    assert stages["after"]["error"] == "skipped: broken did not finish"
    assert stages["later"]["status"] == "skipped"
    assert stages["other"]["status"] == "succeeded"
    assert "broken: failed after 2 attempt(s): RuntimeError: broken always fails" in result.stderr
    assert "skipping after, later" in result.stderr
    # unfinished: the next run (a resume, maybe after midnight) renders this run's date
    kept = (tmp_path / "runs" / "p" / ".pipe-date").read_text()
    assert kept == f"{date.today().isoformat()}\n"
    assert "Traceback" not in result.stderr


def test_killed_worker_reschedules_the_stage(tmp_path: Path):
    proc, victim = _run_until_pid(
        tmp_path, 2, "long: {kind: toy, config: {value: done, sleep_s: 4, pid_file: PIDS}}"
    )
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    pids = (tmp_path / "pids.txt").read_text().split()
    assert len(pids) == 2 and pids[0] != pids[1]
    stages = report(tmp_path)["stages"]
    assert stages["long"]["status"] == "succeeded"
    assert (tmp_path / "runs" / "p" / "long" / "out.txt").read_text() == "done\n"


def test_sigterm_stops_the_run_as_ctrl_c_does(tmp_path: Path):
    proc, worker = _run_until_pid(
        tmp_path,
        1,
        "quick: {kind: toy, config: {value: a}}\n"
        "long: {kind: toy, needs: [quick], config: {sleep_s: 120, pid_file: PIDS}}",
    )
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # not the stage's 120 s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "SIGTERM: stopping the run as for Ctrl-C" in err
    assert "interrupted: cancelling 1 running stage(s)" in err
    stages = report(tmp_path)["stages"]
    assert (stages["quick"]["status"], stages["long"]["status"]) == ("succeeded", "cancelled")
    deadline = time.monotonic() + 30  # the worker that ran the stage went with the cluster
    while time.monotonic() < deadline and alive(worker):
        time.sleep(0.2)
    assert not alive(worker)


def _run_until_pid(tmp_path: Path, workers: int, stages: str) -> tuple[subprocess.Popen[str], int]:
    """`pipe run` of pipeline p with `workers` local workers and `stages` (PIDS: the file the
    toy stage writes its worker's PID to) started, and that PID once written."""
    pid_file = tmp_path / "pids.txt"
    body = textwrap.indent(stages.replace("PIDS", str(pid_file)), "  ")
    (tmp_path / "p.yaml").write_text(f"name: p\ncluster: {{workers: {workers}}}\nstages:\n{body}\n")
    proc = subprocess.Popen(
        [*PIPE, "run", "p.yaml"], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text().strip()):
        time.sleep(0.1)
    return proc, int(pid_file.read_text().split()[0])


def test_more_gpus_than_the_workers_offer_is_refused_at_start(tmp_path: Path):
    write(
        tmp_path,
        """\
        name: p
        cluster: {workers: 1, gpus: 4}
        resources: {ratio: {actor: 1}}
        stages:
          big: {kind: toy, resources: {gpus: 4}, config: {value: x}}
        """,
    )
    start = time.time()
    result = pipe(tmp_path, "run", "p.yaml", timeout=120)
    elapsed = time.time() - start
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "p.yaml:2:29: cluster.gpus: the pipeline asks for 4 GPUs (cluster.gpus); "
        "the workers offer 0 (1 worker(s), none with GPUs)"
    )
    assert not (tmp_path / "runs" / "p" / "big" / "out.txt").exists()
    assert elapsed < 60


def test_only_and_from_are_validated(tmp_path: Path):
    write(tmp_path, CHAIN)
    result = pipe(tmp_path, "run", "p.yaml", "--only", "bb")
    assert result.returncode == 2
    assert result.stderr.strip() == "--only bb: no stage named 'bb'; did you mean 'b'?"


def test_only_a_stage_whose_need_has_no_output_is_refused_before_anything_runs(tmp_path: Path):
    write(tmp_path, CHAIN)
    result = pipe(tmp_path, "run", "p.yaml", "--only", "d")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "--only: 'd' needs 'b', which has no complete output in runs/p: add --only b, or run "
        "without --only"
    ) in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs/p/d").exists()
    assert pipe(tmp_path, "run", "p.yaml", "--only", "a", "--only", "b").returncode == 0
    assert pipe(tmp_path, "run", "p.yaml", "--only", "d").returncode == 0  # b is complete now
    # b completed under other settings: used as it is, with a warning
    write(tmp_path, CHAIN.replace("value: b}", "value: b2}"))
    result = pipe(tmp_path, "run", "p.yaml", "--only", "d", "--force")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "d: needs b, whose output in runs/p is out of date" in result.stderr


def test_workers_of_the_embedded_cluster_hold_no_tracker_credentials(tmp_path: Path):
    """The driver alone writes to trackers: its W&B and MLflow credentials are not in a
    worker's environment; the other variables a stage may need are."""
    write(
        tmp_path,
        """\
        name: p
        stages:
          probe: {kind: toy, config: {env_probe: [WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, OPENAI_API_KEY]}}
        """,
    )
    secrets = {"WANDB_API_KEY": "w" * 40, "MLFLOW_TRACKING_TOKEN": "t", "OPENAI_API_KEY": "o"}
    result = subprocess.run(
        [*PIPE, "run", "p.yaml"],
        cwd=tmp_path,
        env={**ENV, **secrets},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    seen = report(tmp_path)["stages"]["probe"]["metrics"]["env"]
    assert seen == {"WANDB_API_KEY": False, "MLFLOW_TRACKING_TOKEN": False, "OPENAI_API_KEY": True}
