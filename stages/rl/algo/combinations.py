"""The rules of the rl stage's algorithm settings (`stages.rl.algo.options`): what they mean
together, and which of them cannot act as configured.

Input: a stage's config (`AlgorithmOptions` and the rollout and optimisation fields they
depend on). Output: `one_update` and `refills` (read by the run's accounting and the batch
loop too), `derive_algorithm`'s values where neither the user nor a preset set one, and
`check_algorithm`'s diagnostics at `pipe validate` / `pipe plan`.

A value set by the user (or a preset) that cannot act in the stage as configured is refused
here, so `pipe plan` and `pipe run` agree; a default that cannot act is recorded as skipped,
with the reason, in `settings.json` (`stages.rl.algo.effects`).
"""

from __future__ import annotations

from typing import Any

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext
from stages.rl.algo.options import AlgorithmOptions


def one_update(cfg: Any) -> bool:
    """Whether every batch trains in one optimizer step from the weights that sampled it:
    the ratio is then 1 but for the engine's numeric difference from the actor."""
    samples = cfg.rollout_batch_size * cfg.num_repeats
    return cfg.ppo_epochs == 1 and cfg.train_batch_size >= samples and not cfg.async_train


def refills(cfg: Any) -> bool:
    """Whether dynamic sampling acts: on, with algorithm grpo (ppo trains every group)."""
    return bool(cfg.dynamic_sampling) and cfg.algorithm == "grpo"


def derive_algorithm(cfg: Any) -> dict[str, Derived]:
    """Dynamic sampling's default per estimator: on where a group whose rewards agree has
    advantages of 0 and trains nothing (advantage grpo, dr_grpo, rloo: the default, true),
    off where such a group trains (`pipe plan --explain` shows the rule)."""
    if cfg.algorithm == "ppo":
        why = "algorithm ppo trains every group (the critic values a group whose rewards agree)"
    elif cfg.advantage == "reinforce_pp":
        why = (
            "advantage reinforce_pp trains every group: its baseline is the batch's, so a group "
            "whose rewards agree has advantages too, as in OpenRLHF"
        )
    else:
        return {}
    return {"dynamic_sampling": Derived(False, why)}


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
            "dynamic_sampling_max_rounds",
            f"dynamic_sampling is off ({ctx.source('dynamic_sampling')}): set it true, or leave "
            "this out",
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
