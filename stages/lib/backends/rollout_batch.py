"""`micro_rollout_batch_size`: the batch a rollout engine generates at once, a setting the rl
and collect stages declare (OpenRLHF's `--micro_rollout_batch_size`).

Input: a stage's setting and its `backend` block. Output: the field both kinds declare; the
block that generates in batches of it (`BackendConfig.rollout_batch`: the local engine's
`batch_size`, the rows one batched `generate` call holds; a vLLM server's `--max-num-seqs`,
the sequences its scheduler batches at once, which is what a burst of requests is batched
to), derived at plan time into that block setting (`derive_rollout_batch`: `pipe plan
--explain` shows `backend.batch_size` or `backend.vllm_max_num_seqs` with this setting as its
reason, and the run reads the block as planned); where a preset's value lands (nowhere for a
backend that batches nothing of pipe's: a server someone else runs); the warning when a
config sets it there; and the refusal when the block's own setting is set to another value
beside it. Empty (the default) keeps each block's own batching: the local block's
`batch_size`, vLLM's own default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, StageConfig
from stages.lib.backends.protocol import BackendConfig
from stages.lib.backends.registered import backend_class

KEY = "micro_rollout_batch_size"
PRESETS = ("memory ", "profile ")  # how `pipe plan --explain` names a preset's value


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
    """Whether the backend's engine is pipe's to batch (it has a `ROLLOUT_BATCH` setting)."""
    return backend is None or backend.ROLLOUT_BATCH is not None


def lands(key: str, data: Mapping[str, Any]) -> bool:
    """False for this setting in a stage whose `backend` block batches nothing of pipe's: a
    preset's value stays out of it (no block written: the kind's default, which batches)."""
    if key != KEY:
        return True
    block = data.get("backend")
    kind = block.get("kind") if isinstance(block, Mapping) else None
    return not isinstance(kind, str) or batches_rollouts(backend_class(kind))


def _batched(cfg: StageConfig) -> tuple[str, int] | None:
    """The block setting `micro_rollout_batch_size` sets and its value (None: empty, or a
    backend that batches nothing of pipe's)."""
    samples = getattr(cfg, KEY)
    field = cfg.backend.ROLLOUT_BATCH  # type: ignore[attr-defined]
    return None if samples is None or field is None else (field, samples)


def derive_rollout_batch(cfg: StageConfig, ctx: ResolveContext) -> dict[str, Derived]:
    """The backend's batch setting from `micro_rollout_batch_size` (a setting of the block's
    own, set in the config, keeps its value: `check_rollout_batch` refuses a conflict); a
    stage that writes no backend block gets its kind's default one written out."""
    found = _batched(cfg)
    if found is None:
        return {}
    field, samples = found
    why = f"micro_rollout_batch_size {samples}: the samples the engine generates at once"
    out = {f"backend.{field}": Derived(samples, why)}
    if not any(p == "backend" or p.startswith("backend.") for p in ctx.explicit):
        kind = cfg.backend.kind  # type: ignore[attr-defined]
        out["backend.kind"] = Derived(kind, "the stage's default backend, whose batch it sets")
    return out


def with_rollout_batch(cfg: StageConfig) -> Any:
    """`cfg` with its backend generating `micro_rollout_batch_size` samples at once (as is
    when empty, or when the backend batches nothing of pipe's): what the plan derives, for a
    config built without a plan."""
    samples = getattr(cfg, KEY)
    block = cfg.backend.rollout_batch(samples) if samples is not None else None  # type: ignore[attr-defined]
    return cfg if block is None else cfg.model_copy(update={"backend": block})


def check_rollout_batch(ctx: ResolveContext, cfg: StageConfig) -> list[Diagnostic]:
    """A value set where it would act on nothing is said, never silently dropped; set beside
    the block's own setting at another value, one of the two would act on nothing: refused
    when both are the config's, said when this one is a preset's (the config's wins)."""
    samples = getattr(cfg, KEY)
    backend: BackendConfig = cfg.backend  # type: ignore[attr-defined]
    if samples is None:
        return []
    found = _batched(cfg)
    if found is None:
        return [
            ctx.warning(
                KEY,
                f"the '{backend.kind}' backend's server batches what it is sent: this setting "
                "acts on the engines pipe runs (local, vllm); drop it, or tune "
                "num_samples_in_parallel",
            )
        ]
    field, _ = found
    own = getattr(backend, field)
    if f"backend.{field}" not in ctx.explicit or own == samples:
        return []
    if not ctx.source(KEY).startswith(PRESETS):  # the config's own, as is the block's
        return [
            ctx.error(
                KEY,
                f"the engine generates {samples} samples at once by this setting and {own} by "
                f"backend.{field} ({ctx.source(f'backend.{field}')}): set one of them",
            )
        ]
    return [
        ctx.warning(
            f"backend.{field}",
            f"{own} set here, so the preset's micro_rollout_batch_size {samples} does not act: "
            "the engine generates this many samples at once",
        )
    ]
