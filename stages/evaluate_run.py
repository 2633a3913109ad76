"""The evaluate stage's body (arrives with the quickstart issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.evaluate import EvaluateConfig


def run_evaluate(cfg: EvaluateConfig, ctx: StageContext) -> dict[str, Any]:
    raise NotImplementedError("the evaluate stage's runner is not implemented yet")
