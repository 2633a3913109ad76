"""Experiment tracking through `pipe run`, read back with each tracker's own reader.

The quickstart shrunk as in test_quickstart, with TensorBoard, MLflow (its default store, a
SQLite file in the run folder) and W&B (offline) all set: TensorBoard's `EventAccumulator`
reads the train loss series the stage wrote to `loss.jsonl`; `MlflowClient` finds one parent run, a child per stage, the
plan's parameters with their provenance and evaluate's accuracy; W&B's offline run files
hold the same loss history. Run again, every stage is cached: the children say so and
log nothing. No secret from the environment lands in any file. A tracker whose server is
down costs one warning, never the run.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.integration.test_quickstart import SHRINK

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECRETS = {"WANDB_API_KEY": "secret-xyz-wandb", "MLFLOW_TRACKING_PASSWORD": "secret-xyz-mlflow"}


def _pipe(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **SECRETS}
    env.pop("WANDB_DIR", None)  # W&B's files in the run folder
    cmd = [sys.executable, "-m", "engine.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (`run-*.wandb`): W&B's header, then LevelDB's log
    format (32 KiB blocks of checksum, length, type, data) around W&B's protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
        elif kind == 0:
            buf = b""
    return out


def wandb_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        records = wandb_records(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        history = [
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        runs.append({"name": run.display_name, "group": run.run_group, "history": history})
    return runs


def _mlflow(run_dir: Path, experiment: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    return list(client.search_runs([exp.experiment_id], max_results=1000))


def _family(runs: list[Any], run_id: str) -> tuple[Any, dict[str, Any]]:
    parent = next(r for r in runs if r.info.run_name == run_id)
    assert "mlflow.parentRunId" not in parent.data.tags
    children = {
        r.info.run_name: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    return parent, children


def test_quickstart_with_every_tracker(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, tb = tmp_path / "run", tmp_path / "tb"
    args = ["run", "pipelines/quickstart.yaml", "--run-dir", str(run_dir)]
    for item in [
        *SHRINK,
        f"tracking.tensorboard.dir={tb}",
        "tracking.mlflow.experiment=tracked",
        "tracking.wandb.mode=offline",
    ]:
        args += ["--set", item]
    proc = _pipe(args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    run_id, stages = report["run_id"], list(report["stages"])
    assert "dashboard: http://" in proc.stderr  # a tracker is set: Dask's dashboard is served

    # the result where the user looks: headlines on stdout, evaluate's table, the links
    out = proc.stdout.splitlines()
    table = out.index("evaluate:")
    assert out[table + 1].split() == [
        "checkpoint",
        "n",
        "accuracy",
        "pass@1",
        "mean_reward",
        "delta",
    ]
    assert [line.split()[0] for line in out[table + 2 : table + 4]] == ["warmup", "rft"]
    assert out[table + 2].endswith("baseline") and out[table + 3].endswith(" pts")
    assert out[len(stages)].startswith("data: 96 train, 24 test, 8 val rows")
    assert any(line.startswith("warmup: final loss ") for line in out)
    links = report["tracking"]
    # what each stage used first (every stage wrote its usage.jsonl); the links last
    assert [line.split(" used: ")[0] for line in out[: len(stages)]] == stages
    assert out[table + 4 : -len(links)] == []
    assert all((run_dir / s / "usage.jsonl").read_text().count('"cpu_util"') >= 1 for s in stages)
    assert all(report["stages"][s]["metrics"]["usage"]["rss_gb_peak"] > 0 for s in stages)
    assert out[-len(links) :] == [f"{k}: {v}" for k, v in links.items()]
    assert links["tensorboard"] == f"tensorboard --logdir {tb}"
    assert links["mlflow"].startswith(
        f"mlflow ui --backend-store-uri sqlite:///{run_dir}/mlflow.db (experiment 'tracked', run "
    )
    assert links["wandb"].startswith(f"{run_dir}/wandb (offline runs of group {run_id}; ")

    # TensorBoard: the train loss series, as the stage wrote it
    losses = [json.loads(x) for x in (run_dir / "warmup" / "loss.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tb / run_id / "warmup"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in losses
    ]
    assert "loss.png" in acc.Tags()["images"]
    assert "usage/cpu_util" in acc.Tags()["scalars"]  # the usage samples, beside the loss
    assert sorted(p.name for p in (tb / run_id).iterdir() if p.is_dir()) == sorted(stages)

    # MLflow: one parent, a child per stage, the plan as parameters, evaluate's accuracy
    parent, children = _family(_mlflow(run_dir, "tracked"), run_id)
    assert sorted(children) == sorted(stages)
    assert parent.data.params["stages.warmup.config.learning_rate"] == "0.003"
    assert parent.data.tags["source.stages.warmup.config.learning_rate"].startswith(
        "pipelines/quickstart.yaml:"
    )
    for name, child in children.items():
        assert child.data.tags["pipe.status"] == "succeeded"
        assert child.data.tags["pipe.cache_key"] == report["stages"][name]["key"]
    evaluation = json.loads((run_dir / "evaluate" / "report.json").read_text())
    for result in evaluation["results"]:
        name = result["checkpoint"]
        assert children["evaluate"].data.metrics[f"accuracy/{name}"] == result["accuracy"]
    assert children["warmup"].data.metrics["loss"] == pytest.approx(losses[-1]["loss"])

    # W&B (offline): a run per stage and one for the pipeline, grouped under the run id
    wb = wandb_runs(run_dir)
    assert sorted(r["name"] for r in wb) == sorted([run_id, *stages])
    assert {r["group"] for r in wb} == {run_id}
    warmup = next(r for r in wb if r["name"] == "warmup")
    assert [h["loss"] for h in warmup["history"] if "loss" in h] == [r["loss"] for r in losses]

    # every stage cached: recorded as such, nothing logged again
    again = _pipe(args, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    second = json.loads((run_dir / "report.json").read_text())
    assert {s["status"] for s in second["stages"].values()} == {"cached"}
    assert "evaluate (cached):" in again.stdout.splitlines()
    _, cached = _family(_mlflow(run_dir, "tracked"), second["run_id"])
    assert {n: (c.data.tags["pipe.status"], c.data.metrics) for n, c in cached.items()} == {
        n: ("cached", {}) for n in stages
    }
    acc = EventAccumulator(str(tb / second["run_id"] / "warmup"))
    acc.Reload()
    assert acc.Tags()["scalars"] == []
    rerun = [r for r in wandb_runs(run_dir) if r["group"] == second["run_id"]]
    assert len(rerun) == len(stages) + 1
    assert all(r["history"] == [] for r in rerun)

    # no secret from the environment in any record, tracker store or log
    for text in (proc.stdout, proc.stderr, again.stdout, again.stderr):
        assert not any(s in text for s in SECRETS.values())
    leaked = [
        str(p)
        for p in tmp_path.rglob("*")
        if p.is_file() and any(s.encode() in p.read_bytes() for s in SECRETS.values())
    ]
    assert leaked == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_tracker_that_cannot_be_reached_warns_once_and_the_run_succeeds(tmp_path: Path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        "name: tiny\n"
        "cluster: {workers: 1}\n"
        "stages:\n"
        "  data:\n"
        "    kind: dataset\n"
        "    config: {source: reasoning_gym, task: chain_sum, size: 10, test_size: 2}\n"
    )
    run_dir = tmp_path / "run"
    uri = f"http://127.0.0.1:{_closed_port()}"
    args = ["run", str(pipeline), "--run-dir", str(run_dir)]
    proc = _pipe([*args, "--set", f"tracking.mlflow.tracking_uri={uri}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("tracking: mlflow failed")]
    assert len(warnings) == 1, proc.stderr
    assert "the run goes on without it" in warnings[0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "succeeded" and report["tracking"] == {}
    used, headline = proc.stdout.splitlines()
    assert headline == "data: 10 train, 2 test rows" and used.startswith("data used: cpu ")
