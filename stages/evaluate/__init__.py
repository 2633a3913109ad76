"""evaluate: generate on held-out prompts with checkpoints, verify, compare to a baseline."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.stage import StageConfig, stage
from stages.lib.config import Verifier


class EvaluateConfig(StageConfig):
    """Accuracy, pass@k and mean reward of each checkpoint, against a baseline."""

    INPUTS = ("input", "checkpoints")
    MODEL_INPUTS = ("checkpoints",)
    INPUT_TYPES: ClassVar[dict[str, str]] = {"checkpoints": "checkpoint"}
    OUTPUTS = ("output",)

    input: str | None = Field(
        None, description="Held-out prompt JSONL, e.g. '@dataset.test_output'."
    )
    output: str = Field(
        "report.json", description="The report written (report.md and a chart beside it)."
    )
    checkpoints: list[str] = Field(
        default_factory=list,
        description="Checkpoints to evaluate: directories or '@stage' references; empty: upstream.",
    )
    baseline: str | None = Field(
        None, description="The checkpoint the others are compared to; empty: the first."
    )
    limit: int | None = Field(None, gt=0, description="Evaluate at most this many prompts.")
    num_samples: int = Field(1, gt=0, description="Samples per prompt (k of pass@k).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0: greedy).")
    max_output_tokens: int = Field(64, gt=0, description="Most tokens generated per answer.")
    batch_size: int = Field(128, gt=0, description="Prompts generated together in one batch.")
    verifier: Verifier = Field(default_factory=Verifier, description="How answers are scored.")
    seed: int = Field(0, description="Seed for sampling.")


stage("evaluate", config=EvaluateConfig, run="stages.evaluate.run:run_evaluate")
