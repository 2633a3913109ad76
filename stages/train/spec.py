"""What the stage process hands each training rank: one typed, validated spec file.

Input: written by `stages.train.run` as `<stage_dir>/train_spec.json`.
Output: read once per rank by `stages.train.worker` (`WorkerSpec.read`), validated
there, so the rank trains on exactly the resolved `TrainConfig` the engine made.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from stages.lib.io.jsonl import atomic_write
from stages.train import TrainConfig


class WorkerSpec(BaseModel):
    """The resolved config and what the stage process decided before launching the ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: TrainConfig
    model_dir: str
    stage_dir: str
    device: Literal["cpu", "cuda"]
    trainer: Literal["deepspeed", "torch"]
    threads: int
    tune_threads: bool
    ds_config: dict[str, Any] | None
    resume_key: str
    save_dtype: str  # the final checkpoint's dtype (`stages.lib.model.dtypes.resolve_save_dtype`)

    def write(self, path: str) -> None:
        atomic_write(path, self.model_dump_json(indent=1) + "\n")

    @classmethod
    def read(cls, path: str) -> WorkerSpec:
        with open(path, encoding="utf-8") as f:
            return cls.model_validate_json(f.read())
