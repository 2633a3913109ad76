"""evaluate: generate on held-out prompts with checkpoints, verify, compare to a baseline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, stage
from stages.lib.backends.local import LocalBackend
from stages.lib.backends.registered import Backend, BackendStageConfig
from stages.lib.chat.template import (
    ChatTemplate,
    PromptTemplate,
    check_chat_template,
)
from stages.lib.config import Verifier, check_verifier
from stages.lib.env.field import EnvironmentConfig, check_environment, check_environment_tools
from stages.lib.model.path import check_checkpoint


class EvaluateConfig(BackendStageConfig):
    """Accuracy, pass@k and mean reward of each checkpoint, against a baseline."""

    INPUTS = ("input", "checkpoints", "baseline", "reward_model", "chat_template")
    MODEL_INPUTS = ("checkpoints", "baseline", "reward_model", "chat_template")
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
    timeout_s: float = Field(
        120.0, gt=0, description="Per-request timeout in seconds (vllm and openai backends)."
    )
    backend: Backend = Field(
        default_factory=lambda: LocalBackend(kind="local", batch_size=128),
        description="How answers are generated: local (each checkpoint loaded in the stage's "
        "process, on its GPUs when it holds some), vllm (each checkpoint served in turn on the "
        "stage's GPUs), or openai (the served model, named by backend.model; no checkpoints then).",
    )
    chat_template: ChatTemplate = None
    prompt_template: PromptTemplate = None
    verifier: Verifier = Field(default_factory=Verifier, description="How answers are scored.")
    environment: EnvironmentConfig | None = Field(
        None,
        description="A multi-turn environment each episode talks to (docs/rl/environments.md); "
        "none: "
        "one turn scored by the verifier.",
    )
    reward_model: str | None = Field(
        None,
        description="A reward model (a sequence-classification checkpoint: a train stage with "
        "algorithm rm, e.g. '@rm') scoring every answer: each checkpoint's mean score stands "
        "beside its accuracy, so over-optimisation shows.",
    )
    seed: int = Field(0, description="Seed for sampling.")

    @property
    def top_p(self) -> float:
        """Evaluation samples from the whole distribution (or greedily at temperature 0)."""
        return 1.0

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        return self.backend.derive(ctx, self.num_samples)

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        backend = self.backend
        out = backend.check_model(ctx, wanted=False) + backend.check(ctx)
        for checkpoint in self.checkpoints:
            out += check_checkpoint(ctx, "checkpoints", checkpoint)
        if backend.SERVES_OWN_MODEL and self.checkpoints:
            out.append(
                ctx.error(
                    "checkpoints",
                    f"an {backend.kind} backend evaluates the model it serves "
                    f"('{backend.model}'); checkpoints cannot be sent to it: leave checkpoints "
                    "empty, or use a backend that loads checkpoints",
                )
            )
        if not self.checkpoints and not backend.SERVES_OWN_MODEL:
            out.append(
                ctx.error(
                    "checkpoints",
                    "no checkpoint to evaluate: list them in 'checkpoints' or add the stage "
                    "that trains one to 'needs'",
                )
            )
        problem = backend.conversation_problem()
        if self.environment is not None and problem is not None:
            out.append(ctx.error(*problem))
        out += self._check_reward_model(ctx)
        out += check_chat_template(
            ctx,
            self.chat_template,
            self.prompt_template,
            [("checkpoints", c) for c in self.checkpoints],
            backend.served_elsewhere(),
        )
        out += check_environment_tools(
            self.environment,
            ctx,
            self.chat_template,
            self.prompt_template,
            [("checkpoints", c) for c in self.checkpoints],
            backend.served_elsewhere(),
        )
        return out + check_verifier(self.verifier, ctx) + check_environment(self.environment, ctx)

    def _check_reward_model(self, ctx: ResolveContext) -> list[Diagnostic]:
        """A reward model is a checkpoint with a one-label head; it scores one-turn answers
        and generates nothing."""
        from stages.lib.model.reward_model import check_reward_model

        if self.reward_model is None:
            return []
        if self.environment is not None:
            return [
                ctx.error(
                    "reward_model",
                    "scores one-turn answers; an environment's episodes are scored by the "
                    "environment: leave one of them out",
                )
            ]
        if self.reward_model in self.checkpoints:
            return [
                ctx.error(
                    "checkpoints",
                    f"'{self.reward_model}' is the reward_model: a reward model scores answers "
                    "and generates none; list the checkpoints to evaluate without it",
                )
            ]
        return check_reward_model(ctx, "reward_model", self.reward_model)

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """The accuracy table: a row per checkpoint, its delta to the baseline."""
        from stages.evaluate.headline import table

        return table(result)


stage("evaluate", config=EvaluateConfig, run="stages.evaluate.run:run_evaluate")
