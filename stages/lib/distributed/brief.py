"""What a stage hands its rank processes: one typed, validated brief file (train's and rl's).

Input: what the stage decided before launching its ranks (a kind's brief adds its resolved
config and its own decisions to `RankBrief`'s fields), written once (`write`, atomically).
Output: the same brief read once per rank (`read`) and validated there, so every rank works
from exactly the resolved config the engine made. Each kind's side: `stages/train/brief.py`,
`stages/rl/roles/brief.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from stages.lib.distributed.trainer_choice import Trainer
from stages.lib.io.jsonl import atomic_write

if TYPE_CHECKING:
    from typing_extensions import Self


class RankBrief(BaseModel):
    """Where every rank finds the model and the stage's folder, its device kind, its trainer
    with DeepSpeed's config, and its torch threads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: str
    stage_dir: str
    device: Literal["cpu", "cuda"]
    trainer: Trainer
    ds_config: dict[str, Any] | None
    threads: int

    def write(self, path: str) -> None:
        atomic_write(path, self.model_dump_json(indent=1) + "\n")

    @classmethod
    def read(cls, path: str) -> Self:
        with open(path, encoding="utf-8") as f:
            return cls.model_validate_json(f.read())
