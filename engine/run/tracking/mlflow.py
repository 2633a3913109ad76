"""MLflow: one parent run per `pipe run`, a nested run per stage, through `MlflowClient`.

Input: the tracking writer's calls. Output: in the experiment (default: the pipeline's
name) a parent run named after the run id holding the resolved plan as parameters
(dotted keys; each value's provenance as a `source.<key>` tag), and one child per stage
(`mlflow.parentRunId`): its config as parameters, `pipe.kind`, `pipe.cache_key` and
`pipe.status` tags, every metric at its step, the stage's result as `result.<key>`
metrics, its PNGs and reports as artifacts. A stage not run again (cached) is a child
tagged with its status and nothing else.

The client's HTTP retries are off and its timeout short unless the environment sets
them (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`, `MLFLOW_HTTP_REQUEST_TIMEOUT`): a server that
is down fails the first call quickly, and the writer then leaves MLflow alone.

The default store is a SQLite file in the run folder, `sqlite:///<run dir>/mlflow.db`
(MLflow 3 deprecates its file store; the SQL store needs sqlalchemy and alembic, in the
tracking extra). An experiment this writer makes in any SQLite store keeps its artifacts
in `<run dir>/mlartifacts` (MLflow's own default would be `./mlruns` in the working
directory). A `file:` URI or bare path the user names still gets the file store, which
MLflow 3 opens only with `MLFLOW_ALLOW_FILE_STORE`: set here unless the environment says
otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from engine.load.tracking_block import MlflowSpec
from engine.run.tracking.base import RunInfo, StageInfo, local_path, redact

T = TypeVar("T")
_KEY = re.compile(r"[^\w./\- :]")
FINAL = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


def _key(name: str) -> str:
    """An MLflow-safe key (letters, digits, `_-./ :`; at most 250 characters)."""
    return _KEY.sub("_", name)[:250]


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def tracking_uri(spec: MlflowSpec, run_dir: str) -> str:
    uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        return f"sqlite:///{local_path(run_dir.rstrip('/') + '/mlflow.db')}"
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return f"file:{local_path(uri[len('file:') :])}"
    if ":" not in uri.split("/", 1)[0]:  # a bare path
        return f"file:{local_path(uri)}"
    return uri


class MlflowTracker:
    name = "mlflow"

    def __init__(self, spec: MlflowSpec, run_dir: str, pipeline: str) -> None:
        self.uri = tracking_uri(spec, run_dir)
        self.artifacts: str | None = None  # a new experiment's artifact root, for SQLite stores
        if self.uri.startswith("sqlite:///"):
            self.artifacts = f"file://{local_path(run_dir.rstrip('/') + '/mlartifacts')}"
        self.experiment = spec.experiment or pipeline
        self.client: Any = None
        self.experiment_id = ""
        self.parent = ""
        self.children: dict[str, str] = {}

    def start(self, run: RunInfo) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if self.uri.startswith("sqlite:///"):
            if importlib.util.find_spec("sqlalchemy") is None:
                raise RuntimeError(
                    f"{self.uri} needs sqlalchemy and alembic: pip install 'pipe-engine[tracking]'"
                )
            os.makedirs(os.path.dirname(self.uri[len("sqlite:///") :]) or ".", exist_ok=True)
            for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial tables..."
                logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        self.experiment_id = found.experiment_id if found else self._experiment()
        tags = {"pipe.run_id": run.run_id, "pipe.pipeline": run.pipeline, **run.tags}
        self.parent = self._run(run.run_id, tags)
        self._params(self.parent, run.params, run.sources)

    def _experiment(self) -> str:
        return str(self.client.create_experiment(self.experiment, self.artifacts))

    def _run(self, name: str, tags: dict[str, str]) -> str:
        made = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        return str(made.info.run_id)

    def _params(self, run_id: str, params: dict[str, str], sources: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        plist = [Param(_key(k), v[:6000]) for k, v in params.items()]
        tlist = [RunTag(_key(f"source.{k}"), v[:8000]) for k, v in sources.items()]
        for chunk in _chunks(plist, 100):
            self.client.log_batch(run_id, params=chunk)
        for tchunk in _chunks(tlist, 100):
            self.client.log_batch(run_id, tags=tchunk)

    def _child(self, stage: StageInfo, status: str) -> str:
        tags = {
            "mlflow.parentRunId": self.parent,
            "pipe.stage": stage.name,
            "pipe.kind": stage.kind,
            "pipe.cache_key": stage.key,
            "pipe.status": status,
        }
        run_id = self._run(stage.name, tags)
        self.children[stage.name] = run_id
        return run_id

    def opened(self, stage: StageInfo) -> None:
        self._params(self._child(stage, "running"), stage.params, stage.sources)

    def metrics(self, stage: str, step: int, values: dict[str, float], wall: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall * 1000)
        items = [Metric(_key(k), v, ms, step) for k, v in values.items()]
        for chunk in _chunks(items, 1000):
            self.client.log_batch(self.children[stage], metrics=chunk)

    def artifact(self, stage: str, path: str) -> None:
        self.client.log_artifact(self.children[stage], path)

    def closed(self, stage: str, status: str, summary: dict[str, float]) -> None:
        run_id = self.children[stage]
        if summary:
            self.metrics(stage, 0, {f"result.{k}": v for k, v in summary.items()}, time.time())
        self.client.set_tag(run_id, "pipe.status", status)
        self.client.set_terminated(run_id, FINAL.get(status, "FINISHED"))

    def skipped(self, stage: StageInfo, status: str) -> None:
        self.client.set_terminated(self._child(stage, status), "FINISHED")

    def finish(self, status: str) -> None:
        self.client.set_tag(self.parent, "pipe.status", status)
        self.client.set_terminated(self.parent, FINAL.get(status, "FINISHED"))

    def link(self) -> str:
        where = f"experiment '{self.experiment}', run {self.parent}"
        if self.uri.startswith(("http://", "https://")):
            return redact(
                f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.parent}"
            )
        return redact(f"mlflow ui --backend-store-uri {self.uri} ({where})")
