"""Where the trackers write by default: MLflow into a SQLite file in the run folder (the
store MLflow 3 keeps; its file store is deprecated), W&B into `WANDB_DIR` when it is set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from engine.load.tracking_block import MlflowSpec, WandbSpec
from engine.run.tracking.base import RunInfo, StageInfo

RUN = RunInfo("run-1", "p", "", {"stages.a.config.size": "10"}, {})
STAGE = StageInfo("a", "dataset", "key-a", {"size": "10"}, {})


def _feed(tracker: object, artifact: Path) -> None:
    tracker.start(RUN)  # type: ignore[attr-defined]
    tracker.opened(STAGE)  # type: ignore[attr-defined]
    tracker.metrics("a", 1, {"loss": 0.5}, 0.0)  # type: ignore[attr-defined]
    tracker.artifact("a", str(artifact))  # type: ignore[attr-defined]
    tracker.closed("a", "succeeded", {"rows": 3.0})  # type: ignore[attr-defined]
    tracker.finish("succeeded")  # type: ignore[attr-defined]


def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No store from the environment; what `start` sets is undone after the test."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def test_mlflow_defaults_to_sqlite_in_the_run_folder_not_the_deprecated_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's SQL store: the tracking extra brings it
    from mlflow.tracking import MlflowClient

    from engine.run.tracking.mlflow import MlflowTracker

    _quiet_env(monkeypatch)
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    report = tmp_path / "report.json"
    report.write_text("{}\n")
    tracker = MlflowTracker(MlflowSpec(), str(run_dir), "p")
    assert tracker.uri == f"sqlite:///{run_dir}/mlflow.db"
    _feed(tracker, report)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    assert list(cwd.iterdir()) == []  # no ./mlruns from MLflow's default artifact root
    assert sorted(p.name for p in run_dir.iterdir()) == ["mlartifacts", "mlflow.db"]
    assert tracker.link() == (
        f"mlflow ui --backend-store-uri sqlite:///{run_dir}/mlflow.db "
        f"(experiment 'p', run {tracker.parent})"
    )
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    child = client.get_run(tracker.children["a"])
    assert child.data.metrics == {"loss": 0.5, "result.rows": 3.0}
    assert child.data.tags["mlflow.parentRunId"] == tracker.parent
    assert [f.path for f in client.list_artifacts(child.info.run_id)] == ["report.json"]
    assert child.info.artifact_uri.startswith(f"file://{run_dir}/mlartifacts/")


def test_the_sqlite_store_without_sqlalchemy_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from engine.run.tracking.mlflow import MlflowTracker

    _quiet_env(monkeypatch)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # find_spec: not installed
    tracker = MlflowTracker(MlflowSpec(), str(tmp_path / "run"), "p")
    with pytest.raises(RuntimeError) as err:
        tracker.start(RUN)
    assert str(err.value) == (
        f"sqlite:///{tmp_path}/run/mlflow.db needs sqlalchemy and alembic: "
        "pip install 'pipe-engine[tracking]'"
    )


def test_wandb_writes_under_wandb_dir_when_set_not_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("wandb")
    from engine.run.tracking.wandb import WandbTracker

    run_dir, mine = tmp_path / "run", tmp_path / "mine"
    run_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(mine))
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = WandbTracker(WandbSpec(), str(run_dir), "p")
    report = tmp_path / "report.json"
    report.write_text("{}\n")
    _feed(tracker, report)
    assert list(run_dir.iterdir()) == []
    assert len(list(mine.glob("wandb/offline-run-*/run-*.wandb"))) == 2  # pipeline, stage a
    assert tracker.link() == (
        f"{mine}/wandb (offline runs of group run-1; upload: wandb sync {mine}/wandb/offline-run-*)"
    )
    named = WandbTracker(WandbSpec(dir=str(tmp_path / "named")), str(run_dir), "p")
    assert named.dir == str(tmp_path / "named")  # the pipeline's own `dir` still wins
