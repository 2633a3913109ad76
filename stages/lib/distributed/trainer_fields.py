"""A trained model's settings, declared once for the train kind and rl's settings groups.

Input: nothing (types). Output: each setting's type with its range, and its description where
train and rl describe it alike, as `Annotated` types; `TrainedSettings`, the resolved fields
the DeepSpeed config and the trainer read (either kind's frozen config has them). A config
declares a field with its own default, and its own description where the kinds differ (rl's
actor and critic, rl's steps of rollouts): `zero_stage: ZeroStage = Field(0, description=
"DeepSpeed ZeRO stage.")`, so each kind keeps its own field order. The DeepSpeed config
(`stages.lib.distributed.ds_config`), the trainer (`stages.lib.distributed.trainer`) and the
trainer's choice (`stages.lib.distributed.trainer_choice`) read these fields by name.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

from pydantic import Field

TrainerSetting = Literal["auto", "deepspeed", "torch"]
LrScheduler = Literal["constant", "cosine", "linear"]

ZeroStage = Annotated[int, Field(ge=0, le=3)]
AdamOffload = Annotated[bool, Field(description="Offload Adam states to CPU memory (ZeRO).")]
DeepCompile = Annotated[
    bool,
    Field(
        description="DeepSpeed's compiler (DeepCompile: the model compiled with its ZeRO "
        "passes, `compile: {deepcompile: true}` then `engine.compile()`); CUDA only."
    ),
]
OverlapComm = Annotated[
    bool, Field(description="Overlap gradient communication with backward (ZeRO).")
]
MicroBatchSize = Annotated[int, Field(gt=0, description="Samples per rank per forward pass.")]
BatchSize = Annotated[int, Field(gt=0)]
MaxLength = Annotated[int, Field(gt=0)]
LearningRate = Annotated[float, Field(gt=0)]
WarmupRatio = Annotated[float, Field(ge=0, lt=1)]
WeightDecay = Annotated[float, Field(ge=0, description="AdamW weight decay.")]
Bf16 = Annotated[bool, Field(description="Train in bfloat16 (fp32 otherwise).")]
Ranks = Annotated[int, Field(gt=0)]
RingAttnSize = Annotated[
    int,
    Field(
        ge=1,
        description="Sequence parallelism: ranks that split each sequence between them "
        "(DeepSpeed-Ulysses attention: an all-to-all gives each rank the whole sequence for "
        "its share of the heads); the ranks form data-parallel groups of this many, so it "
        "divides the ranks and the model's heads. 1: off.",
    ),
]


class TrainedSettings(Protocol):
    """The resolved settings a trained model's ds_config and trainer are made of."""

    @property
    def zero_stage(self) -> int: ...
    @property
    def adam_offload(self) -> bool: ...
    @property
    def overlap_comm(self) -> bool: ...
    @property
    def bf16(self) -> bool: ...
    @property
    def micro_train_batch_size(self) -> int: ...
    @property
    def train_batch_size(self) -> int: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def warmup_ratio(self) -> float: ...
    @property
    def lr_scheduler(self) -> LrScheduler: ...
