"""How the algorithm settings of an rl stage act in its run (`stages.rl.algo.options`): applied,
and how, or skipped, and why; merged into `stages.rl.controller.applied.account`.

Input: the resolved config. Output: `{field: (status, how)}` for the estimator, the loss's
aggregation and clip, the ratio's level, DAPO's dynamic sampling and overlong shaping, and
the mismatch correction (`tis_mode` and its thresholds).
"""

from __future__ import annotations

from typing import Any

from stages.rl.algo.combinations import GSPO_CLIP, one_update, refills
from stages.rl.algo.options import Correction, correction_of

A, S = "applied", "skipped"

ESTIMATORS = {
    "grpo": "group mean subtracted, divided by the group's sample std (n - 1, as verl, TRL)",
    "dr_grpo": "group mean subtracted, no std division (Dr. GRPO)",
    "rloo": "leave-one-out: each sample's baseline the mean of its group's other rewards",
    "reinforce_pp": "REINFORCE++: per-token returns (KL in the reward), normalised over the batch",
}
AGGREGATIONS = {
    "token_mean": "the step's per-token losses summed, over its loss tokens (all ranks)",
    "seq_mean_token_sum": "each sequence's summed loss, averaged over the step's sequences",
    "seq_mean_token_mean": "each sequence's mean loss, averaged over the step's sequences",
}

GSPO_AGG = " (GSPO's: with ratio_level sequence each sequence weighs the same, as the paper's)"
GSPO_RANGE = " (GSPO's range: a sequence's ratio, a geometric mean, stays within about 1e-3 of 1)"


def account_algorithm(cfg: Any) -> dict[str, tuple[str, str]]:
    """See the module docstring."""
    ppo = cfg.algorithm == "ppo"
    ratio_one = (
        " (one update per batch from the weights that sampled it: the ratio moves by the "
        "engine's numeric difference only, so the bound seldom binds; clip_frac in metrics.jsonl)"
        if one_update(cfg)
        else ""
    )
    high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    gspo = cfg.ratio_level == "sequence"
    return {
        "algorithm": (A, "GRPO: advantages from each prompt's group, clipped ratio, no critic")
        if not ppo
        else (A, "PPO: a critic (value head on the policy's decoder) in its own ranks, GAE"),
        "advantage": (S, "algorithm ppo: the critic's GAE gives the advantages")
        if ppo
        else (A, ESTIMATORS[cfg.advantage]),
        "std_normalize": _std(cfg),
        "loss_agg": (
            A,
            AGGREGATIONS[cfg.loss_agg]
            + (GSPO_AGG if gspo and cfg.loss_agg == "seq_mean_token_mean" else ""),
        ),
        "eps_clip": (
            A,
            f"the ratio kept at or above 1 - {cfg.eps_clip}"
            + (GSPO_RANGE if gspo and cfg.eps_clip == GSPO_CLIP[0] else "")
            + ratio_one,
        ),
        "eps_clip_high": (
            A,
            f"the ratio kept at or below 1 + {high}"
            + (" (eps_clip: empty)" if cfg.eps_clip_high is None else " (clip-higher)")
            + (GSPO_RANGE if gspo and cfg.eps_clip_high == GSPO_CLIP[1] else "")
            + ratio_one,
        ),
        "ratio_level": (A, "one ratio per token")
        if cfg.ratio_level == "token"
        else (
            A,
            "GSPO: one ratio per sequence, the geometric mean of its tokens', clipped as one"
            + ratio_one,
        ),
        "dynamic_sampling": _dynamic(cfg),
        "dynamic_sampling_max_rounds": (
            A,
            f"at most {cfg.dynamic_sampling_max_rounds} generation rounds a step: "
            f"{(cfg.dynamic_sampling_max_rounds - 1) * cfg.rollout_batch_size} extra prompts "
            "at most",
        )
        if refills(cfg)
        else (S, "dynamic_sampling is off" if cfg.algorithm == "grpo" else "algorithm ppo"),
        "overlong_buffer": (
            A,
            f"answers past {cfg.max_output_tokens - cfg.overlong_buffer} tokens lose reward, "
            f"linearly to -{cfg.overlong_penalty} at max_output_tokens "
            "(overlong_penalty_mean in metrics.jsonl)",
        )
        if cfg.overlong_buffer
        else (A, "off: no length penalty"),
        "overlong_penalty": (A, "the penalty at max_output_tokens")
        if cfg.overlong_buffer
        else (S, "overlong_buffer is empty"),
        **account_correction(cfg),
    }


FIGURES = (
    "mismatch_k3, mismatch_chi2_token, mismatch_chi2_seq, mismatch_ppl_ratio in metrics.jsonl "
    "every step"
)
STALE = (
    "; with async_train the engine sampled with weights up to async_queue_size versions "
    "behind the actor's, and the weight corrects that staleness too"
)


def account_correction(cfg: Any) -> dict[str, tuple[str, str]]:
    """`tis_mode`, `tis_cap` and `tis_floor`: how the correction acts, or that it is off."""
    c = correction_of(cfg)
    if c is None:
        off = (
            A,
            "off: the ratio is taken against the engine's log-probabilities, unweighted (the "
            f"mismatch is measured all the same: {FIGURES})",
        )
        return {"tis_mode": off, "tis_cap": off, "tis_floor": (S, "tis_mode is off")}
    stale = STALE if cfg.async_train else ""
    alone = " (tis_cap set alone)" if cfg.tis_mode is None else ""
    unit = "a sequence" if c.per_sequence else "a token"
    r = "r (the geometric mean of its tokens' exp(actor - engine))" if c.per_sequence else "r"
    if c.masks:
        gone = "leaves the loss, its numerator and its denominator"
        cap = f"{unit} whose {r} passes {c.cap} {gone}"
        floor = (
            A,
            f"{unit} whose {r} is under {c.floor:.6g} {gone}"
            + (" (1 / tis_cap)" if cfg.tis_floor is None else ""),
        )
        stats = "mismatch_masked_token_frac, mismatch_masked_seq_frac, tis_weight_mean"
    else:
        cap = f"each token's loss weighted by min(exp(actor - engine), {c.cap})"
        if c.per_sequence:
            cap = (
                f"each token's loss weighted by min(g, {c.cap}), g the geometric mean of its "
                "sequence's exp(actor - engine)"
            )
        floor = (S, f"{c.mode} truncates from above only: tis_floor acts with the mask modes")
        stats = "tis_weight_mean, tis_capped_frac"
    how = (
        f"{c.mode}{alone}: {_mode(c)}; a no-grad pass of the actor over the batch at the "
        f"step's start gives the ratio its log-probabilities ({stats} in metrics.jsonl)"
    )
    default = "" if cfg.tis_cap is not None else f" ({c.mode}'s default)"
    return {
        "tis_mode": (A, how + stale),
        "tis_cap": (A, f"{cap}{default}" + stale),
        "tis_floor": floor,
    }


def _mode(c: Correction) -> str:
    level = "per sequence, the geometric mean of its tokens'" if c.per_sequence else "per token"
    if c.masks:
        return (
            f"importance weights {level}, {'sequences' if c.per_sequence else 'tokens'} "
            f"outside [{c.floor:.6g}, {c.cap}] out of the loss's numerator and denominator"
        )
    return f"importance weights {level}, truncated at {c.cap}"


def _std(cfg: Any) -> tuple[str, str]:
    if cfg.algorithm == "ppo":
        return S, "PPO whitens its GAE advantages over the batch instead"
    if cfg.advantage != "grpo":
        return S, f"acts with advantage grpo only (advantage {cfg.advantage})"
    if cfg.std_normalize:
        return A, "advantages divided by the group's sample std (n - 1, as verl and TRL)"
    return A, "advantages not divided by the std (as advantage dr_grpo)"


def _dynamic(cfg: Any) -> tuple[str, str]:
    reinforce = cfg.advantage == "reinforce_pp"
    if cfg.algorithm == "ppo" and cfg.dynamic_sampling:
        return S, "algorithm ppo trains every group (the critic values them)"
    if not cfg.dynamic_sampling:
        if cfg.algorithm == "ppo":
            return A, "off: every group trains (the critic values them)"
        return A, (
            "off: every group trains (REINFORCE++'s baseline is the batch's: a group whose "
            "rewards agree has advantages too)"
            if reinforce
            else "off: groups whose rewards all agree have advantages 0 and train nothing; the "
            "step trains on the rest, no refill"
        )
    from stages.rl.algo.shaping import verifier_weighs

    judge = "verifier" if verifier_weighs(cfg) else "reward model's"
    judges = "verifier's" if verifier_weighs(cfg) else "reward model's"
    return A, (
        f"groups whose {judge} rewards all agree are dropped and the step refilled from further "
        f"prompts until {cfg.rollout_batch_size} groups carry a signal, at most "
        f"{cfg.dynamic_sampling_max_rounds} rounds (prompts_drawn, gen_rounds in metrics.jsonl)"
        + (
            "; with advantage reinforce_pp those groups would have trained on the batch's baseline"
            if reinforce
            else ""
        )
        + (
            f"; judged on the {judges} rewards, not the overlong-shaped ones (as DAPO's and "
            "verl's filter_groups.metric acc)"
            if cfg.overlong_buffer
            else ""
        )
    )
