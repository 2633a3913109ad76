"""The dataset stage's body (arrives with the quickstart issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig


def run_dataset(cfg: DatasetConfig, ctx: StageContext) -> dict[str, Any]:
    raise NotImplementedError("the dataset stage's runner is not implemented yet")
