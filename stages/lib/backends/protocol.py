"""The protocol every generation backend implements: a config block that knows its own rules.

Input: a backend block of a stage's config (`backend: {kind: ...}`), validated into the
backend's own model (a subclass of `BackendConfig`, found by its `kind` in
`stages.lib.backends.registered`). Output: what stage kinds ask of it, so that no kind names a
backend:

- what it is (class attributes): whether its `model` is a name a server knows rather than a
  checkpoint the stage loads (`SERVES_OWN_MODEL`), whether its requests carry vLLM's sampling
  fields (`VLLM_SAMPLING`), how it serves as the rl stage's rollout engine (`RL_ENGINE`);
- its plan hooks: the GPUs one engine holds on a node (`gpu_unit`), the GPUs it starts
  (`engine_gpus`), its memory (`memory_needs`), the preset settings it takes
  (`takes_preset`), derived settings (`derive`), its checks (`check`, `check_rl`), why a
  stage renders no prompt for it (`served_elsewhere`), whether it takes conversations
  (`conversation_problem`);
- where requests go: `open_endpoint` (an OpenAI-compatible HTTP endpoint, open for a block: a
  server it starts and stops, with its secret) or `in_process` (generation in the stage's own
  process), one of the two;
- the precision it loads checkpoints in (`load_dtype`), and a copy serving another model
  (`serving`).

A backend module holds its config model (light: pydantic only) and imports what it runs
(servers, torch) inside the methods that run it, so `pipe validate` imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from engine.errors import Diagnostic
from engine.stage import Derived, MemoryNeed, ResolveContext
from stages.lib.block import Block
from stages.lib.model.path import check_model_ref

if TYPE_CHECKING:
    from stages.lib.backends.endpoint import Endpoint, Serving
    from stages.lib.model.generate import Generation

RLEngine = Literal["in_process", "servers"]


class InProcess(Protocol):
    """A backend that generates in the stage's own process, on the stage's device."""

    @property
    def batch_size(self) -> int: ...

    def generate(
        self, model: str, prompts: Sequence[Any], **options: Any
    ) -> list[list[Generation]]:
        """Answers to `prompts` (strings or message lists, rendered by the chat template):
        `options` are `device`, `dtype`, `batch_size` (default: the block's) and the sampling
        (num_samples, temperature, top_p, max_new_tokens, seed)."""
        ...

    def load(self, model: str, device: str, dtype: str | None) -> tuple[Any, Any]:
        """The model and tokenizer, loaded once for many calls (multi-turn episodes)."""
        ...


class BackendConfig(Block):
    """A generation backend's config block and its rules; each backend subclasses it with its
    own `kind: Literal[...]` and fields (declaring `model` itself, where its fields put it)."""

    if TYPE_CHECKING:
        kind: str
        model: str | None

    SERVES_OWN_MODEL: ClassVar[bool] = False
    """`model` is the name a running server knows: the stage loads no checkpoint, resolves no
    hub id, and the server renders prompts with its own chat template."""
    VLLM_SAMPLING: ClassVar[bool] = True
    """Requests carry vLLM's sampling fields (top_k, min_p, ...: `stages.lib.api.sampling`)."""
    RL_ENGINE: ClassVar[RLEngine | None] = None
    """How it serves as the rl stage's rollout engine: "in_process" (a copy of the policy in
    the stage's processes), "servers" (servers it starts, which take the actor's weights by
    the weight-sync route), or None: it cannot take the actor's weights."""
    ROLLOUT_BATCH: ClassVar[str | None] = None
    """The block's setting for the sequences its engine generates at once, which a stage's
    `micro_rollout_batch_size` sets (`stages.lib.backends.rollout_batch`); None: its engine is
    not pipe's to batch."""

    # -- plan hooks ------------------------------------------------------------------------

    def gpu_unit(self) -> int:
        """GPUs one engine of the backend holds on one node."""
        return 1

    def engine_gpus(self) -> int:
        """GPUs the backend's engines hold when it starts them itself (`pipe tune`)."""
        return 0

    def memory_needs(self) -> list[MemoryNeed]:
        """What its engines take of each GPU (nothing: it estimates nothing here)."""
        return []

    @classmethod
    def takes_preset(cls, key: str) -> bool:
        """Whether a preset's setting `key` lands in this block."""
        return False

    def derive(self, ctx: ResolveContext, num_repeats: int) -> dict[str, Derived]:
        """Settings derived from the stage's GPUs and sampling (`backend.`-prefixed paths)."""
        return {}

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """Its plan-time rules (GPUs, nodes, colocation)."""
        return []

    def check_model(self, ctx: ResolveContext, wanted: bool) -> list[Diagnostic]:
        """A backend that loads a checkpoint names one when the stage has no other
        (`wanted`), and none when the stage brings its own (evaluate's checkpoints)."""
        if self.SERVES_OWN_MODEL:
            return []
        if wanted and self.model is None:
            return [
                ctx.error("backend", f"a '{self.kind}' backend needs a 'model' to generate with")
            ]
        if not wanted and self.model is not None:
            return [
                ctx.error(
                    "backend.model",
                    "this stage generates with each of its checkpoints in turn; "
                    "leave backend.model empty",
                )
            ]
        return check_model_ref(ctx, "backend.model", self.model)

    def check_rl(self, ctx: ResolveContext, bf16: bool) -> list[Diagnostic]:
        """Its rules as the rl stage's rollout engine (one with an `RL_ENGINE`: the rl stage
        refuses the others, `stages.lib.backends.registered.rl_engine_kinds`)."""
        if self.model is not None:
            return [
                ctx.error(
                    "backend.model",
                    "the engine generates with the actor's weights; leave backend.model empty",
                )
            ]
        return []

    def served_elsewhere(self) -> str | None:
        """Why a stage renders no prompt for this backend (its server does), else None."""
        return None

    def conversation_problem(self) -> tuple[str, str] | None:
        """None when it takes conversations (an environment's episodes, sent as messages),
        else the setting at fault and what to do, as (path, message)."""
        return None

    @property
    def sleeps(self) -> bool:
        """Its engines sleep (free their memory) between generation phases."""
        return False

    def rl_engines_record(self, started: int, where: str, *, gpu: bool, async_train: bool) -> str:
        """What the rl stage's `settings.json` says of its engines: `started` engines (0: none
        recorded), `where` they started (" on N node(s) (...)" or "")."""
        return f"{started or 1} {self.kind} engine(s){where}, weights from the actor"

    # -- run hooks -------------------------------------------------------------------------

    def open_endpoint(self, serving: Serving) -> AbstractContextManager[Endpoint]:
        """Its OpenAI-compatible endpoint, open for the duration of the block (a server it
        starts is stopped on exit, also on failure)."""
        raise ValueError(f"backend kind '{self.kind}' has no HTTP endpoint")

    def in_process(self) -> InProcess | None:
        """The in-process generator when it generates in the stage's process, else None."""
        return None

    def load_dtype(self, paths: Sequence[str]) -> tuple[str, str] | None:
        """The one dtype it loads these checkpoints in, and why (None: it loads none here)."""
        return None

    def gguf_dtype(self) -> str:
        """The dtype a GGUF `model` is converted in for it (`stages.lib.model.prepared`)."""
        return "bfloat16"

    def rollout_batch(self, samples: int) -> BackendConfig | None:
        """This block generating `samples` sequences at once (a stage's
        `micro_rollout_batch_size`: its `ROLLOUT_BATCH` setting); None: its engine is not
        pipe's to batch (a server someone else runs batches what it is sent)."""
        if self.ROLLOUT_BATCH is None:
            return None
        return self.model_copy(update={self.ROLLOUT_BATCH: samples})

    def serving(self, model: str) -> BackendConfig:
        """This block generating with `model` (a checkpoint folder) instead of its own."""
        if self.SERVES_OWN_MODEL:
            return self
        return self.model_copy(update={"model": model})

    def hub_model(self) -> bool:
        """Whether `model` may be a hub id to pin (a server's own model name is not)."""
        return not self.SERVES_OWN_MODEL
