"""The rl stage's algorithm settings: the advantage estimator, how per-token losses add up,
DAPO's and GSPO's changes, and the rules that tie them together.

Input: a stage's config values. Output: the fields of `AlgorithmOptions` (the base of
`stages.rl.RLConfig`) and `check_algorithm`'s diagnostics at `pipe validate` / `pipe plan`.

The names follow the frameworks users compare us with (README, "RL algorithms"):
`advantage` is verl's `adv_estimator` / OpenRLHF's `advantage_estimator`, `loss_agg` is
verl's `loss_agg_mode` (underscores for its dashes), `eps_clip_high` verl's `clip_ratio_high`,
`ratio_level` TRL's `importance_sampling_level`. A value set by the user (or a preset) that
cannot act in the stage as configured is refused here, so `pipe plan` and `pipe run` agree;
a default that cannot act is recorded as skipped, with the reason, in `settings.json`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig

Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


class AlgorithmOptions(StageConfig):
    """The policy-gradient estimator and its loss (fields shared by the rl stage's config)."""

    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="grpo (advantages from each prompt's group of samples, no critic; the estimator is 'advantage'); ppo needs a critic (GAE).",
    )
    advantage: Advantage = Field(
        "grpo",
        description="algorithm grpo's advantage estimator: grpo (group mean and std), dr_grpo (group mean, no std division; Dr. GRPO), rloo (leave-one-out group mean), reinforce_pp (REINFORCE++: the return with a per-token KL penalty, normalised over the whole batch).",
    )
    loss_agg: LossAgg = Field(
        "token_mean",
        description="How per-token losses make a step's loss (verl's loss_agg_mode): token_mean (every token of the step weighs the same), seq_mean_token_sum (each sequence's sum, averaged over sequences), seq_mean_token_mean (each sequence's mean, averaged over sequences).",
    )
    eps_clip: float = Field(
        0.2, gt=0, lt=1, description="PPO ratio clip: the ratio is kept within 1 - eps_clip ..."
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        description="... and 1 + eps_clip_high (DAPO's clip-higher, e.g. 0.28); empty: eps_clip both ways.",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="The importance ratio per token, or per sequence (GSPO: the geometric mean of the sequence's token ratios, clipped as one).",
    )
    dynamic_sampling: bool = Field(
        True,
        description="DAPO's dynamic sampling: groups whose rewards all agree are dropped and the step refilled from further prompts until rollout_batch_size groups carry a signal, at most dynamic_sampling_max_rounds generation rounds (on by default: the most held-out accuracy per step measured, BENCHMARKS.md; off: a step trains on the groups it drew).",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        ge=2,
        description="dynamic_sampling: generation rounds per step at most (the step's prompts, then refills of at most rollout_batch_size prompts each, sized by the share of groups kept so far); a step still short trains on the groups it has.",
    )
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's soft overlong punishment: an answer longer than max_output_tokens - overlong_buffer tokens loses up to overlong_penalty of its reward, linearly to the bound; empty: off.",
    )
    overlong_penalty: float = Field(
        1.0, gt=0, description="overlong_buffer: the penalty of an answer at max_output_tokens."
    )
    std_normalize: bool = Field(
        True,
        description="advantage grpo: divide group advantages by their standard deviation (off: the same as advantage dr_grpo).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference (k3 in the loss; in the reward for ppo and reinforce_pp); 0: no reference loaded.",
    )
    ppo_epochs: int = Field(1, gt=0, description="Updates over each rollout batch.")


def one_update(cfg: Any) -> bool:
    """Whether every batch trains in one optimizer step from the weights that sampled it:
    the ratio is then 1 but for the engine's numeric difference from the actor."""
    samples = cfg.rollout_batch_size * cfg.num_repeats
    return cfg.ppo_epochs == 1 and cfg.train_batch_size >= samples and not cfg.async_train


def refills(cfg: Any) -> bool:
    """Whether dynamic sampling acts: on, with algorithm grpo (ppo trains every group)."""
    return bool(cfg.dynamic_sampling) and cfg.algorithm == "grpo"


def check_algorithm(cfg: AlgorithmOptions, ctx: ResolveContext, with_env: bool) -> list[Diagnostic]:
    """Settings that cannot act as configured, refused where the user (or a preset) set
    them: see the module docstring."""
    out: list[Diagnostic] = []
    explicit = ctx.explicit

    def refuse(path: str, why: str) -> None:
        out.append(ctx.error(path, why))

    if cfg.algorithm == "ppo" and "advantage" in explicit and cfg.advantage != "grpo":
        refuse(
            "advantage",
            "algorithm ppo takes its advantages from the critic (GAE); the estimators are "
            "algorithm grpo's: use algorithm grpo, or leave advantage out",
        )
    if cfg.advantage != "grpo" and "std_normalize" in explicit:
        refuse(
            "std_normalize",
            f"acts with advantage grpo only; advantage {cfg.advantage} "
            f"({ctx.source('advantage')}) "
            + ("whitens over the batch" if cfg.advantage == "reinforce_pp" else "divides by no std")
            + ": leave std_normalize out",
        )
    if cfg.advantage == "dr_grpo" and cfg.loss_agg == "seq_mean_token_mean":
        refuse(
            "loss_agg",
            "Dr. GRPO (advantage dr_grpo) removes the per-sequence length normalisation that "
            "seq_mean_token_mean puts back: use token_mean or seq_mean_token_sum",
        )
    if cfg.algorithm == "ppo" and cfg.dynamic_sampling and "dynamic_sampling" in explicit:
        refuse(
            "dynamic_sampling",
            "algorithm ppo trains every group (the critic's values give a group whose rewards "
            "agree its advantages, and the critic learns from it): use algorithm grpo, or "
            "leave dynamic_sampling out",
        )
    if "dynamic_sampling_max_rounds" in explicit and not cfg.dynamic_sampling:
        refuse(
            "dynamic_sampling_max_rounds", "dynamic_sampling is off: set it true, or leave this out"
        )
    elif "dynamic_sampling_max_rounds" in explicit and cfg.algorithm == "ppo":
        refuse("dynamic_sampling_max_rounds", "algorithm ppo trains every group: leave this out")
    if "overlong_penalty" in explicit and cfg.overlong_buffer is None:
        refuse("overlong_penalty", "overlong_buffer is empty: set it, or leave this out")
    if cfg.overlong_buffer is not None:
        max_out = getattr(cfg, "max_output_tokens", 0)
        if cfg.overlong_buffer >= max_out:
            refuse(
                "overlong_buffer",
                f"must be shorter than max_output_tokens ({max_out}): answers up to "
                "max_output_tokens - overlong_buffer tokens keep their whole reward",
            )
        if with_env:
            refuse(
                "overlong_buffer",
                "a multi-turn episode's reward is the environment's over all its turns, and "
                "each turn has its own max_output_tokens: leave overlong_buffer out",
            )
    clip_set = [p for p in ("eps_clip_high", "ratio_level") if p in explicit]
    if clip_set and one_update(cfg):
        out.append(
            ctx.warning(
                clip_set[0],
                "each batch trains in one update from the weights that sampled it "
                "(ppo_epochs 1, train_batch_size >= rollout_batch_size x num_repeats, no "
                "async_train): the ratio differs from 1 only by the engine's numeric "
                "difference from the actor (logprob_diff_max), so the clip binds only there; "
                "it acts on later updates with train_batch_size below the step's samples, "
                "ppo_epochs > 1 or async_train",
            )
        )
    return out
