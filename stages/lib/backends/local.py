"""The `local` backend: batched generation with transformers in the stage's own process.

Input: the block (`model`, `batch_size`, `precision`). Output: its rules (it loads a
checkpoint: a folder, a GGUF or a hub id; as the rl stage's engine it computes in the actor's
dtype) and the in-process generator (`in_process`): answers from `stages.lib.model.generate`,
a checkpoint loaded once per process in the one precision a stage gives all its checkpoints
(`load_dtype`: `stages.lib.model.dtypes.resolve_precision`); and, for what calls a model
over HTTP (NeMo Gym's model server), that generator served as an OpenAI-compatible endpoint
(`open_endpoint`: `stages.lib.serve.policy.PolicyServer`, on 127.0.0.1 with a fresh key).

One name, two sides of one concept (the `local` engine, generation in the stage's own process:
the backend collect and evaluate generate with; `stages/rl/rollout/local.py`: rl's rollout
engine).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.backends.protocol import BackendConfig, InProcess
from stages.lib.model.dtypes import PRECISION_HELP, Dtype

if TYPE_CHECKING:
    from stages.lib.backends.endpoint import Endpoint, Serving
    from stages.lib.model.generate import Generation


class LocalBackend(BackendConfig):
    """Batched generation with transformers in the stage's own process."""

    RL_ENGINE = "in_process"
    ROLLOUT_BATCH = "batch_size"  # the rows one batched `generate` call holds

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

    def check_rl(self, ctx: ResolveContext, bf16: bool) -> list[Diagnostic]:
        out = super().check_rl(ctx, bf16)
        if self.precision != "auto":
            out.append(
                ctx.error(
                    "backend.precision",
                    f"the rl engine computes in the actor's dtype (bf16: {bf16}), which the "
                    f"probe compares it with; found '{self.precision}': leave it auto",
                )
            )
        return out

    def gguf_dtype(self) -> str:
        """Its `precision`; auto: the conversion the run folder holds already (a trainer's of
        this run, in the dtype it computed in), else float32, what transformers loads a
        quantized GGUF in (`stages.lib.model.gguf.converted`)."""
        return str(self.precision)

    def rl_engines_record(self, started: int, where: str, *, gpu: bool, async_train: bool) -> str:
        if started > 1:
            return (
                f"{started} local engines{where}, one per worker of the vllm role (the "
                "controller's own and one in each other worker's task), weights from the actor"
            )
        return "local engine in the stage's process, weights from the actor"

    def in_process(self) -> InProcess | None:
        return self

    @contextmanager
    def open_endpoint(self, serving: Serving) -> Iterator[Endpoint]:
        """The checkpoint, loaded once in this process, served over HTTP for the block: chat
        completions with tools and token ids, `/tokenize` (`docs/policy_endpoint.md`),
        batched up to `batch_size`, the tool calls read with `serving.tool_call_parser`."""
        import secrets

        from stages.lib.backends.endpoint import Endpoint
        from stages.lib.serve.batcher import local_engine
        from stages.lib.serve.policy import PolicyServer, model_len

        assert self.model is not None  # the stage's checks
        loaded = self.load_dtype([self.model])
        model, tokenizer = self.load(self.model, serving.device, loaded[0] if loaded else None)
        key, name = secrets.token_hex(16), self.model.rstrip("/").rsplit("/", 1)[-1]
        server = PolicyServer(
            local_engine(model, tokenizer, self.batch_size),
            tokenizer,
            name=name,
            parser=serving.tool_call_parser,
            api_key=key,
            max_model_len=model_len(model, tokenizer),
            max_batch=self.batch_size,
        )
        with server:
            serving.log.info("local: %s served at %s", self.model, server.base_url)
            yield Endpoint(server.base_url, name, "chat", key, tokenizes=True)

    def load_dtype(self, paths: Sequence[str]) -> tuple[str, str] | None:
        from stages.lib.model.dtypes import resolve_precision

        return resolve_precision(self.precision, paths)

    def generate(
        self,
        model: str,
        prompts: Sequence[Any],
        *,
        device: str = "cpu",
        dtype: str | None = None,
        batch_size: int | None = None,
        **sampling: Any,
    ) -> list[list[Generation]]:
        from stages.lib.model.generate import generate

        return generate(
            model,
            prompts,
            batch_size=batch_size or self.batch_size,
            device=device,
            dtype=dtype,
            **sampling,
        )

    def load(self, model: str, device: str, dtype: str | None) -> tuple[Any, Any]:
        from stages.lib.model.generate import load

        return load(model, device, dtype)
