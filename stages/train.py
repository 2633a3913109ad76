"""train: SFT or DPO on rollouts, through DeepSpeed (or plain torch without it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from engine.stage import StageConfig, StageContext, stage
from stages.common import Block, CountOrAuto


class TinyModel(Block):
    """A small Llama-architecture model built from config, with a tokenizer trained locally."""

    init: Literal["tiny_llama"] = Field(
        "tiny_llama", description="Build a fresh Llama-architecture model."
    )
    hidden_size: int = Field(128, gt=0, description="Width of the model.")
    num_layers: int = Field(2, gt=0, description="Transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Attention heads (must divide hidden_size).")
    intermediate_size: int | None = Field(
        None, gt=0, description="MLP width; empty: 4 x hidden_size."
    )
    vocab_size: int = Field(
        512,
        ge=262,
        description="Byte-level BPE vocabulary trained on the training prompts (256 bytes + specials at least).",
    )
    max_position_embeddings: int = Field(
        512, gt=0, description="Longest sequence the model handles."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide hidden_size {self.hidden_size}"
            )
        return self


def _model_tag(value: Any) -> str:
    return "spec" if isinstance(value, dict | TinyModel) else "path"


ModelRef = Annotated[
    Annotated[str, Tag("path")] | Annotated[TinyModel, Tag("spec")],
    Discriminator(_model_tag),
]


class TrainConfig(StageConfig):
    """Fine-tune a model on the upstream rollouts (or prompts with gold answers)."""

    INPUTS = ("input", "model")
    OUTPUTS = ("output",)

    input: str | None = Field(
        None, description="Training JSONL; empty: the upstream stage's output."
    )
    output: str = Field("checkpoint", description="Checkpoint directory written.")
    algorithm: Literal["sft", "dpo"] = Field(
        "sft", description="sft, or dpo on pairs of rollouts whose rewards differ."
    )
    model: ModelRef = Field(
        default_factory=TinyModel,
        description="A checkpoint directory, a reference '@stage' to a train stage's output, a hub id, or a tiny model spec.",
    )
    target: Literal["completion", "answer"] = Field(
        "completion",
        description="Train on each row's completion (rollouts) or on its gold answer (warm-up).",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    adam_offload: bool = Field(False, description="Offload Adam states to CPU memory (ZeRO).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    packing_samples: bool = Field(
        False, description="Pack several samples into one sequence instead of padding."
    )
    use_dynamic_batch: bool = Field(
        False, description="Form micro batches by a token budget instead of a row count."
    )
    overlap_comm: bool = Field(
        False, description="Overlap gradient communication with backward (ZeRO)."
    )
    deepspeed_enable_sleep: bool = Field(
        False, description="Offload DeepSpeed states while the model is idle."
    )
    async_train: bool = Field(
        False, description="Overlap generation and training (may affect stability)."
    )
    micro_train_batch_size: int = Field(8, gt=0, description="Samples per rank per forward pass.")
    train_batch_size: int = Field(
        64, gt=0, description="Samples per optimizer step, all ranks together."
    )
    max_length: int = Field(
        256, gt=0, description="Longest training sequence in tokens; longer ones are cut."
    )
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field(
        "cosine",
        description="Learning-rate schedule after the linear warm-up: constant, or cosine / linear decay to a tenth of the peak.",
    )
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Fraction of steps spent warming up the learning rate."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_epochs: int = Field(1, gt=0, description="Passes over the data.")
    max_steps: int | None = Field(
        None,
        gt=0,
        description="Total optimizer steps; when set it overrides max_epochs (the data repeats as needed).",
    )
    bf16: bool = Field(False, description="Train in bfloat16 (fp32 otherwise).")
    num_processes: int = Field(
        1, gt=0, description="Ranks launched on CPU (on GPU: one per GPU of the stage)."
    )
    num_threads: CountOrAuto = Field(
        "auto",
        description="Torch threads per rank; auto: 1 or up to 2 (the cores shared among the ranks), whichever measures faster, re-measured every few hundred steps.",
    )
    trainer: Literal["auto", "deepspeed", "torch"] = Field(
        "auto",
        description="auto: DeepSpeed when it is installed, plain torch (AdamW) otherwise.",
    )
    logging_steps: int = Field(
        50, gt=0, description="Log a progress line every this many steps (and at least every 30 s)."
    )
    save_steps: int = Field(
        200,
        gt=0,
        description="Save a resumable checkpoint every this many steps (and always at the end).",
    )
    beta: float = Field(0.1, gt=0, description="dpo: strength of the KL penalty.")
    seed: int = Field(0, description="Seed for data order and initialisation.")


@stage("train", config=TrainConfig)
def train(cfg: TrainConfig, ctx: StageContext) -> dict[str, Any]:
    """Train and write a checkpoint, metrics and a loss curve."""
    from stages.train_run import run_train

    return run_train(cfg, ctx)
