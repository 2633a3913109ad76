"""The `verifier` block several stage kinds share, and its plan-time rule.

Input: the YAML block. Output: a validated `Verifier` and the located diagnostics of
`check_verifier`. What runs it: `stages.lib.verify` (a verifier's score; `kind: judge`, an
LLM grading answers: `stages.lib.judge`). Backends are `stages.lib.backends`'; the `model:` and
`environment:` fields are `stages.lib.model.declared`'s and `stages.lib.env.field`'s; `auto`
counts and callables, `stages.lib.block`'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.backends.registered import Backend
from stages.lib.block import Block, check_callable, named_or_callable

VERIFIER_KINDS = ("reasoning_gym", "exact_match", "regex", "math", "judge")
PLACEHOLDERS = ("question", "answer", "reference")
# the judge's settings: each acts with `kind: judge` only
JUDGE_FIELDS = (
    "backend",
    "template",
    "score_regex",
    "score_json_field",
    "score_range",
    "concurrency",
    "judge_max_tokens",
    "judge_timeout_s",
)


def _verifier_kind(value: Any) -> Any:
    return named_or_callable(value, VERIFIER_KINDS, "module:function")


class Verifier(Block):
    """How an answer is scored into a reward."""

    kind: Annotated[str, BeforeValidator(_verifier_kind)] = Field(
        "reasoning_gym",
        description="reasoning_gym (the task's own scorer), exact_match, regex, math, judge (an "
        "LLM grades the answer), or a callable 'module:function'.",
    )
    pattern: str | None = Field(
        None, description="For kind regex: the answer is correct when this regex matches."
    )
    answer_field: str = Field(
        "answer", description="The input row's field holding the reference answer."
    )
    backend: Backend | None = Field(
        None,
        description="For kind judge: the judge model's backend, openai (a served judge: base_url, "
        "model) or local (a checkpoint run in the stage's process).",
    )
    template: str | None = Field(
        None,
        description="For kind judge: the judge's prompt, with {question}, {answer} (the whole "
        "completion) and {reference} (the row's answer_field); other braces doubled: {{ }}.",
    )
    score_regex: str | None = Field(
        None,
        description="For kind judge: the score is this regex's first group in the judge's answer "
        "(the first match).",
    )
    score_json_field: str | None = Field(
        None,
        description="For kind judge, instead of score_regex: the score is this field of the first "
        "JSON object in the judge's answer.",
    )
    score_range: list[float] = Field(
        [0.0, 1.0],
        min_length=2,
        max_length=2,
        description="For kind judge: the judge's scale [lo, hi], mapped linearly onto [0, 1] "
        "(clipped).",
    )
    concurrency: int = Field(
        8, gt=0, description="For kind judge: requests in flight at once (local: the batch)."
    )
    judge_max_tokens: int = Field(
        256, gt=0, description="For kind judge: the judge's answer, at most this many tokens."
    )
    judge_timeout_s: float = Field(
        120.0, gt=0, description="For kind judge: seconds per request to a served judge."
    )

    @model_validator(mode="after")
    def _regex_needs_pattern(self) -> Verifier:
        if self.kind == "regex" and not self.pattern:
            raise ValueError("verifier kind 'regex' needs a 'pattern'")
        return self


def check_verifier(
    verifier: Verifier, ctx: ResolveContext, path: str = "verifier"
) -> list[Diagnostic]:
    """A `module:function` verifier's module must be importable where the stage runs (the
    run imports it from Python's path: `stages.lib.verify`); a judge's block is complete and
    its template and score rule usable; a judge's setting on another kind acts on nothing."""
    if verifier.kind == "judge":
        return check_judge(verifier, ctx, path)
    out = [
        ctx.error(
            f"{path}.{name}", f"acts with kind 'judge' only; this verifier is '{verifier.kind}'"
        )
        for name in JUDGE_FIELDS
        if f"{path}.{name}" in ctx.explicit
    ]
    return out + check_callable(ctx, f"{path}.kind", "verifier", verifier.kind)


def check_judge(verifier: Verifier, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    """The located refusals of a judge block that could not grade (`stages.lib.judge`)."""
    out: list[Diagnostic] = []
    backend = verifier.backend
    if backend is None:
        out.append(ctx.error(f"{path}.kind", "kind 'judge' needs a 'backend' (openai or local)"))
    elif backend.in_process() is None and not backend.SERVES_OWN_MODEL:
        out.append(
            ctx.error(
                f"{path}.backend.kind",
                f"a judge's backend '{backend.kind}' is not supported: use openai (serve the "
                "judge yourself, e.g. with vLLM, and give its base_url) or local",
            )
        )
    elif backend.in_process() is not None:
        out += _check_local_model(str(backend.model or ""), ctx, f"{path}.backend.model")
    if verifier.template is None:
        out.append(ctx.error(f"{path}.kind", "kind 'judge' needs a 'template'"))
    else:
        out += _check_template(verifier.template, ctx, f"{path}.template")
    if (verifier.score_regex is None) == (verifier.score_json_field is None):
        out.append(
            ctx.error(
                f"{path}.kind", "kind 'judge' needs one of 'score_regex' or 'score_json_field'"
            )
        )
    elif verifier.score_regex is not None:
        out += _check_regex(verifier.score_regex, ctx, f"{path}.score_regex")
    lo, hi = verifier.score_range
    if not lo < hi:
        out.append(ctx.error(f"{path}.score_range", f"expected lo < hi, found [{lo:g}, {hi:g}]"))
    if verifier.pattern is not None:
        out.append(
            ctx.error(f"{path}.pattern", "acts with kind 'regex' only; this verifier is 'judge'")
        )
    return out


def _check_template(template: str, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    from string import Formatter

    try:
        names = {name for _, name, _, _ in Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return [ctx.error(path, f"not a template: {exc}; write a literal brace as {{{{ or }}}}")]
    out = []
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        shown = ", ".join(f"{{{n}}}" for n in unknown)
        out.append(
            ctx.error(
                path,
                f"unknown placeholder {shown}; the placeholders are {{question}}, "
                "{answer} and {reference} (a literal brace: {{ or }})",
            )
        )
    missing = [f"{{{n}}}" for n in ("question", "answer") if n not in names]
    if missing:
        out.append(ctx.error(path, f"the template has no {' and no '.join(missing)}"))
    return out


def _check_regex(pattern: str, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        return [ctx.error(path, f"not a regular expression: {exc}")]
    if compiled.groups < 1:
        return [
            ctx.error(
                path, "the regex has no group; its first group is the score, e.g. 'Score: (\\d+)'"
            )
        ]
    return []


def _check_local_model(model: str, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    """A local judge's checkpoint folder is not resolved against the pipeline's folder (a
    stage's own `model:` is): a relative one that exists there is refused, with its absolute
    path, rather than read against whatever folder the worker runs in."""
    import os

    if not model or os.path.isabs(model) or not ctx.pipeline_dir:
        return []
    there = os.path.join(ctx.pipeline_dir, model)
    if not os.path.exists(there):
        return []
    return [
        ctx.error(
            path,
            f"a judge's checkpoint is not resolved against the pipeline's folder; write it "
            f"absolute: '{os.path.normpath(there)}'",
        )
    ]
