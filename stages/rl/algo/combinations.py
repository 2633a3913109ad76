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
from stages.rl.algo.options import GEOMETRIC_CAP, TOKEN_CAP, AlgorithmOptions, correction_of


def one_update(cfg: Any) -> bool:
    """Whether every batch trains in one optimizer step from the weights that sampled it:
    the ratio is then 1 but for the engine's numeric difference from the actor."""
    samples = cfg.rollout_batch_size * cfg.num_repeats
    return cfg.ppo_epochs == 1 and cfg.train_batch_size >= samples and not cfg.async_train


def refills(cfg: Any) -> bool:
    """Whether dynamic sampling acts: on, with algorithm grpo (ppo trains every group)."""
    return bool(cfg.dynamic_sampling) and cfg.algorithm == "grpo"


# GSPO's clip range (Zheng et al., 2025, section 5.1; verl's GSPO recipe clip_ratio_low /
# clip_ratio_high): a sequence's ratio is a geometric mean, within about 1e-3 of 1
GSPO_CLIP = (3e-4, 4e-4)
GSPO = "ratio_level sequence (GSPO, Zheng et al. 2025)"


def derive_algorithm(cfg: Any) -> dict[str, Derived]:
    """GSPO's loss as one choice (`gspo_defaults`) and the mismatch correction's thresholds
    (`correction_defaults`); `pipe plan --explain` shows each rule, and a value the user or a
    preset set is kept. Dynamic sampling needs no rule: it is off by default for every
    estimator (issue 45: at equal cost it did not lead)."""
    gspo = gspo_defaults(cfg) if cfg.ratio_level == "sequence" else {}
    return gspo | correction_defaults(cfg)


def correction_defaults(cfg: Any) -> dict[str, Derived]:
    """`tis_mode` with its thresholds, as the run takes them (`correction_of`): tis_cap alone
    is token_truncate, a mode without tis_cap takes its level's cap, a mask mode without
    tis_floor takes 1 / tis_cap. Nothing while the correction is off (its default: to be
    chosen by measurement)."""
    c = correction_of(cfg)
    if c is None:
        return {}
    out: dict[str, Derived] = {}
    if cfg.tis_mode is None:
        out["tis_mode"] = Derived(
            c.mode,
            "tis_cap set alone: token-level truncated importance sampling (verl's "
            "tis_imp_ratio_cap), as tis_cap did before tis_mode",
        )
    if cfg.tis_cap is None:
        why = (
            f"{c.mode}: a sequence's ratio is the geometric mean of its tokens', so its cap is "
            f"tight: {GEOMETRIC_CAP}, verl's geometric threshold (a mean of 1e-3 nats a token)"
            if c.per_sequence
            else f"{c.mode}: {TOKEN_CAP}, verl's rollout_is_threshold and slime's tis_upper_bound"
        )
        out["tis_cap"] = Derived(c.cap, why)
    if c.masks and cfg.tis_floor is None:
        out["tis_floor"] = Derived(
            c.floor,
            f"{c.mode}: 1 / tis_cap, as verl's rollout_rs_threshold_lower and slime's "
            "tis_lower_bound",
        )
    return out


def gspo_defaults(cfg: Any) -> dict[str, Derived]:
    """`ratio_level: sequence` is GSPO only with its aggregation and clip range: each
    sequence weighs the same (the paper's `1/G sum_i` over sequences of the mean over its
    tokens: `seq_mean_token_mean`; `token_mean` would weigh a sequence by its length), and a
    clip of [1 - 3e-4, 1 + 4e-4] on a ratio that is a geometric mean (a 0.2 clip would almost
    never bind). Not the aggregation with advantage dr_grpo, which refuses it."""
    low, high = GSPO_CLIP
    out = {
        "eps_clip": Derived(
            low,
            f"{GSPO}: a sequence's ratio is the geometric mean of its tokens', within about "
            f"1e-3 of 1, so the paper clips it at 1 - {low} (0.2 would almost never bind)",
        ),
        "eps_clip_high": Derived(high, f"{GSPO}: the paper's upper clip, 1 + {high}"),
    }
    if cfg.advantage != "dr_grpo":
        out["loss_agg"] = Derived(
            "seq_mean_token_mean",
            f"{GSPO}: each sequence weighs the same, its loss the mean over its tokens, as the "
            "paper's objective and verl's GSPO recipe (token_mean would weigh it by its length)",
        )
    return out


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
    out += check_correction(cfg, ctx)
    wide = [
        p
        for p in ("eps_clip", "eps_clip_high")
        if p in explicit and (getattr(cfg, p) or 0.0) > 10 * GSPO_CLIP[1]
    ]
    if cfg.ratio_level == "sequence" and wide:
        out.append(
            ctx.warning(
                wide[0],
                f"ratio_level sequence (GSPO) clips one ratio per sequence, the geometric mean "
                f"of its tokens', which seldom leaves 1 by more than 1e-3: {wide[0]} "
                f"{getattr(cfg, wide[0])} ({ctx.source(wide[0])}) almost never binds: GSPO's "
                f"range is eps_clip {GSPO_CLIP[0]}, eps_clip_high {GSPO_CLIP[1]} (ratio_level "
                "sequence's default; set it over a preset's)",
            )
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


def check_correction(cfg: AlgorithmOptions, ctx: ResolveContext) -> list[Diagnostic]:
    """`tis_floor` without a mask mode, a mask whose bounds hold no ratio, and a sequence
    mode's cap too wide to bind."""
    out: list[Diagnostic] = []
    c = correction_of(cfg)
    explicit = ctx.explicit
    if "tis_floor" in explicit and (c is None or not c.masks):
        mode = "off" if c is None else c.mode
        out.append(
            ctx.error(
                "tis_floor",
                f"acts with tis_mode token_mask or sequence_mask only; tis_mode is {mode} "
                f"({ctx.source('tis_mode')}): set a mask mode, or leave tis_floor out",
            )
        )
    elif c is not None and c.masks and c.floor is not None and c.floor >= c.cap:
        where = "tis_floor" if "tis_floor" in explicit else "tis_cap"
        out.append(
            ctx.error(
                where,
                f"{c.mode} keeps the {'sequences' if c.per_sequence else 'tokens'} whose ratio "
                "is within [tis_floor, tis_cap]: "
                f"tis_floor {c.floor:.6g} ({ctx.source('tis_floor')}) is not below tis_cap "
                f"{c.cap} ({ctx.source('tis_cap')}), so every token would leave the loss",
            )
        )
    if c is not None and c.per_sequence and "tis_cap" in explicit and c.cap > 1.1:
        out.append(
            ctx.warning(
                "tis_cap",
                f"{c.mode}: a sequence's ratio is the geometric mean of its tokens' (a mean "
                f"log-ratio), so tis_cap {c.cap} binds only where the engine and the actor "
                "differ by more than 0.1 nats a token on average, which seldom happens: "
                f"verl's geometric thresholds are 1.0001 to {GEOMETRIC_CAP} (this mode's "
                "default)",
            )
        )
    return out
