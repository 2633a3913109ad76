"""`micro_rollout_batch_size`: the batch a rollout engine generates at once, a setting the rl
and collect stages declare (OpenRLHF's `--micro_rollout_batch_size`).

Input: a stage's setting and its `backend` block. Output: the field both kinds declare; the
block that generates in batches of it (`BackendConfig.rollout_batch`: the local engine's
`batch_size`, the rows one batched `generate` call holds; a vLLM server's `--max-num-seqs`,
the sequences its scheduler batches at once, which is what a burst of requests is batched
to); where a preset's value lands (nowhere for a backend that batches nothing of pipe's: a
server someone else runs); and the warning when a config sets it there. Empty (the default)
keeps each block's own batching: the local block's `batch_size`, vLLM's own default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig
from stages.lib.backends.protocol import BackendConfig
from stages.lib.backends.registered import backend_class

KEY = "micro_rollout_batch_size"


def micro_rollout_field() -> Any:
    """The field rl and collect declare."""
    return Field(
        None,
        gt=0,
        description="Samples (prompt x repeat) the rollout engine generates at once: the local "
        "engine's batch (over its block's batch_size), a vLLM server's --max-num-seqs; empty: "
        "the block's own batching. OpenRLHF's --micro_rollout_batch_size: lower it when hitting "
        "OOM (memory_constrained does), raise it for generation throughput.",
    )


def batches_rollouts(backend: type[BackendConfig] | None) -> bool:
    """Whether the backend's engine is pipe's to batch (it answers `rollout_batch`)."""
    return backend is None or backend.rollout_batch is not BackendConfig.rollout_batch


def lands(key: str, data: Mapping[str, Any]) -> bool:
    """False for this setting in a stage whose `backend` block batches nothing of pipe's: a
    preset's value stays out of it (no block written: the kind's default, which batches)."""
    if key != KEY:
        return True
    block = data.get("backend")
    kind = block.get("kind") if isinstance(block, Mapping) else None
    return not isinstance(kind, str) or batches_rollouts(backend_class(kind))


def with_rollout_batch(cfg: StageConfig) -> Any:
    """`cfg` with its backend generating `micro_rollout_batch_size` samples at once (as is
    when empty, or when the backend batches nothing of pipe's)."""
    samples = getattr(cfg, KEY)
    block = cfg.backend.rollout_batch(samples) if samples is not None else None  # type: ignore[attr-defined]
    return cfg if block is None else cfg.model_copy(update={"backend": block})


def check_rollout_batch(
    ctx: ResolveContext, samples: int | None, backend: BackendConfig
) -> list[Diagnostic]:
    """A value set where it would act on nothing is said, never silently dropped."""
    if samples is None or backend.rollout_batch(samples) is not None:
        return []
    return [
        ctx.warning(
            KEY,
            f"the '{backend.kind}' backend's server batches what it is sent: this setting acts on "
            "the engines pipe runs (local, vllm); drop it, or tune num_samples_in_parallel",
        )
    ]
