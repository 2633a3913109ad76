"""train: SFT or DPO on rollouts, or a reward model on preference pairs, through DeepSpeed (or
plain torch without it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import MemoryNeed, ResolveContext, StageConfig, stage
from stages.lib.block import CountOrAuto
from stages.lib.builders.recipe import TinyModel
from stages.lib.chat.template import (
    ChatTemplate,
    PromptTemplate,
    check_chat_template,
)
from stages.lib.config import Verifier, check_verifier
from stages.lib.distributed.ds_config import trainer_memory, trainer_memory_changes
from stages.lib.distributed.seqpar_rules import (
    check_ring_attn,
    data_parallel_ranks,
    per_rank_length,
)
from stages.lib.distributed.trainer_fields import (
    AdamOffload,
    BatchSize,
    Bf16,
    DeepCompile,
    LearningRate,
    LrScheduler,
    MaxLength,
    MicroBatchSize,
    OverlapComm,
    Ranks,
    RingAttnSize,
    TrainerSetting,
    WarmupRatio,
    WeightDecay,
    ZeroStage,
)
from stages.lib.model.declared import ModelRef
from stages.lib.model.dtypes import SAVE_DTYPE_HELP, Dtype
from stages.lib.model.gguf import memory_model
from stages.lib.model.lora import LORA_HELP, LoraBlock
from stages.lib.model.lora.refusals import check_lora
from stages.lib.model.path import check_model_ref


class TrainConfig(StageConfig):
    """Fine-tune a model on the upstream rollouts (or prompts with gold answers)."""

    SPANS_NODES = True  # one torch.distributed job: each worker starts its local ranks
    INPUTS = ("input", "model", "eval_input", "chat_template")
    MODEL_INPUTS = ("model", "chat_template")
    OUTPUTS = ("output",)
    OUTPUT_TYPES: ClassVar[dict[str, str]] = {"output": "checkpoint"}

    input: str | None = Field(
        None, description="Training JSONL; empty: the upstream stage's output."
    )
    output: str = Field("checkpoint", description="Checkpoint directory written.")
    algorithm: Literal["sft", "dpo", "rm"] = Field(
        "sft",
        description="sft; dpo on pairs of rollouts whose rewards differ; rm: a Bradley-Terry "
        "reward model (a scalar head, saved as a ...ForSequenceClassification with one label) on "
        "chosen/rejected pairs, or on rollouts paired as dpo pairs them.",
    )
    model: ModelRef = Field(
        default_factory=TinyModel,
        description="A checkpoint directory, a .gguf file (converted once into one), a reference "
        "'@stage' to a train stage's output, a hub id, or a tiny model spec.",
    )
    chat_template: ChatTemplate = None
    prompt_template: PromptTemplate = None
    target: Literal["completion", "answer"] = Field(
        "completion",
        description="Train on each row's completion (rollouts) or on its gold answer (warm-up).",
    )
    zero_stage: ZeroStage = Field(0, description="DeepSpeed ZeRO stage.")
    deepcompile: DeepCompile = False
    adam_offload: AdamOffload = False
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    packing_samples: bool = Field(
        False, description="Pack several samples into one sequence instead of padding."
    )
    use_dynamic_batch: bool = Field(
        False, description="Form micro batches by a token budget instead of a row count."
    )
    overlap_comm: OverlapComm = False
    deepspeed_enable_sleep: bool = Field(
        False, description="Offload DeepSpeed states while the model is idle."
    )
    async_train: bool = Field(
        False, description="Overlap generation and training (may affect stability)."
    )
    micro_train_batch_size: MicroBatchSize = 8
    train_batch_size: BatchSize = Field(
        64, description="Samples per optimizer step, all ranks together."
    )
    max_length: MaxLength = Field(
        256, description="Longest training sequence in tokens; longer ones are cut."
    )
    ring_attn_size: RingAttnSize = 1
    learning_rate: LearningRate = Field(1e-3, description="Peak learning rate.")
    lr_scheduler: LrScheduler = Field(
        "cosine",
        description="Learning-rate schedule after the linear warm-up: constant, or cosine / linear "
        "decay to a tenth of the peak.",
    )
    warmup_ratio: WarmupRatio = Field(
        0.03, description="Fraction of steps spent warming up the learning rate."
    )
    weight_decay: WeightDecay = 0.0
    max_epochs: int = Field(1, gt=0, description="Passes over the data.")
    max_steps: int | None = Field(
        None,
        gt=0,
        description="Total optimizer steps; when set it overrides max_epochs (the data repeats as "
        "needed).",
    )
    bf16: Bf16 = False
    save_dtype: Dtype = Field("auto", description=SAVE_DTYPE_HELP)
    num_processes: Ranks = Field(
        1, description="Ranks launched on CPU (on GPU: one per GPU of the stage)."
    )
    num_threads: CountOrAuto = Field(
        "auto",
        description="Torch threads per rank; auto: 1 or up to 2 (the cores shared among the "
        "ranks), whichever measures faster, re-measured every few hundred steps.",
    )
    trainer: TrainerSetting = Field(
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
    margin: float | str = Field(
        0.0,
        description="rm: the loss is -log sigmoid(r_chosen - r_rejected - margin); a number for "
        "every pair, or the name of a pair row's field holding its own (e.g. 'margin').",
    )
    eval_input: str | None = Field(
        None,
        description="Held-out prompts scored greedily every eval_steps steps (e.g. "
        "'@data.val_output'); rm: held-out pairs, scored by pairwise accuracy then and at the end.",
    )
    target_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Stop once the held-out accuracy reaches this (max_steps stays the cap): a "
        "warm-up that ends where the model is, not at a step count.",
    )
    eval_steps: int = Field(100, gt=0, description="Score eval_input every this many steps.")
    eval_limit: int = Field(200, gt=0, description="Held-out prompts (rm: pairs) scored at most.")
    eval_max_tokens: int = Field(16, gt=0, description="Most tokens of a held-out answer.")
    verifier: Verifier = Field(
        default_factory=Verifier, description="How held-out answers are scored."
    )
    seed: int = Field(0, description="Seed for data order and initialisation.")
    lora: LoraBlock | None = Field(None, description=LORA_HELP)

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """Batch sizes that divide over the data-parallel ranks (one rank per GPU, or
        num_processes on CPU, in groups of ring_attn_size); offload only with ZeRO."""
        from stages.lib.distributed.ds_config import check_deepspeed
        from stages.train.objective import check_objective

        ranks = ctx.gpus or self.num_processes
        out = check_deepspeed(self, ctx, data_parallel_ranks(ranks, self.ring_attn_size))
        model = self.model if isinstance(self.model, str) else self.model.model_dump()
        out += check_ring_attn(self, ctx, ranks, memory_model(model))
        out += check_objective(self, ctx)
        out += check_model_ref(ctx, "model", self.model)
        out += check_lora(self.lora, ctx, self, ctx.gpus)
        out += check_chat_template(
            ctx, self.chat_template, self.prompt_template, [("model", self.model)]
        )
        if self.target_accuracy is not None and self.eval_input is None:
            out.append(
                ctx.error(
                    "target_accuracy",
                    "a target accuracy needs held-out prompts to measure it: set eval_input",
                )
            )
        if self.eval_input is not None and self.algorithm != "rm":  # it scores held-out answers
            out += check_verifier(self.verifier, ctx)
        return out

    def memory_needs(self) -> list[MemoryNeed]:
        """The trainer's weights, gradients, optimizer states and activations; with DPO the
        frozen reference too, whole and in fp32 on every rank's device, as the ranks load it
        (`stages.train.worker`; with LoRA the reference is the policy's own base)."""
        seq = per_rank_length(self.max_length, self.ring_attn_size)  # a rank's share of it
        needs = [trainer_memory(self, memory_model(self.model), seq)]
        if self.algorithm == "dpo" and self.lora is None:
            model = self.model if isinstance(self.model, str) else self.model.model_dump()
            model = memory_model(model)
            needs.append(MemoryNeed("dpo_reference", "frozen", model, inside="stage"))
        return needs

    def memory_changes(self) -> list[tuple[str, Any]]:
        return trainer_memory_changes(self)

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Final loss (from the first), steps, tokens/s, and held-out accuracy if scored."""
        if result.get("final_loss") is None:
            return []
        line = (
            f"final loss {result['final_loss']:.4f} (from {result.get('initial_loss') or 0:.4f}) "
            f"after {result.get('steps', 0)} steps, {result.get('tokens_per_s') or 0:.0f} tokens/s"
        )
        if result.get("eval_accuracy") is not None:
            pairwise = " pairwise" if result.get("algorithm") == "rm" else ""
            line += f", held-out{pairwise} accuracy {result['eval_accuracy']:.1%}"
        return [line]


stage("train", config=TrainConfig, run="stages.train.run:run_train")
