"""collect: send prompts to a model backend, verify the answers, write rollouts.

The config model lives here so `pipe validate` stays light; the collector
itself (asyncio, aiohttp) is imported only when the stage runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, stage
from stages.lib.backends.local import LocalBackend
from stages.lib.backends.registered import Backend, BackendStageConfig
from stages.lib.backends.rollout_batch import (
    check_rollout_batch,
    derive_rollout_batch,
    lands,
    micro_rollout_field,
)
from stages.lib.block import CountOrAuto
from stages.lib.chat.template import (
    ChatTemplate,
    PromptTemplate,
    check_chat_template,
)
from stages.lib.config import Verifier, check_verifier
from stages.lib.env.field import EnvironmentConfig, check_environment, check_environment_tools


class CollectConfig(BackendStageConfig):
    """Generate `num_repeats` answers per prompt, score each, append them as rollouts."""

    SPANS_NODES = True  # one shard of the prompts per worker, merged by the first
    INPUTS = ("input", "backend.model", "chat_template")
    MODEL_INPUTS = ("backend.model", "chat_template")
    OUTPUTS = ("output",)

    input: str | None = Field(
        None,
        description="Prompt JSONL (rows with messages or prompt); empty: the upstream stage's "
        "output.",
    )
    output: str = Field(
        "rollouts.jsonl", description="Rollout JSONL written (appended, resumable)."
    )
    num_samples_in_parallel: CountOrAuto = Field(
        32, description="Requests in flight at once, or auto to find and track the backend's knee."
    )
    micro_rollout_batch_size: int | None = micro_rollout_field()
    limit: int | None = Field(
        None, gt=0, description="Use at most this many prompts (after start_idx)."
    )
    start_idx: int = Field(0, ge=0, description="First prompt (row index in the input) to use.")
    end_idx: int | None = Field(
        None, gt=0, description="Stop before this prompt index (exclusive)."
    )
    num_repeats: int = Field(1, gt=0, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_output_tokens: int = Field(256, gt=0, description="Most tokens generated per answer.")
    timeout_s: float = Field(120.0, gt=0, description="Per-request timeout in seconds.")
    max_retries: int = Field(
        4, ge=0, description="Retries per request on 429, 5xx, timeouts and connection errors."
    )
    backoff_s: float = Field(
        0.5,
        gt=0,
        description="First retry delay in seconds; it doubles with each retry (with jitter, capped "
        "at 30 s).",
    )
    max_failed_runs: int = Field(
        3,
        gt=0,
        description="A restarted run retries rows in the failures sidecar until they have failed "
        "in this many runs.",
    )
    shards: CountOrAuto = Field(
        1,
        description="Split the prompts into this many Dask tasks (each with its own concurrency), "
        "or auto from the workers.",
    )
    seed: int = Field(0, description="Seed for sampling.")
    backend: Backend = Field(
        default_factory=lambda: LocalBackend(kind="local", model="checkpoint"),
        description="Where answers come from: openai, vllm or local.",
    )
    chat_template: ChatTemplate = None
    prompt_template: PromptTemplate = None
    verifier: Verifier = Field(
        default_factory=Verifier, description="How answers are scored into rewards."
    )
    environment: EnvironmentConfig | None = Field(
        None,
        description="A multi-turn environment each episode talks to (docs/rl/environments.md); "
        "none: "
        "one turn scored by the verifier.",
    )

    @field_validator("end_idx")
    @classmethod
    def _end_after_start(cls, value: int | None, info: ValidationInfo) -> int | None:
        start = info.data.get("start_idx", 0)
        if value is not None and isinstance(start, int) and value <= start:
            raise ValueError(f"end_idx must be greater than start_idx ({start}), found {value}")
        return value

    def workers_used(self, workers: int) -> int:
        """`shards` > 1 (or auto: one per worker) are Dask tasks over the workers."""
        return workers if self.shards == "auto" else max(1, min(workers, self.shards))

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        """`micro_rollout_batch_size` stays out of a stage whose server batches on its own."""
        return super().preset_path(key, data) if lands(key, data) else None

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        """Engines from the stage's GPUs; prefix caching when num_repeats > 1; half of each GPU
        for training when vLLM shares it; the engine's batch from micro_rollout_batch_size."""
        return self.backend.derive(ctx, self.num_repeats) | derive_rollout_batch(self, ctx)

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        out = self.backend.check_model(ctx, wanted=True) + self.backend.check(ctx)
        out += check_verifier(self.verifier, ctx) + check_environment(self.environment, ctx)
        out += check_chat_template(
            ctx,
            self.chat_template,
            self.prompt_template,
            [("backend.model", self.backend.model)],
            self.backend.served_elsewhere(),
        )
        out += check_environment_tools(
            self.environment,
            ctx,
            self.chat_template,
            self.prompt_template,
            [("backend.model", self.backend.model)],
            self.backend.served_elsewhere(),
        )
        out += check_rollout_batch(ctx, self)
        return out + self._check_episodes_backend(ctx)

    def _check_episodes_backend(self, ctx: ResolveContext) -> list[Diagnostic]:
        """Episodes send the conversation as messages: a backend that takes them."""
        problem = self.backend.conversation_problem()
        if self.environment is None or problem is None:
            return []
        return [ctx.error(*problem)]

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Rows written, the rate, latency, errors, failures and retries."""
        if "rows" not in result:
            return []
        if result.get("up_to_date"):
            return [
                f"{result['rows']} rollouts (already complete), {result.get('failures', 0)} failed"
            ]
        errors = sum((result.get("errors") or {}).values())
        p95 = (result.get("latency_s") or {}).get("p95", 0.0)
        return [
            f"{result['rows']} rollouts, {result.get('rollouts_per_s', 0):.1f} rollouts/s, "
            f"p95 latency {p95:.2f} s, {errors} errors, {result.get('failures', 0)} failed, "
            f"{result.get('retries', 0)} retries"
        ]


stage("collect", config=CollectConfig, run="stages.collect.run:run_collect")
