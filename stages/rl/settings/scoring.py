"""The rl stage's reward model settings: the scalar-head checkpoint and how its score becomes
the reward.

Input: a stage's config values. Output: the fields of `ScoringSettings`, a base of
`stages.rl.RLConfig`; `derive_scoring`, what the reward model reads (`reward_sequences`: the
policy's ids where the two share a tokenizer and chat template, else the text,
`stages.lib.model.reward_tokens`), shown by `pipe plan --explain`; and `check_scoring`, its
rules at `pipe validate`: a checkpoint whose `config.json` names a scalar head (and holds
the statistics `normalize_reward` divides by), the reward role given devices where the
stage has GPUs, weights and shaping only with a reward model, something to score the
samples (a verifier, an environment, a reward model or a teacher), ids only where the
reward model reads them. The controller and the reward role apply them
(`stages.rl.algo.shaping`, `stages.rl.roles.reward`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, StageConfig
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
    reward_sequences: Literal["auto", "ids", "text"] = Field(
        "auto",
        description="What the reward model reads of a sample: ids, the policy's token ids "
        "(the two share a tokenizer and chat template); text, the answer decoded, rendered "
        "with the reward model's chat template and tokenized with its tokenizer (as TRL); "
        "auto: ids where the two checkpoints' tokenizer files and chat templates agree, else "
        "text (at plan where both are on disk, else when the stage starts).",
    )
    normalize_reward: bool = Field(
        False,
        description="Normalise the reward model's scores by the mean and standard deviation "
        "stored in its config.json at training (OpenRLHF's --normalize_reward; train with "
        "algorithm rm writes them).",
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="Clip the reward model's (normalised) scores to [-reward_clip, reward_clip] "
        "(OpenRLHF's --reward_clip_range); empty: unclipped.",
    )


def _policy_template(cfg: Any) -> str | None:
    """The Jinja text of the stage's `chat_template:` (None: the checkpoint's own)."""
    from stages.lib.chat.template import template_text

    return template_text(cfg.chat_template, cfg.prompt_template) if cfg.chat_template else None


def derive_scoring(cfg: Any, ctx: ResolveContext) -> dict[str, Derived]:
    """`reward_sequences` from `auto`: ids or text by comparing the two checkpoints
    (`stages.lib.model.reward_tokens.reads`), or decided when the stage starts."""
    from stages.lib.model.reward_tokens import reads

    if cfg.reward_model is None or cfg.reward_sequences != "auto":
        return {}
    try:
        found = reads(cfg.model, _policy_template(cfg), cfg.reward_model)
    except (OSError, ValueError):  # a chat_template the checks refuse
        return {}
    if isinstance(found, str):
        return {"reward_sequences": Derived("auto", f"decided when the stage starts: {found}")}
    return {"reward_sequences": Derived(found.mode, found.why)}


def _check_reads(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """Ids only where the reward model reads the policy's; normalize_reward only with the
    statistics it divides by."""
    from stages.lib.model.path import local_folder
    from stages.lib.model.reward_model import NO_STATS, read_config, saved_stats
    from stages.lib.model.reward_tokens import TEXT, reads

    out = []
    if cfg.reward_sequences == "ids":
        try:
            found = reads(cfg.model, _policy_template(cfg), cfg.reward_model)
        except (OSError, ValueError):
            found = ""
        if not isinstance(found, str) and found.mode == TEXT:
            out.append(
                ctx.error(
                    "reward_sequences",
                    f"ids: the reward model's {found.differs} differs from the policy's, so "
                    "the policy's ids are not what it reads: use text (or auto)",
                )
            )
    folder = local_folder(cfg.reward_model)
    if cfg.normalize_reward and folder is not None and saved_stats(read_config(folder)) is None:
        out.append(ctx.error("normalize_reward", f"'{cfg.reward_model}': {NO_STATS}"))
    return out


def check_scoring(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """The reward model's rules (`cfg`: the stage's `RLConfig`)."""
    from stages.lib.model.reward_model import check_reward_model

    out: list[Diagnostic] = []
    rm = cfg.reward_model
    scored_by_verifier = cfg.verifier is not None or cfg.environment is not None
    if rm is None:
        for name in ("reward_weights", "normalize_reward", "reward_clip", "reward_sequences"):
            if getattr(cfg, name) not in (None, False, "auto"):
                written = sorted(p for p in ctx.explicit if p.startswith(f"{name}."))
                out.append(
                    ctx.error(
                        written[0] if written else name,
                        f"acts on a reward model's scores, and reward_model is empty: set "
                        f"reward_model, or leave {name} out",
                    )
                )
        if not scored_by_verifier and cfg.teacher is None:
            out.append(
                ctx.error(
                    "verifier",
                    "nothing scores the samples: with no verifier (null) set "
                    "reward_model or teacher, or name a verifier",
                )
            )
        return out
    out += check_reward_model(ctx, "reward_model", rm)
    if not out:
        out += _check_reads(cfg, ctx)
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
