"""The rl stage's loss and algorithm settings: the advantage estimator, the policy loss and
how per-token losses add up, DAPO's and GSPO's changes, PPO's and the KL's terms.

Input: a stage's config values. Output: the fields of `AlgorithmOptions`, a base of
`stages.rl.RLConfig` (the rules that tie them together: `stages.rl.algo.combinations`), and
`per_token_returns`, which estimators take their advantages from each token's return.

The names follow the frameworks users compare us with (docs/rl/algorithms.md):
`advantage` is verl's `adv_estimator` / OpenRLHF's `advantage_estimator`, `loss_agg` is
verl's `loss_agg_mode` (underscores for its dashes), `eps_clip_high` verl's
`clip_ratio_high`, `ratio_level` TRL's `importance_sampling_level`, `tis_mode` TRL's
`vllm_importance_sampling_mode` (its four values), `tis_cap` and `tis_floor` slime's
`tis_upper_bound` and `tis_lower_bound` (`stages.rl.algo.correction`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from engine.stage import StageConfig

Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
TisMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

# tis_cap's default per level: a token's ratio (verl's rollout_is_threshold default, slime's
# tis_upper_bound), a sequence's geometric mean (verl's geometric rejection preset,
# decoupled_geo_rs: a mean log-ratio of 1e-3 nats a token)
TOKEN_CAP, GEOMETRIC_CAP = 2.0, 1.001


class AlgorithmOptions(StageConfig):
    """The policy-gradient estimator and its loss (fields shared by the rl stage's config)."""

    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="grpo (advantages from each prompt's group of samples, no critic; the "
        "estimator is 'advantage'); ppo needs a critic (GAE).",
    )
    advantage: Advantage = Field(
        "grpo",
        description="algorithm grpo's advantage estimator: grpo (group mean and std), dr_grpo "
        "(group mean, no std division; Dr. GRPO), rloo (leave-one-out group mean), reinforce_pp "
        "(REINFORCE++: the return with a per-token KL penalty, normalised over the whole batch).",
    )
    loss_agg: LossAgg = Field(
        "token_mean",
        description="How per-token losses make a step's loss (verl's loss_agg_mode): token_mean "
        "(every token of the step weighs the same), seq_mean_token_sum (each sequence's sum, "
        "averaged over sequences), seq_mean_token_mean (each sequence's mean, averaged over "
        "sequences).",
    )
    eps_clip: float = Field(
        0.2, gt=0, lt=1, description="PPO ratio clip: the ratio is kept within 1 - eps_clip ..."
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        description="... and 1 + eps_clip_high (DAPO's clip-higher, e.g. 0.28); empty: eps_clip "
        "both ways.",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="The importance ratio per token, or per sequence (GSPO: the geometric mean of "
        "the sequence's token ratios, clipped as one; it brings GSPO's loss_agg "
        "seq_mean_token_mean and clip range eps_clip 3e-4, eps_clip_high 4e-4, each overridable).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: groups whose verifier rewards all agree (before "
        "overlong_buffer's shaping, as DAPO and verl judge them; a reward_model's scores where "
        "the verifier is not in the reward) are dropped and the step "
        "refilled from further prompts until rollout_batch_size groups carry a signal, at most "
        "dynamic_sampling_max_rounds generation rounds. Off by default for every estimator: at "
        'equal generated tokens and wall time it did not lead (BENCHMARKS.md, "Online RL: '
        'dynamic sampling at equal cost (issue 45)"); off, a step trains on the groups it drew '
        "(with advantage grpo, dr_grpo and rloo a group whose rewards agree has advantages 0 and "
        "trains nothing). Set true for DAPO's dynamic sampling (not with algorithm ppo, which "
        "trains every group).",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        ge=2,
        description="dynamic_sampling: generation rounds per step at most (the step's prompts, "
        "then refills of at most rollout_batch_size prompts each, sized by the share of groups "
        "kept so far); a step still short trains on the groups it has.",
    )
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's soft overlong punishment: an answer longer than max_output_tokens - "
        "overlong_buffer tokens loses up to overlong_penalty of its reward, linearly to the bound; "
        "empty: off.",
    )
    overlong_penalty: float = Field(
        1.0, gt=0, description="overlong_buffer: the penalty of an answer at max_output_tokens."
    )
    std_normalize: bool = Field(
        True,
        description="advantage grpo: divide group advantages by their sample standard deviation "
        "(n - 1, as verl and TRL; off: the same as advantage dr_grpo).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference (k3 in the loss; in the reward for ppo and "
        "reinforce_pp); 0: no reference loaded.",
    )
    ppo_epochs: int = Field(1, gt=0, description="Updates over each rollout batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: discount.")
    lambd: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")
    tis_mode: TisMode | None = Field(
        None,
        description="The correction for the engine's mismatch with the actor (engines that "
        "differ by design: bf16, other kernels; batches sampled versions behind: async_train), "
        "as TRL's vllm_importance_sampling_mode names them. The ratio is taken against the "
        "actor's own log-probabilities at the step's start (pi_old, a no-grad pass), and each "
        "token's loss is weighted by r = exp(pi_old - engine): token_truncate min(r, tis_cap) "
        "(verl's rollout_is token, slime's TIS); token_mask r, and a token whose r is outside "
        "[tis_floor, tis_cap] leaves the loss, its numerator and its denominator (ICE-POP, "
        "slime's MIS mask); sequence_truncate and sequence_mask the same with one r per "
        "sequence, the geometric mean of its tokens' (exp of the mean log-ratio over its loss "
        "tokens, verl's geometric level). Empty: off, or token_truncate when tis_cap is set.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="tis_mode's upper threshold: the truncation cap, or the mask's upper bound "
        "(empty: 2.0 for the token modes, as verl's rollout_is_threshold and slime's "
        "tis_upper_bound; 1.001 for the sequence modes, verl's geometric threshold). Set alone, "
        "it turns on token_truncate, verl's tis_imp_ratio_cap.",
    )
    tis_floor: float | None = Field(
        None,
        gt=0,
        description="token_mask and sequence_mask: the lower bound, below tis_cap (empty: "
        "1 / tis_cap, as verl's rollout_rs_threshold_lower and slime's tis_lower_bound).",
    )


def per_token_returns(cfg: AlgorithmOptions) -> bool:
    """Whether advantages come from each token's return (ppo's GAE, reinforce_pp's returns)
    rather than from the group's rewards: the KL to the reference is then a term of each
    token's reward, not of the loss, and the baseline is not the group's (the critic's
    values, the batch's statistics), so a group whose rewards all agree still trains."""
    return cfg.algorithm == "ppo" or cfg.advantage == "reinforce_pp"


@dataclass(frozen=True)
class Correction:
    """The mismatch correction a config asks for: its mode and thresholds, defaults filled."""

    mode: TisMode
    cap: float
    floor: float | None  # the mask modes' lower bound; None for the truncate modes

    @property
    def masks(self) -> bool:
        return self.mode.endswith("_mask")

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")


def correction_of(cfg: Any) -> Correction | None:
    """`tis_mode` with its thresholds (`tis_cap` alone: token_truncate, as before the modes);
    None when off. One rule for the plan (`stages.rl.algo.combinations`) and the run."""
    mode: TisMode | None = cfg.tis_mode
    if mode is None and cfg.tis_cap is not None:
        mode = "token_truncate"
    if mode is None:
        return None
    cap = cfg.tis_cap
    if cap is None:
        cap = GEOMETRIC_CAP if mode.startswith("sequence") else TOKEN_CAP
    floor = None
    if mode.endswith("_mask"):
        floor = cfg.tis_floor if cfg.tis_floor is not None else 1.0 / cap
    return Correction(mode, cap, floor)
