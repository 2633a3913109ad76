"""Where a trained role's states go while the rollout engine generates, and how they come back.

Input: what a trained role (the rl actor or critic) runs with: its trainer (deepspeed or
torch), ZeRO stage, `adam_offload` and device. Output: a `Sleep`: the method
`stages.lib.distributed.trainer` carries out for `deepspeed_enable_sleep` (hybrid engine: states off
the GPU while the engine generates, back before the next update), and one line saying
what leaves the GPU, for `settings.json`. Light (no torch): plan-time rules read it too.

What the installed DeepSpeed (0.19) offers, and the method chosen for each case:

- `host`: on the CPU the states already live in host memory; nothing moves.
- `offloaded`: `adam_offload` (ZeRO 1-3 on GPU): DeepSpeed's CPU Adam keeps the Adam
  states and the fp32 master weights in host memory and reduces the gradients into host
  buffers: nothing of the optimizer is on the GPU (DeepSpeed's own `offload_states` skips
  them too: engine.py `_refine_include_states`); the reduce buckets stay.
- `trainer`: plain torch, and DeepSpeed at ZeRO-0, whose optimizer is torch's AdamW (fp32)
  or DeepSpeed's unfused bf16 wrapper around it: neither has `offload_states` (only the
  ZeRO optimizers do: runtime/zero/stage_1_and_2.py, stage3.py). The trainer moves the
  Adam moments, and the fp32 master weights the bf16 wrapper holds, to (pinned) host
  memory itself; gradients are already freed after each step (`zero_grad`, set to None).
- `deepspeed`: ZeRO-1/2: DeepSpeed's `offload_states` (any optimizer) moves the fp32
  master weights, the Adam states and the gradient partitions; `reload_states` brings
  them back. The training-precision weights stay: the engine was synced from them.
- `zero3`: ZeRO-3: DeepSpeed's `offload_states` asserts its FusedAdam for the master
  weights and the Adam states (stage3.py), a CUDA op built at run time with nvcc, which
  the ranks do not use (torch's AdamW: the same `exp_avg`/`exp_avg_sq` states). So
  DeepSpeed moves the gradient partitions and buckets (no such requirement), and the
  trainer moves the master weights (`fp32_partitioned_groups_flat`) and the Adam states
  by swapping their storage, as `offload_states` itself does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["host", "offloaded", "trainer", "deepspeed", "zero3"]


@dataclass(frozen=True)
class Sleep:
    """How a role's states leave the GPU and come back, and what moves."""

    method: Method
    how: str

    @property
    def moves(self) -> bool:
        return self.method not in ("host", "offloaded")


def sleep_method(trainer: str, zero_stage: int, adam_offload: bool, device: str) -> Sleep:
    """The method for a role trained by `trainer` (deepspeed or torch) at `zero_stage`,
    with `adam_offload`, on `device` (cpu, cuda or cuda:N)."""
    if not device.startswith("cuda"):
        return Sleep("host", "nothing moves: on the CPU the states already live in host memory")
    if trainer != "deepspeed":
        return Sleep("trainer", "Adam moments moved to pinned host memory by the trainer")
    if adam_offload and zero_stage > 0:
        return Sleep(
            "offloaded",
            "nothing of the optimizer on the GPU: adam_offload keeps the Adam states and "
            "fp32 master weights in host memory (the gradient buckets stay)",
        )
    if zero_stage == 0:
        return Sleep(
            "trainer",
            "Adam moments (and bf16's fp32 master weights) moved to pinned host memory by the "
            "trainer (DeepSpeed has no offload_states without ZeRO)",
        )
    if zero_stage in (1, 2):
        return Sleep(
            "deepspeed",
            "fp32 master weights, Adam states and gradient partitions moved to host memory "
            "by DeepSpeed's offload_states",
        )
    return Sleep(
        "zero3",
        "gradient partitions and buckets moved by DeepSpeed's offload_states; fp32 master "
        "weights and Adam states by the trainer (offload_states asks for FusedAdam there)",
    )
