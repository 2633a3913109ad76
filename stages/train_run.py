"""The train stage's body (arrives with the quickstart issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.train import TrainConfig


def run_train(cfg: TrainConfig, ctx: StageContext) -> dict[str, Any]:
    raise NotImplementedError("the train stage's runner is not implemented yet")
