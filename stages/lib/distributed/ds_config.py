"""The DeepSpeed config (`ds_config`) generated from resolved train settings.

`build_ds_config(cfg, world_size)` turns resolved DeepSpeed settings (the train
and rl kinds' configs have them as fields) into the dict DeepSpeed
takes, the same on GPU (NCCL) and on CPU (gloo). The optimizer is left to the
caller (a torch AdamW passed to `deepspeed.initialize`), so the config allows
it under offload and untested-optimizer checks.
"""

from __future__ import annotations

from typing import Any

from engine.errors import Diagnostic
from engine.plan.memory import ds_buckets, read_shape
from engine.stage import MemoryNeed, ResolveContext
from stages.lib.distributed.trainer_fields import TrainedSettings


def grad_accumulation(cfg: TrainedSettings, world_size: int) -> int:
    """Micro batches per optimizer step on each rank; resolve checks that it divides."""
    per_step = cfg.micro_train_batch_size * world_size
    return max(1, cfg.train_batch_size // per_step)


def build_ds_config(
    cfg: TrainedSettings,
    world_size: int,
    *,
    pin_memory: bool = False,
    model_dir: str | None = None,
) -> dict[str, Any]:
    """The ds_config dict for `cfg` trained on `world_size` ranks; with the model's
    directory, buckets sized from its hidden size (`engine.plan.memory.ds_buckets`)."""
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": True,
    }
    shape = read_shape(model_dir) if model_dir else None
    if shape is not None:
        zero.update(ds_buckets(shape.hidden, cfg.zero_stage))
    if cfg.adam_offload and cfg.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        # torch's own linear, not DeepSpeed's replacement (`input.matmul(weight.t())`), which
        # rounds differently in bf16: the rl engines compute with torch's linear, and the
        # probe after a sync compares the two functions token for token (0.00109 nats apart
        # at step 0 with the replacement; docs/rl/on-policy.md "The probe")
        zero["memory_efficient_linear"] = False
    out: dict[str, Any] = {
        "train_batch_size": cfg.micro_train_batch_size
        * world_size
        * grad_accumulation(cfg, world_size),
        "train_micro_batch_size_per_gpu": cfg.micro_train_batch_size,
        "gradient_accumulation_steps": grad_accumulation(cfg, world_size),
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.bf16},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if getattr(cfg, "deepcompile", False):  # the trainer then calls engine.compile()
        out["compile"] = {"deepcompile": True}
    return out


def check_deepspeed(cfg: TrainedSettings, ctx: ResolveContext, ranks: int) -> list[Diagnostic]:
    """Batch sizes that divide over `ranks` data-parallel ranks, and optimizer offload only
    with ZeRO: the one place these rules live."""
    out = []
    step = cfg.micro_train_batch_size * ranks
    if cfg.train_batch_size % step:
        lower = cfg.train_batch_size - cfg.train_batch_size % step
        options = " or ".join(str(n) for n in (lower, lower + step) if n > 0)
        out.append(
            ctx.error(
                "train_batch_size",
                f"{cfg.train_batch_size} is not divisible by micro_train_batch_size "
                f"{cfg.micro_train_batch_size} x "
                f"{ranks} data-parallel rank(s) = {step}; use {options}",
            )
        )
    if cfg.adam_offload and cfg.zero_stage == 0:
        out.append(
            ctx.error("adam_offload", "optimizer offload needs ZeRO: set zero_stage 1, 2 or 3")
        )
    if getattr(cfg, "deepcompile", False):
        out += _check_deepcompile(cfg, ctx)
    return out


def _check_deepcompile(cfg: Any, ctx: ResolveContext) -> list[Diagnostic]:
    """DeepCompile where DeepSpeed has it: its engine (not the plain torch trainer) on CUDA
    (`deepspeed.compile.util.is_deepcompile_supported`: torch >= 2.6 and the CUDA
    accelerator; on the CPU accelerator DeepSpeed registers none of its compile passes)."""
    lora = getattr(cfg, "lora", None)
    if ctx.gpus == 0:
        why = "this stage runs on the CPU (no GPUs: cluster.gpus, resources.gpus)"
        return [
            ctx.error(
                "deepcompile",
                f"DeepSpeed's DeepCompile runs on CUDA only (torch >= 2.6 and the CUDA "
                f"accelerator); {why}: remove it",
            )
        ]
    if cfg.trainer == "torch" or (lora is not None and lora.load_in_4bit):
        what = "trainer: torch" if cfg.trainer == "torch" else "lora.load_in_4bit (torch trains)"
        return [
            ctx.error(
                "deepcompile",
                f"DeepCompile compiles DeepSpeed's engine, and {what} trains without one: "
                "use trainer deepspeed, or remove deepcompile",
            )
        ]
    return []


def trainer_memory(cfg: Any, model: Any, seq_len: int, role: str = "") -> MemoryNeed:
    """What a trainer configured by `cfg` needs memory for (engine.plan.memory estimates it);
    with `cfg.lora` its adapters alone have gradients and optimizer states."""
    lora = getattr(cfg, "lora", None)
    return MemoryNeed(
        role=role,
        profile="trainer",
        model=model if isinstance(model, str | dict) else model.model_dump(),
        zero_stage=cfg.zero_stage,
        adam_offload=cfg.adam_offload,
        bf16=cfg.bf16,
        gradient_checkpointing=cfg.gradient_checkpointing,
        micro_batch=cfg.micro_train_batch_size,
        seq_len=seq_len,
        sleep=cfg.deepspeed_enable_sleep,
        overlap_comm=cfg.overlap_comm,
        lora_rank=lora.rank if lora is not None else 0,
        lora_targets=lora.targets() if lora is not None else (),
    )


def trainer_memory_changes(cfg: Any) -> list[tuple[str, Any]]:
    """Changes that cut a trainer's memory, cheapest first: shard more, recompute
    activations, smaller micro batches, then optimizer states to the host."""
    out: list[tuple[str, Any]] = []
    for stage in range(cfg.zero_stage + 1, 4):
        out.append(("zero_stage", stage))
    if not cfg.gradient_checkpointing:
        out.append(("gradient_checkpointing", True))
    if cfg.micro_train_batch_size > 1:
        out.append(("micro_train_batch_size", max(1, cfg.micro_train_batch_size // 2)))
    if not cfg.adam_offload and cfg.zero_stage > 0:
        out.append(("adam_offload", True))
    return out
