"""filter: keep rollouts by reward, length, duplicates and per-prompt group rules.

Input: a rollout JSONL (collect's output). Output: the kept rows, byte for byte
as they were read, plus `<stage_dir>/filter_report.json` and
`<stage_dir>/reward_histogram.png`. The rules run in this order, each on the
rows the earlier ones kept, and a dropped row is counted once, under the first
rule that dropped it (`stages.filter.rules.RULES`):

1. `uniform_group`: the prompt's samples, as collected, all scored the same.
2. `min_reward`, `max_reward`: the row's reward is out of bounds.
3. `min_length`, `max_length`: the completion is too short or too long.
4. `duplicate`: the (prompt, completion) pair was already kept by rules 1-3
   earlier in the file (exact, or with whitespace and case normalised).
5. `predicate`: the user's `module:function` returned a false value.
6. `top_k`: the prompt already has `top_k_per_prompt` better-scored samples
   (ties: lower `sample_idx` first); best-of-n is `top_k_per_prompt: 1`.

With a `verifier:` (an LLM judge, or any verifier) the rows are scored again before rule 1
(`stages.filter.rescore`): a row it cannot score is left out, counted under `rescored`.

With `pairs: true` the output holds preference pairs made from each prompt's kept rows
instead of the rows (`stages.filter.pairs`): a reward model's or DPO's training data.

This module stays light (no numpy, no matplotlib): `pipe validate` imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig, stage
from stages.lib.block import check_callable
from stages.lib.config import Verifier, check_verifier


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
        "chars",
        description="Unit of min_length and max_length: characters of the completion, or tokens "
        "(usage.completion_tokens; characters for a row without it).",
    )
    dedup: Literal["none", "exact", "normalized"] = Field(
        "none",
        description="Drop repeated (prompt, completion) pairs, keeping the first: exact text, or "
        "normalised whitespace and case.",
    )
    drop_uniform_groups: bool = Field(
        False,
        description="Drop prompts whose samples all scored the same (no learning signal for "
        "group-based RL); a prompt with one sample counts as uniform.",
    )
    top_k_per_prompt: int | None = Field(
        None,
        gt=0,
        description="Keep at most the k best-scored samples per prompt (ties: lower sample_idx "
        "first); 1 is best-of-n.",
    )
    predicate: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="A user callable 'module:function' given each row (a dict); a false result "
        "drops the row. The pipeline's folder is importable.",
    )
    pairs: bool = Field(
        False,
        description="Write preference pairs instead of rows: per prompt, a kept rollout scored "
        "high against one scored low (chosen, rejected); none for a prompt whose kept rows all "
        "scored the same.",
    )
    pairs_per_prompt: int = Field(
        1,
        gt=0,
        description="pairs: at most this many pairs per prompt, no rollout in two (the i-th best "
        "against the i-th worst).",
    )
    verifier: Verifier | None = Field(
        None,
        description="Score the rows again before the rules (e.g. kind judge: an LLM grades "
        "them); the row's reward becomes the verifier's, the collected one kept as "
        "collected_reward; a row it cannot score is left out and counted. null: the rewards "
        "as collected.",
    )
    partition_mb: float = Field(
        64.0,
        gt=0,
        description="On a Dask cluster, inputs larger than two partitions are filtered in "
        "partitions of about this many MB, one task each.",
    )

    def workers_used(self, workers: int) -> int:
        """A file over two partitions is filtered as Dask tasks over every worker."""
        return workers

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """The predicate's module must be importable where the run looks: the pipeline's
        folder, then Python's path (`stages.filter.rules.load_predicate`); `pairs_per_prompt`
        acts with `pairs` only."""
        out = []
        if "pairs_per_prompt" in ctx.explicit and not self.pairs:
            out.append(
                ctx.error(
                    "pairs_per_prompt", "acts with 'pairs: true' only: set pairs, or leave it out"
                )
            )
        if self.verifier is not None:
            out += check_verifier(self.verifier, ctx)
        if self.predicate is None:
            return out
        pdir = [ctx.pipeline_dir]
        return out + check_callable(ctx, "predicate", "predicate", self.predicate, pdir)

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Kept of in, and what each rule dropped."""
        if "rows_kept" not in result:
            return []
        dropped = ", ".join(f"{k} {v}" for k, v in (result.get("dropped") or {}).items() if v)
        pairs = f"; {result['pairs']} pairs written" if result.get("pairs") is not None else ""
        return [
            f"kept {result['rows_kept']} of {result.get('rows_in', 0)} rows; "
            f"dropped: {dropped or 'none'}{pairs}"
        ]


stage("filter", config=FilterConfig, run="stages.filter.run:run_filter")
