"""Config pieces shared by several stage kinds: backends, verifiers, `auto` counts."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    model_validator,
)

from engine.errors import found

_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
VERIFIER_KINDS = ("reasoning_gym", "exact_match", "regex", "math")


class Block(BaseModel):
    """A nested config block: frozen, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _count_or_auto(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"expected a positive integer or 'auto', found {found(value)}")


CountOrAuto = Annotated[
    int | Literal["auto"],
    BeforeValidator(_count_or_auto),
    WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"const": "auto"}]}),
]


def _verifier_kind(value: Any) -> Any:
    if not isinstance(value, str) or value in VERIFIER_KINDS or _CALLABLE.match(value):
        return value
    from engine.errors import did_you_mean, one_of

    hint = did_you_mean(value, VERIFIER_KINDS)
    raise ValueError(
        f"expected {one_of((*VERIFIER_KINDS, 'module:function'))}, found '{value}'{hint}"
    )


class Verifier(Block):
    """How an answer is scored into a reward."""

    kind: Annotated[str, BeforeValidator(_verifier_kind)] = Field(
        "reasoning_gym",
        description="reasoning_gym (the task's own scorer), exact_match, regex, math, or a callable 'module:function'.",
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


class OpenAIBackend(Block):
    """Any running OpenAI-compatible endpoint."""

    kind: Literal["openai"] = Field(
        description="Send requests to a running OpenAI-compatible server."
    )
    base_url: str = Field(description="The server's base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="The model name the server expects in each request.")
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the API key; the key is never written anywhere.",
    )
    endpoint: Literal["chat", "completions"] = Field(
        "chat",
        description="chat: /v1/chat/completions with messages; completions: /v1/completions with a prompt.",
    )


class VLLMBackend(Block):
    """vLLM's OpenAI server, started and stopped by the stage."""

    kind: Literal["vllm"] = Field(
        description="Start vLLM's OpenAI server for the stage, then stop it."
    )
    model: str = Field(description="Checkpoint directory or model id to serve.")
    vllm_num_engines: int = Field(1, gt=0, description="Number of vLLM engines (servers).")
    vllm_tensor_parallel_size: int = Field(
        1, gt=0, description="GPUs per engine (tensor parallelism)."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may take (0.5 when colocated with training).",
    )
    vllm_enable_sleep: bool = Field(
        False, description="Let vLLM sleep (free its memory) between generation phases."
    )
    enable_prefix_caching: bool = Field(
        False, description="Reuse KV cache across requests sharing a prefix."
    )
    port: int = Field(0, ge=0, lt=65536, description="Port to serve on; 0 picks a free one.")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for the server to become healthy."
    )


class LocalBackend(Block):
    """Batched generation with transformers in the stage's own process."""

    kind: Literal["local"] = Field(
        description="Generate in-process with transformers on a checkpoint directory."
    )
    model: str = Field(
        description="Checkpoint directory (or a reference '@stage' to a train stage's output)."
    )
    batch_size: int = Field(64, gt=0, description="Prompts generated together in one batch.")


def _backend_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("kind")
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", None)


Backend = Annotated[
    Annotated[OpenAIBackend, Tag("openai")]
    | Annotated[VLLMBackend, Tag("vllm")]
    | Annotated[LocalBackend, Tag("local")],
    Discriminator(_backend_tag),
]
