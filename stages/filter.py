"""filter: keep rollouts by reward, length, duplicates and per-prompt group rules."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.stage import StageConfig, StageContext, stage


class FilterConfig(StageConfig):
    """Keep the rollouts worth training on; report what was dropped and why."""

    INPUTS = ("input",)
    OUTPUTS = ("output",)

    input: str | None = Field(
        None, description="Rollout JSONL; empty: the upstream stage's output."
    )
    output: str = Field("filtered.jsonl", description="Kept rollouts written.")
    min_reward: float | None = Field(None, description="Drop rollouts scoring below this.")
    max_reward: float | None = Field(None, description="Drop rollouts scoring above this.")
    min_length: int | None = Field(None, ge=0, description="Drop completions shorter than this.")
    max_length: int | None = Field(None, gt=0, description="Drop completions longer than this.")
    length_unit: Literal["chars", "tokens"] = Field(
        "chars", description="Unit of min_length and max_length."
    )
    dedup: Literal["none", "exact", "normalized"] = Field(
        "none",
        description="Drop repeated (prompt, completion) pairs: exact text, or normalised whitespace and case.",
    )
    drop_uniform_groups: bool = Field(
        False,
        description="Drop prompts whose samples all scored the same (no learning signal for group-based RL).",
    )
    top_k_per_prompt: int | None = Field(
        None, gt=0, description="Keep at most the k best-scored samples per prompt."
    )
    predicate: str | None = Field(
        None, description="A user callable 'module:function' that returns True to keep a row."
    )
    seed: int = Field(0, description="Seed for tie-breaking.")


@stage("filter", config=FilterConfig)
def filter_rollouts(cfg: FilterConfig, ctx: StageContext) -> dict[str, Any]:
    """Drop rollouts by the configured rules and write the kept ones."""
    from stages.filter_run import run_filter

    return run_filter(cfg, ctx)
