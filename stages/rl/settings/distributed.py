"""The rl stage's placement and sync settings: where and how the trained roles' ranks run,
and how their weights reach the rollout engines.

Input: a stage's config values. Output: the fields of `DistributedSettings`, a base of
`stages.rl.RLConfig`; which weight-sync backend runs is decided from them and the placement
in one place (`stages.rl.sync.choice`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.stage import StageConfig
from stages.lib.block import CountOrAuto
from stages.lib.distributed.trainer_fields import (
    AdamOffload,
    DeepCompile,
    OverlapComm,
    Ranks,
    TrainerSetting,
    ZeroStage,
)


class DistributedSettings(StageConfig):
    """The trainer and its ranks, ZeRO and offload, sleep and async steps, the weight sync."""

    async_train: bool = Field(
        False,
        description="Generate batch k+1 with the previous weights while the actor trains on "
        "batch k.",
    )
    async_queue_size: int = Field(
        1, ge=0, description="async: rollout batches in flight at most (0: synchronous)."
    )
    zero_stage: ZeroStage = Field(0, description="DeepSpeed ZeRO stage of the actor.")
    deepcompile: DeepCompile = False
    adam_offload: AdamOffload = False
    overlap_comm: OverlapComm = False
    deepspeed_enable_sleep: bool = Field(
        False,
        description="Move the actor's and critic's optimizer states off the GPU while the "
        "engine generates (synchronous steps on GPU).",
    )
    vllm_sync_backend: Literal["nccl", "gloo", "disk"] = Field(
        "gloo",
        description="How weights reach the engine: nccl (GPUs), gloo (a process group, CPU too) "
        "or disk (safetensors).",
    )
    sync_timeout_s: float = Field(
        120.0, gt=0, description="A weight sync taking longer fails the step."
    )
    sync_bucket_mb: int = Field(
        256,
        gt=0,
        description="Weights travel to the engines (nccl, gloo) in buckets of this many MiB: the "
        "sending rank holds one bucket beyond its own shard.",
    )
    num_processes: Ranks = Field(1, description="Actor ranks on CPU (on GPU: one per actor GPU).")
    num_threads: CountOrAuto = Field(
        "auto",
        description="Torch threads of each actor rank and of the engine; auto: the cores the "
        "cluster's other Dask workers on the host leave free, shared among the ranks that "
        "compute at once (the actor's, the critic's, and the engine under async_train), at "
        "least 1; settings.json names the count.",
    )
    trainer: TrainerSetting = Field(
        "auto", description="auto: DeepSpeed when installed, plain torch otherwise."
    )

    @property
    def threads(self) -> int:
        """`num_threads` as a count: the stage makes `auto` one when it starts
        (`stages.rl.run.with_threads`), before anything reads it."""
        assert isinstance(self.num_threads, int), "num_threads is resolved when the stage starts"
        return self.num_threads
