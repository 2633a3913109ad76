"""dataset: write prompt JSONL (a train and a test split) from a source, or preference pairs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig, stage


class DatasetConfig(StageConfig):
    """Prompts from reasoning-gym's procedural tasks, a local file, or a Hugging Face dataset."""

    OUTPUTS = ("output", "test_output", "val_output")

    source: Literal["reasoning_gym", "jsonl", "parquet", "huggingface"] = Field(
        "reasoning_gym", description="Where prompts come from."
    )
    task: str | None = Field(None, description="reasoning_gym: the task name, e.g. chain_sum.")
    task_config: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning_gym: the task's own settings, e.g. {min_terms: 2, max_terms: 2}.",
    )
    path: str | None = Field(
        None,
        description="jsonl/parquet: the file; huggingface: the dataset id (org/name, or "
        "org/name@revision), pinned to a commit by the plan.",
    )
    split: str = Field("train", description="huggingface: the split to read.")
    size: int = Field(1000, gt=0, description="Number of training prompts to write.")
    test_size: int = Field(
        0, ge=0, description="Number of held-out test prompts, disjoint from the training prompts."
    )
    val_size: int = Field(
        0,
        ge=0,
        description="Number of validation prompts (e.g. for a warm-up's accuracy target), disjoint "
        "from both other splits.",
    )
    pairs: bool = Field(
        False,
        description="Rows are preference pairs ('chosen' and 'rejected', each text or chat "
        "messages; 'prompt' optional: Anthropic HH, UltraFeedback-binarized), written as they "
        "come and split by prompt; jsonl, parquet or huggingface sources.",
    )
    nemo_gym_rows: bool = Field(
        False,
        description="Each prompt row also in NeMo Gym's form: 'responses_create_params' (the "
        "prompt as its 'input' messages) and, from reasoning_gym, the 'question' its resources "
        "server's /verify reads; collect, evaluate and rl with environment kind nemo_gym read "
        "them (the other stages read 'prompt' as before).",
    )
    seed: int = Field(0, description="Seed for generation and shuffling.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")
    output: str = Field("train.jsonl", description="Training prompts written.")
    test_output: str = Field("test.jsonl", description="Held-out test prompts written.")
    val_output: str = Field(
        "val.jsonl", description="Validation prompts written (empty unless val_size)."
    )

    def hub_inputs(self) -> dict[str, str]:
        """A Hugging Face dataset's id, pinned by the plan and read at that commit."""
        return {"path": "dataset"} if self.source == "huggingface" else {}

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """A source names what it reads: reasoning-gym a task, the others a path; pairs come
        from a file or a Hugging Face dataset, and a file that exists now holds pairs."""
        if self.source == "reasoning_gym" and not self.task:
            return [ctx.error("task", "source 'reasoning_gym' needs a 'task', e.g. chain_sum")]
        if self.source != "reasoning_gym" and not self.path:
            return [ctx.error("path", f"source '{self.source}' needs a 'path'")]
        if self.pairs and self.nemo_gym_rows:
            return [
                ctx.error(
                    "nemo_gym_rows",
                    "NeMo Gym's rows are prompts; preference pairs have none to send: leave it out",
                )
            ]
        if not self.pairs:
            return []
        if self.source == "reasoning_gym":
            return [
                ctx.error(
                    "pairs",
                    "reasoning_gym makes prompts, not preference pairs: read pairs from a "
                    "jsonl, parquet or huggingface source, or make them from rollouts with "
                    "the filter stage's 'pairs: true'",
                )
            ]
        if self.system_prompt is not None:
            return [
                ctx.error(
                    "system_prompt",
                    "acts on prompt rows only; preference pairs are written as they come: "
                    "leave it out",
                )
            ]
        if self.source == "jsonl":
            import os

            from stages.lib.io.preference import check_pairs_file

            return check_pairs_file(ctx, "path", os.path.join(ctx.pipeline_dir, str(self.path)))
        return []

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Rows per split."""
        splits = [(k[: -len("_rows")], v) for k, v in result.items() if k.endswith("_rows") and v]
        return [", ".join(f"{v} {k}" for k, v in splits) + " rows"] if splits else []


stage("dataset", config=DatasetConfig, run="stages.dataset.run:run_dataset")
