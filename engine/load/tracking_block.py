"""Load, part of: the pipeline's `tracking:` block and its one check (is the library there?).

```yaml
tracking:
  tensorboard: {dir: runs/tb}                          # default: <run dir>/tensorboard
  mlflow: {tracking_uri: http://mlflow:5000, experiment: grpo}  # default: sqlite in the run dir
  wandb: {project: pipe, mode: offline, entity: null}
```

Any subset; none by default. The libraries are the optional extra `.[tracking]`: naming
a tracker whose library is missing is a located error at validate time, found with
`importlib.util.find_spec` (nothing is imported: `pipe validate` stays light). Relative
paths and `file:` URIs resolve against the working directory `pipe run` starts in, as
`--run-dir` does. Credentials never appear here: they come from the environment
(`WANDB_API_KEY`, `MLFLOW_TRACKING_USERNAME`/`_PASSWORD`/`_TOKEN`).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import Diagnostic
from engine.load.source import Document


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TensorBoardSpec(_Model):
    """TensorBoard event files: a folder per run, a subfolder per stage."""

    dir: str | None = Field(
        None,
        description="Where the event files go (default: <run dir>/tensorboard); "
        "`tensorboard --logdir DIR` shows them.",
    )


class MlflowSpec(_Model):
    """MLflow: one parent run per `pipe run`, a nested run per stage."""

    tracking_uri: str | None = Field(
        None,
        description="Tracking server or store, e.g. http://mlflow:5000 or sqlite:///mlflow.db "
        "(default: MLFLOW_TRACKING_URI, else sqlite:///<run dir>/mlflow.db with artifacts in "
        "<run dir>/mlartifacts). Credentials come from MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN "
        "in the environment.",
    )
    experiment: str | None = Field(
        None, description="Experiment name (default: the pipeline's name)."
    )


class WandbSpec(_Model):
    """Weights & Biases: a run per stage, grouped under the run id, plus one for the pipeline."""

    project: str | None = Field(None, description="W&B project (default: the pipeline's name).")
    entity: str | None = Field(None, description="W&B team or user (default: yours).")
    mode: Literal["online", "offline"] = Field(
        "offline",
        description="offline writes <dir>/wandb/offline-run-* (upload later with `wandb sync`); "
        "online needs WANDB_API_KEY in the environment (or `wandb login`).",
    )
    dir: str | None = Field(
        None,
        description="Folder that holds W&B's wandb/ folder (default: WANDB_DIR when set, "
        "else the run dir).",
    )


class TrackingSpec(_Model):
    """Experiment trackers the run's metrics, plan and artifacts go to (any subset)."""

    tensorboard: TensorBoardSpec | None = Field(
        None, description="TensorBoard event files ({} for the defaults)."
    )
    mlflow: MlflowSpec | None = Field(None, description="MLflow ({} for the defaults).")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases ({} for the defaults).")

    def named(self) -> list[str]:
        """The trackers set, in a fixed order."""
        return [n for n in TRACKERS if getattr(self, n) is not None]


# tracker -> the module its writer imports (checked, never imported, at validate time)
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check_tracking(doc: Document, spec: TrackingSpec) -> list[Diagnostic]:
    """A located error for each tracker named whose library is not installed."""
    out = []
    for name in spec.named():
        module = TRACKERS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(
                Diagnostic(
                    doc.key_loc(("tracking", name)),
                    f"tracking.{name}",
                    f"tracker '{name}' needs the '{module}' package, which is not installed; "
                    "install the tracking extra: pip install 'pipe-engine[tracking]'",
                )
            )
    return out
