"""The `verifier` block several stage kinds share, and its plan-time rule.

Input: the YAML block. Output: a validated `Verifier` and the located diagnostics of
`check_verifier`. What runs it: `stages.lib.verify` (a verifier's score). Backends are
`stages.lib.backends`'; the `model:` and `environment:` fields are
`stages.lib.model.declared`'s and `stages.lib.env.field`'s; `auto` counts and callables,
`stages.lib.block`'s.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.block import Block, check_callable, named_or_callable

VERIFIER_KINDS = ("reasoning_gym", "exact_match", "regex", "math")


def _verifier_kind(value: Any) -> Any:
    return named_or_callable(value, VERIFIER_KINDS, "module:function")


class Verifier(Block):
    """How an answer is scored into a reward."""

    kind: Annotated[str, BeforeValidator(_verifier_kind)] = Field(
        "reasoning_gym",
        description="reasoning_gym (the task's own scorer), exact_match, regex, math, or a "
        "callable 'module:function'.",
    )
    pattern: str | None = Field(
        None, description="For kind regex: the answer is correct when this regex matches."
    )
    answer_field: str = Field(
        "answer", description="The input row's field holding the reference answer."
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
    run imports it from Python's path: `stages.lib.verify`)."""
    return check_callable(ctx, f"{path}.kind", "verifier", verifier.kind)
