"""The rl stage's reward model settings: the scalar-head checkpoint and how its score becomes
the reward.

Input: a stage's config values. Output: the fields of `ScoringSettings`, a base of
`stages.rl.RLConfig`, and `check_scoring`, its rules at `pipe validate`: a checkpoint whose
`config.json` names a scalar head, the reward role given devices where the stage has GPUs,
weights and shaping only with a reward model, something to score the samples. The
controller applies them (`stages.rl.algo.shaping`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig
from stages.lib.block import Block


class RewardWeights(Block):
    """How the reward model's score and the verifier's reward are mixed into a sample's."""

    reward_model: float = Field(1.0, description="Weight of the reward model's score.")
    verifier: float = Field(
        0.0,
        description="Weight of the verifier's reward (an environment's total over its turns).",
    )


class ScoringSettings(StageConfig):
    """The reward model that scores each sample, and how its score is shaped and mixed."""

    reward_model: str | None = Field(
        None,
        description="A reward model (a checkpoint with a scalar head, e.g. '@rm', a train "
        "stage with algorithm rm) scoring every sample on the reward role's devices; empty: "
        "the verifier's rewards.",
    )
    reward_weights: RewardWeights | None = Field(
        None,
        description="The reward as weights of the model's score and the verifier's reward; "
        "empty: the model's score alone (the verifier then only reports accuracy).",
    )
    normalize_reward: bool = Field(
        False,
        description="Normalise the reward model's scores by their running mean and standard "
        "deviation over every step so far (OpenRLHF's --normalize_reward).",
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the reward model's (normalised) scores to [-reward_clip, reward_clip] "
        "(OpenRLHF's --reward_clip_range); empty: unclipped.",
    )


def check_scoring(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """The reward model's rules (`cfg`: the stage's `RLConfig`)."""
    from stages.lib.model.reward_model import check_reward_model

    out: list[Diagnostic] = []
    rm = cfg.reward_model
    scored_by_verifier = cfg.verifier is not None or cfg.environment is not None
    if rm is None:
        for name in ("reward_weights", "normalize_reward", "reward_clip"):
            if getattr(cfg, name) not in (None, False):
                written = sorted(p for p in ctx.explicit if p.startswith(f"{name}."))
                out.append(
                    ctx.error(
                        written[0] if written else name,
                        f"acts on a reward model's scores, and reward_model is empty: set "
                        f"reward_model, or leave {name} out",
                    )
                )
        if not scored_by_verifier:
            out.append(
                ctx.error(
                    "verifier",
                    "nothing scores the samples: with no verifier (null) set "
                    "reward_model, or name a verifier",
                )
            )
        return out
    out += check_reward_model(ctx, "reward_model", rm)
    weights = cfg.reward_weights
    if weights is not None and weights.verifier and not scored_by_verifier:
        out.append(
            ctx.error(
                "reward_weights.verifier",
                f"weighs the verifier's reward ({weights.verifier}), and there is no verifier "
                "(null): name one, or leave the weight out",
            )
        )
    if cfg.eval_input and not scored_by_verifier:
        out.append(
            ctx.error(
                "eval_input",
                "held-out accuracy is the verifier's, and there is no verifier "
                "(null): name one, or leave eval_input out",
            )
        )
    reward = ctx.roles.get("reward")
    if ctx.gpus > 0 and ctx.roles and (reward is None or reward.gpus == 0):
        out.append(
            ctx.error(
                "reward_model",
                "brings the 'reward' role, which has no GPUs: add reward to "
                "resources.ratio (its own GPUs) or colocate it (e.g. colocate: "
                "[[critic, reward]], the guide's --colocate_critic_reward)",
            )
        )
    return out
