"""The DeepSpeed config (`ds_config`) generated from resolved train settings.

`build_ds_config(cfg, world_size)` turns a `TrainConfig` into the dict DeepSpeed
takes, the same on GPU (NCCL) and on CPU (gloo). The optimizer is left to the
caller (a torch AdamW passed to `deepspeed.initialize`), so the config allows
it under offload and untested-optimizer checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.train import TrainConfig


def grad_accumulation(cfg: TrainConfig, world_size: int) -> int:
    """Micro batches per optimizer step on each rank; resolve checks that it divides."""
    per_step = cfg.micro_train_batch_size * world_size
    return max(1, cfg.train_batch_size // per_step)


def build_ds_config(
    cfg: TrainConfig, world_size: int, *, pin_memory: bool = False
) -> dict[str, Any]:
    """The ds_config dict for `cfg` trained on `world_size` ranks."""
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": True,
    }
    if cfg.adam_offload and cfg.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
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
