"""The config blocks several stage kinds share, and their plan-time rules: `backend`, `verifier`.

Input: the YAML blocks. Output: validated `Backend` (openai, vllm or local) and `Verifier`
models; for a kind with a backend (`BackendStageConfig`), the engine's placement, preset and
memory hooks answered by the backend's rules; the derived vLLM settings (`derive_backend`)
and the located diagnostics of `check_model`, `check_backend` and `check_verifier`. What
runs them: `stages.lib.endpoints` (a backend's endpoint), `stages.lib.verify` (a verifier's
score). The `model:` and `environment:` fields are `stages.lib.model.declared`'s and
`stages.lib.env.field`'s; `auto` counts and callables, `stages.lib.block`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from engine.errors import Diagnostic
from engine.stage import Derived, MemoryNeed, ResolveContext, StageConfig
from stages.lib.block import Block, check_callable, named_or_callable
from stages.lib.model.dtypes import PRECISION_HELP, Dtype
from stages.lib.model.path import check_model_ref

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


class OpenAIBackend(Block):
    """Any running OpenAI-compatible endpoint."""

    kind: Literal["openai"] = Field(
        description="Send requests to a running OpenAI-compatible server."
    )
    base_url: str = Field(description="The server's base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="The model name the server expects in each request.")
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the API key; the key is never "
        "written anywhere.",
    )
    endpoint: Literal["chat", "completions"] = Field(
        "chat",
        description="chat: /v1/chat/completions with messages; completions: /v1/completions with a "
        "prompt.",
    )


class VLLMBackend(Block):
    """vLLM's OpenAI server, started and stopped by the stage."""

    kind: Literal["vllm"] = Field(
        description="Start vLLM's OpenAI server for the stage, then stop it."
    )
    model: str | None = Field(
        None,
        description="Checkpoint directory or model id to serve (evaluate: empty, it serves each "
        "checkpoint in turn).",
    )
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
    model: str | None = Field(
        None,
        description="Checkpoint directory (or a reference '@stage' to a train stage's output); "
        "evaluate: empty, it loads each checkpoint in turn.",
    )
    batch_size: int = Field(64, gt=0, description="Prompts generated together in one batch.")
    precision: Dtype = Field(
        "auto", description=PRECISION_HELP + " rl: only auto (the actor's compute dtype)."
    )


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


# -- rules of a backend block, for the kinds that have one ----------------------------------


def backend_preset_path(key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
    """A preset's vLLM setting lands in a `backend: {kind: vllm}` block."""
    backend = data.get("backend")
    vllm = isinstance(backend, dict) and backend.get("kind") == "vllm"
    if vllm and key in VLLMBackend.model_fields and key not in ("kind", "model"):
        return ("backend", key)
    return None


def derive_backend(backend: Any, ctx: ResolveContext, num_repeats: int) -> dict[str, Derived]:
    """Engines from the stage's GPUs, prefix caching for repeated prompts, and half of each
    GPU left to training when vLLM shares its GPUs."""
    if not isinstance(backend, VLLMBackend):
        return {}
    out: dict[str, Derived] = {}
    tp = backend.vllm_tensor_parallel_size
    if ctx.gpus and ctx.gpus % tp == 0:
        what = f"role '{ctx.role}'" if ctx.role else "the stage"
        out["backend.vllm_num_engines"] = Derived(
            ctx.gpus // tp, f"{ctx.gpus} GPUs of {what} / tensor-parallel size {tp}"
        )
    if num_repeats > 1:
        out["backend.enable_prefix_caching"] = Derived(
            True, f"num_repeats {num_repeats} > 1: the samples of a prompt share its KV cache"
        )
    shared = ctx.roles.get("vllm")
    if shared is not None and shared.colocated_with:
        out["backend.vllm_gpu_memory_utilization"] = Derived(
            0.5,
            f"vllm shares its GPUs with {', '.join(shared.colocated_with)}: "
            "leave half for training",
        )
    return out


def backend_gpu_unit(backend: Any) -> int:
    """GPUs one engine of the backend holds on one node: its tensor-parallel size."""
    return backend.vllm_tensor_parallel_size if isinstance(backend, VLLMBackend) else 1


def check_model(backend: Any, ctx: ResolveContext, wanted: bool) -> list[Diagnostic]:
    """A local or vLLM backend names its model when the stage has no other (`wanted`), and
    names none when the stage brings its own models (evaluate's checkpoints)."""
    if not isinstance(backend, LocalBackend | VLLMBackend):
        return []
    if wanted and backend.model is None:
        return [
            ctx.error("backend", f"a '{backend.kind}' backend needs a 'model' to generate with")
        ]
    if not wanted and backend.model is not None:
        return [
            ctx.error(
                "backend.model",
                "this stage generates with each of its checkpoints in turn; "
                "leave backend.model empty",
            )
        ]
    return check_model_ref(ctx, "backend.model", backend.model)


def served_elsewhere(backend: Any) -> str | None:
    """Why a stage with this backend renders no prompt itself (an openai backend), else None."""
    if not isinstance(backend, OpenAIBackend):
        return None
    if backend.endpoint == "completions":
        return "an openai backend's completions endpoint gets each prompt as written"
    return "an openai backend's server renders prompts with its own chat template"


def check_backend(backend: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """A tensor-parallel group on one node, engines x tensor-parallel size = the stage's GPUs,
    and a warning when a shared GPU leaves the trainer little room."""
    if not isinstance(backend, VLLMBackend):
        return []
    per_node, tp = ctx.gpus_per_node, backend.vllm_tensor_parallel_size
    if tp > per_node or per_node % tp:
        fits = ", ".join(str(n) for n in range(1, per_node + 1) if per_node % n == 0)
        return [
            ctx.error(
                "backend.vllm_tensor_parallel_size",
                f"tensor-parallel size {tp} does not fit on a node of {per_node} GPUs "
                "(cluster.gpus_per_node); a tensor-parallel group never spans nodes: "
                f"use {fits}",
            )
        ]
    out = []
    engines = backend.vllm_num_engines
    if ctx.gpus and engines * tp != ctx.gpus:
        what = f"role '{ctx.role}'" if ctx.role else "the stage"
        hint = f"; use vllm_num_engines {ctx.gpus // tp}" if ctx.gpus % tp == 0 else ""
        out.append(
            ctx.error(
                "backend.vllm_num_engines",
                f"{engines} engines x tensor-parallel size {tp} = {engines * tp} GPUs, but {what} "
                f"has {ctx.gpus}{hint}",
            )
        )
    shared = ctx.roles.get("vllm")
    util = backend.vllm_gpu_memory_utilization
    if shared is not None and shared.colocated_with and util > 0.5 and ctx.role == "vllm":
        out.append(
            ctx.warning(
                "backend.vllm_gpu_memory_utilization",
                f"{util} leaves little room for {', '.join(shared.colocated_with)} "
                "on the shared GPUs; the hybrid engine uses 0.5",
            )
        )
    return out


def backend_memory(backend: Any) -> list[MemoryNeed]:
    """A vLLM engine takes its share of each GPU; other backends estimate nothing here."""
    if not isinstance(backend, VLLMBackend):
        return []
    return [
        MemoryNeed(
            profile="engine",
            utilization=backend.vllm_gpu_memory_utilization,
            sleep=backend.vllm_enable_sleep,
        )
    ]


class BackendStageConfig(StageConfig):
    """A kind's config with a `backend` block (collect, evaluate): the engine's placement,
    preset and memory hooks answered by the backend's rules above. The kind declares the
    `backend` field itself (its own default and description)."""

    if TYPE_CHECKING:
        backend: Backend

    def memory_needs(self) -> list[MemoryNeed]:
        return backend_memory(self.backend)

    def gpu_unit(self, role: str | None = None) -> int:
        """A vLLM engine's tensor-parallel group stays on one node."""
        return backend_gpu_unit(self.backend)

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        """vLLM settings go to a `backend: {kind: vllm}` block; the rest to top-level fields."""
        return super().preset_path(key, data) or backend_preset_path(key, data)

    def hub_inputs(self) -> dict[str, str]:
        """An openai backend's model is the name its server knows, not a hub repository."""
        return {} if isinstance(self.backend, OpenAIBackend) else super().hub_inputs()


def check_verifier(
    verifier: Verifier, ctx: ResolveContext, path: str = "verifier"
) -> list[Diagnostic]:
    """A `module:function` verifier's module must be importable where the stage runs (the
    run imports it from Python's path: `stages.lib.verify`)."""
    return check_callable(ctx, f"{path}.kind", "verifier", verifier.kind)
