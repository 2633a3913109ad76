"""The filter stage's body (arrives with the filter issue)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.filter import FilterConfig


def run_filter(cfg: FilterConfig, ctx: StageContext) -> dict[str, Any]:
    raise NotImplementedError("the filter stage's runner is not implemented yet")
