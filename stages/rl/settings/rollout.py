"""The rl stage's rollout settings: the engine, how answers are scored, what a step samples.

Input: a stage's config values. Output: the fields of `RolloutSettings`, a base of
`stages.rl.RLConfig` (whose rules check them against the other groups).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.stage import StageConfig
from stages.lib.backends.local import LocalBackend
from stages.lib.backends.registered import Backend
from stages.lib.backends.rollout_batch import micro_rollout_field
from stages.lib.block import CountOrAuto
from stages.lib.config import Verifier
from stages.lib.env.field import EnvironmentConfig


class RolloutSettings(StageConfig):
    """Where a step's samples come from, how many, and how they are scored."""

    verifier: Verifier | None = Field(
        default_factory=Verifier,
        description="How answers are scored; empty (null): none, the reward_model alone scores "
        "them.",
    )
    environment: EnvironmentConfig | None = Field(
        None,
        description="A multi-turn environment each episode talks to (docs/rl/environments.md); "
        "none: one turn scored by the verifier.",
    )
    multi_turn_tokens: Literal["extend", "rerender"] = Field(
        "extend",
        description="How an environment's later turns are asked, as token ids: extend (token-in, "
        "token-out, as NeMo RL requires) appends the observation's and generation prompt's ids to "
        "the ids so far, every sampled id kept and trained as sampled; rerender asks from the chat "
        "template's rendering of the conversation so far, as evaluate and a chat server do, and "
        "trains an earlier answer only where the rendering reproduces its sampled ids "
        "(docs/rl/on-policy.md#tokens).",
    )
    backend: Backend = Field(
        default_factory=lambda: LocalBackend(kind="local", batch_size=256),
        description="The rollout engine: local (in the stage's process) or vllm (servers on the "
        "vllm role's devices); weights synced from the actor.",
    )
    num_repeats: int = Field(8, ge=2, description="Samples per prompt: the group size.")
    rollout_batch_size: int = Field(32, gt=0, description="Prompts per step.")
    num_samples_in_parallel: CountOrAuto = Field(
        "auto",
        description="vLLM engines: sample requests in flight at once (all of a step's submitted "
        "together), or auto to find and track the engines' knee, as collect does; the local "
        "engine generates a step in one batched call.",
    )
    micro_rollout_batch_size: int | None = micro_rollout_field()
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    max_output_tokens: int = Field(256, gt=0, description="Most tokens per answer.")
    logprob_diff_warn: float = Field(
        0.5,
        gt=0,
        description="Warn when the engine's log-probability of a sampled token differs from the "
        "actor's (before the step's first update) by more than this many nats: the rollouts are "
        "then not the policy the loss trains (metrics: logprob_diff_mean, logprob_diff_max).",
    )
