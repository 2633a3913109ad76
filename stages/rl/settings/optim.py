"""The rl stage's optimisation settings: how the actor (and the critic) update.

Input: a stage's config values. Output: the fields of `OptimSettings`, a base of
`stages.rl.RLConfig`; the DeepSpeed config (`stages.lib.distributed.ds_config`) and the trainer
(`stages.lib.distributed.trainer`) read them by name, as they read train's.
"""

from __future__ import annotations

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import ResolveContext, StageConfig
from stages.lib.distributed import trainer_fields as trainer
from stages.lib.distributed.seqpar_rules import refuse_ring_attn
from stages.lib.model.lora import LORA_HELP, LoraBlock


class OptimSettings(StageConfig):
    """Batch sizes, learning rate and schedule, sequence length, memory savers, dtype."""

    train_batch_size: trainer.BatchSize = Field(
        256,
        description="Samples per optimizer step (a step's kept samples, cut in pieces of this).",
    )
    micro_train_batch_size: trainer.MicroBatchSize = 64
    learning_rate: trainer.LearningRate = Field(1e-4, description="Actor learning rate.")
    lr_scheduler: trainer.LrScheduler = Field(
        "constant", description="Learning-rate schedule over the run's optimizer steps."
    )
    warmup_ratio: trainer.WarmupRatio = Field(0.0, description="Fraction of updates warming up.")
    weight_decay: trainer.WeightDecay = 0.0
    max_length: trainer.MaxLength = Field(
        512, description="Longest prompt + answer trained on, in tokens."
    )
    ring_attn_size: trainer.RingAttnSize = 1
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    packing_samples: bool = Field(
        False,
        description="Pack each micro batch's samples into rows instead of padding (the actor's, "
        "and the critic's with ppo).",
    )
    use_dynamic_batch: bool = Field(
        False, description="Form micro batches by a token budget instead of a sample count."
    )
    bf16: trainer.Bf16 = False
    lora: LoraBlock | None = Field(
        None, description=f"The actor's adapters; the engines generate with them. {LORA_HELP}"
    )

    def refuse_ring_attn(self, ctx: ResolveContext) -> list[Diagnostic]:
        """`ring_attn_size` > 1 refused: the rl ranks do not split sequences yet (train does:
        `stages.lib.distributed.seqpar`)."""
        missing = (
            "the actor's, critic's and reference's passes and the per-sequence log-probabilities, "
            "values and KL of stages/rl/roles read whole rows; train has it"
        )
        return refuse_ring_attn(self, ctx, missing)
