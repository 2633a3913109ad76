"""Weights & Biases: a run per stage, all in one group named after the run id.

Input: the tracking writer's calls. Output: a run for the pipeline (job type
`pipeline`: the resolved plan as its config, provenance under `source.<key>`, each
stage's status in its summary) and one per stage (job type: its kind; its config,
cache key, every metric with its step as the `step` key, the stage's result as
`result/...` in the summary, PNGs and reports among its files). A stage not run
again (cached) is a run tagged with its status that logs nothing. `mode: offline`
(the default) writes `<dir>/wandb/offline-run-*` for `wandb sync` (`dir`: the spec's, else
`WANDB_DIR` when set, else the run folder); `online` needs
`WANDB_API_KEY` (or a `wandb login`), checked before anything starts, so W&B never
asks for a key on the terminal.
"""

from __future__ import annotations

import netrc
import os
import shutil
from typing import Any

from engine.load.tracking_block import WandbSpec
from engine.run.tracking.base import RunInfo, StageInfo, local_path


def _logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc(os.environ.get("NETRC") or None)
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in auth.hosts)


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: WandbSpec, run_dir: str, pipeline: str) -> None:
        self.spec = spec
        self.project = spec.project or pipeline
        self.dir = local_path(spec.dir or os.environ.get("WANDB_DIR") or run_dir)
        self.group = ""
        self.parent: Any = None
        self.runs: dict[str, Any] = {}
        self.statuses: dict[str, str] = {}

    def _init(self, name: str, job_type: str, config: dict[str, Any], tags: list[str]) -> Any:
        import wandb

        settings = wandb.Settings(
            silent=True, console="off", x_disable_stats=True, x_disable_meta=True
        )
        return wandb.init(
            project=self.project,
            entity=self.spec.entity,
            group=self.group,
            name=name,
            job_type=job_type,
            mode=self.spec.mode,
            dir=self.dir,
            config=config,
            tags=tags,
            reinit="create_new",
            settings=settings,
        )

    def start(self, run: RunInfo) -> None:
        if self.spec.mode == "online" and not _logged_in():
            raise RuntimeError("no W&B credentials: set WANDB_API_KEY or run `wandb login`")
        os.makedirs(self.dir, exist_ok=True)
        self.group = run.run_id
        config = {**run.params, **{f"source.{k}": v for k, v in run.sources.items()}}
        self.parent = self._init(run.run_id, "pipeline", config, [])

    def _stage_config(self, stage: StageInfo) -> dict[str, Any]:
        sources = {f"source.{k}": v for k, v in stage.sources.items()}
        return {"kind": stage.kind, "cache_key": stage.key, **stage.params, **sources}

    def opened(self, stage: StageInfo) -> None:
        self.runs[stage.name] = self._init(stage.name, stage.kind, self._stage_config(stage), [])

    def metrics(self, stage: str, step: int, values: dict[str, float], wall: float) -> None:
        self.runs[stage].log({**values, "step": step})

    def artifact(self, stage: str, path: str) -> None:
        shutil.copy(path, self.runs[stage].dir)  # files in the run's folder are kept with it

    def closed(self, stage: str, status: str, summary: dict[str, float]) -> None:
        run = self.runs.pop(stage)
        run.summary.update({"status": status, **{f"result/{k}": v for k, v in summary.items()}})
        run.finish(exit_code=0 if status == "succeeded" else 1)
        self.statuses[stage] = status

    def skipped(self, stage: StageInfo, status: str) -> None:
        run = self._init(
            stage.name, stage.kind, {"kind": stage.kind, "cache_key": stage.key}, [status]
        )
        run.summary.update({"status": status})
        run.finish()
        self.statuses[stage.name] = status

    def finish(self, status: str) -> None:
        for name in list(self.runs):
            self.closed(name, "cancelled", {})
        self.parent.summary.update(
            {"status": status, **{f"stages/{k}": v for k, v in self.statuses.items()}}
        )
        self.parent.finish(exit_code=0 if status == "succeeded" else 1)

    def link(self) -> str:
        if self.spec.mode == "online" and self.parent is not None and self.parent.url:
            return str(self.parent.url)
        return (
            f"{self.dir}/wandb (offline runs of group {self.group}; "
            f"upload: wandb sync {self.dir}/wandb/offline-run-*)"
        )
