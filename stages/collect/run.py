"""Entry of the collect stage at run time (the collector arrives with the collect issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.collect import CollectConfig


def run_collect(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    raise NotImplementedError("the collect stage's runner is not implemented yet")
