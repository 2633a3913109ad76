"""On-policy distillation: the teacher's settings, its per-token term and its figures.

Input: a stage's config values (`teacher`, `distill_coef`); at run time a batch's samples
with their behaviour log-probabilities (the engine's, pi_old) and the teacher's of the same
sampled tokens. Output: the fields of `DistillSettings`, a base of `stages.rl.RLConfig`;
`derive_distill` (`distill_coef` 1.0 where a teacher is set and the weight is not: a rule
in `pipe plan --explain`) and `check_distill`, its rules at `pipe validate` (the teacher a
checkpoint as `model:` is, a weight only with a teacher, the teacher's tokenizer the
policy's where both are on disk, else when the stage starts; what would act on nothing
without a verifier refused); `distill_terms`, each token's term `-distill_coef * (log
pi_old - log pi_teacher)` (the per-token reverse KL as a reward, as Tinker's and verl's
on-policy distillation take it); `distil`, a batch with the teacher's log-probabilities and,
for the group estimators, the term added to each token's advantage; `figures`, the step's
reverse KL per token and the teacher's mean log-probability.

How the term meets the advantages (docs/rl/algorithms.md, "Distillation"):
- grpo, dr_grpo, rloo: each token's advantage is its group's (normalised over the group's
  rewards) plus the term, not normalised, not summed over later tokens (Tinker's
  `incorporate_kl_penalty` with its default discount 0); every group trains, as the term
  differs from token to token even where the group's rewards agree;
- ppo and reinforce_pp: the term is part of each token's reward beside the KL penalty, so it
  enters GAE's or REINFORCE++'s returns (and their whitening) as the KL does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, StageConfig

DISTILL_COEF = 1.0  # the weight where a teacher is set and distill_coef is not


class DistillSettings(StageConfig):
    """On-policy distillation: a frozen teacher scores every sampled token."""

    teacher: str | None = Field(
        None,
        description="On-policy distillation: a teacher checkpoint (a folder, a .gguf file, a hub "
        "id or '@stage') with the policy's tokenizer; it gives each sampled token its "
        "log-probability, and each token's advantage gets -distill_coef x (log pi_old - log "
        "pi_teacher), the per-token reverse KL (the 'teacher' role: its own GPUs in the ratio, "
        "colocated, or inside the actor's ranks); empty: no teacher.",
    )
    distill_coef: float | None = Field(
        None,
        gt=0,
        description="Weight of the teacher's per-token reverse KL in each token's advantage "
        "(with a teacher; empty: 1.0).",
    )


def derive_distill(cfg: Any) -> dict[str, Derived]:
    """`distill_coef` 1.0 where a teacher is set and the weight is not."""
    if cfg.teacher is None or cfg.distill_coef is not None:
        return {}
    return {
        "distill_coef": Derived(
            DISTILL_COEF, "a teacher is set: its per-token reverse KL at full weight"
        )
    }


def distill_coef(cfg: Any) -> float:
    """The weight the run takes (`derive_distill`'s where unset); 0 without a teacher."""
    if cfg.teacher is None:
        return 0.0
    return float(cfg.distill_coef if cfg.distill_coef is not None else DISTILL_COEF)


def distill_terms(
    old: Sequence[float], teacher: Sequence[float], mask: Sequence[float], coef: float
) -> list[float]:
    """Each completion token's term: `-coef * (old - teacher)` on loss tokens (`mask` 1), 0
    on an observation's. Its mean over tokens is `-coef` x the reverse KL per token, KL(pi_old
    || pi_teacher) estimated on pi_old's own samples."""
    return [-coef * (o - t) * m for o, t, m in zip(old, teacher, mask, strict=True)]


def with_terms(samples: Sequence[Any], coef: float) -> list[Any]:
    """The group estimators' samples with per-token advantages: each sample's group
    advantage plus its tokens' terms (the samples carry the teacher's log-probabilities)."""
    out = []
    for s in samples:
        terms = distill_terms(s.old_logprobs, s.teacher_logprobs, s.loss_mask(), coef)
        out.append(replace(s, advantages=tuple(s.advantage + d for d in terms)))
    return out


def figures(samples: Sequence[Any]) -> dict[str, float | None]:
    """The step's `distill_reverse_kl` (the mean of `old - teacher` over its loss tokens:
    the reverse KL per token) and `teacher_logprob_mean` (the teacher's mean log-probability
    of the sampled tokens)."""
    gap = teacher = count = 0.0
    for s in samples:
        for o, t, m in zip(s.old_logprobs, s.teacher_logprobs, s.loss_mask(), strict=True):
            gap += (o - t) * m
            teacher += t * m
            count += m
    if not count:
        return {"distill_reverse_kl": None, "teacher_logprob_mean": None}
    return {"distill_reverse_kl": gap / count, "teacher_logprob_mean": teacher / count}


def distil(c: Any, samples: list[Any]) -> tuple[list[Any], dict[str, float | None]]:
    """The batch with the teacher's log-probabilities of its sampled tokens (from the teacher
    role's own ranks, `c.teacher`, or asked of the actor's ranks, which then hold it) and,
    for the group estimators, the term in each token's advantage (ppo and reinforce_pp add
    it to each token's reward: `stages.rl.algo.ppo.token_rewards`); and the step's figures."""
    from dataclasses import asdict

    from stages.rl.algo.options import per_token_returns

    if c.teacher is not None:
        samples = c.teacher.score(samples)
    else:
        scored = c.request("teacher_logprobs", {"samples": [asdict(s) for s in samples]})
        samples = [
            replace(s, teacher_logprobs=tuple(lp)) for s, lp in zip(samples, scored, strict=True)
        ]
    if not per_token_returns(c.cfg):
        samples = with_terms(samples, distill_coef(c.cfg))
    return samples, figures(samples)


def check_distill(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """The teacher's rules (`cfg`: the stage's `RLConfig`)."""
    from stages.lib.model.path import check_model_ref

    if cfg.teacher is None:
        if cfg.distill_coef is None:
            return []
        return [
            ctx.error(
                "distill_coef",
                "weighs a teacher's per-token reverse KL, and teacher is empty: set teacher "
                "(a checkpoint with the policy's tokenizer), or leave distill_coef out",
            )
        ]
    out = check_model_ref(ctx, "teacher", cfg.teacher)
    if not out:
        out += check_teacher_tokenizer(cfg, ctx)
    if cfg.verifier is None and cfg.environment is None and cfg.reward_model is None:
        out += _teacher_alone(cfg, ctx)
    return out


def check_teacher_tokenizer(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """The teacher's tokenizer files against the policy's, where both are on disk (a folder,
    a hub id in the cache); a tiny-model spec, an earlier stage's output, a GGUF file or a
    hub id not yet fetched is compared when the stage starts (`teacher_tokenizer_error`),
    which a note says."""
    from stages.lib.model.reward_tokens import tokenizer_folder

    policy, teacher = tokenizer_folder(cfg.model), tokenizer_folder(cfg.teacher)
    if policy is None or teacher is None:
        missing = [n for n, f in (("the policy", policy), ("the teacher", teacher)) if f is None]
        has = "have" if len(missing) > 1 else "has"
        later = (
            f"{' and '.join(missing)} {has} no tokenizer on disk yet: the two tokenizers are "
            "compared when the stage starts, and a teacher whose tokenizer differs fails it"
        )
        return [ctx.error("teacher", later, "note")]
    why = teacher_tokenizer_error(policy, teacher)
    return [] if why is None else [ctx.error("teacher", why)]


def teacher_tokenizer_error(policy: str, teacher: str) -> str | None:
    """Why the teacher of folder `teacher` cannot score the ids of the policy of folder
    `policy`, None where their tokenizers agree: its log-probabilities are of the policy's
    token ids, which must mean the same text to both."""
    from stages.lib.model.reward_tokens import tokenizer_difference

    differs = tokenizer_difference(policy, teacher)
    if differs is None:
        return None
    return (
        f"the teacher's tokenizer differs from the policy's ({differs}): it scores the "
        "policy's token ids, which would not be the text it reads; distil from a teacher "
        "with the policy's tokenizer"
    )


def _teacher_alone(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """Distillation alone (no verifier, environment or reward model): what judges a group's
    answers or scores held-out prompts is missing."""
    out = []
    if cfg.dynamic_sampling:
        out.append(
            ctx.error(
                "dynamic_sampling",
                "judges each group on the verifier's rewards, and there is no verifier (null): "
                "the teacher alone would leave every group's rewards equal and drop them all; "
                "name a verifier, or leave dynamic_sampling out",
            )
        )
    if cfg.eval_input:
        out.append(
            ctx.error(
                "eval_input",
                "held-out accuracy is the verifier's, and there is no verifier (null): name "
                "one, or leave eval_input out",
            )
        )
    return out
