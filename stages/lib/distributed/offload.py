"""Optimizer states parked in host memory while the rollout engine has the GPU, and back.

Input: the tensors an optimizer owns beyond the model (`optimizer_tensors`: Adam's moments,
fp32 master copies; `state_tensors` for the state alone, e.g. a ZeRO optimizer's inner one).
Output: the same tensor objects, their storage swapped to (pinned) host buffers by
`HostStates.offload` and to fresh device memory by `HostStates.reload`, each returning the
bytes moved. The trainers (`stages.lib.distributed.trainer`) call it where DeepSpeed's own
`offload_states` does not apply (`stages.lib.distributed.sleep` says where).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class HostStates:
    """Tensors parked in host memory by swapping their storage (`tensor.data`), the way
    DeepSpeed's `offload_states` moves its own: whoever holds a tensor (an optimizer's
    state, its parameter groups) sees it move, and the optimizer's state keeps its keys
    (nothing extra lands in a checkpoint). Host buffers (pinned with CUDA) are kept and
    reused at the next offload."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.parked: list[tuple[torch.Tensor, torch.device]] = []
        self.buffers: dict[int, torch.Tensor] = {}

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each tensor into its host buffer and point it there; the bytes moved."""
        moved = 0
        for t in tensors:
            buf = self.buffers.get(id(t))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
                self.buffers[id(t)] = buf
            buf.copy_(t.data)
            self.parked.append((t, t.device))
            t.data = buf
            moved += t.numel() * t.element_size()
        return moved

    def reload(self) -> int:
        """Every parked tensor back on its device, in fresh memory; the bytes moved."""
        moved = 0
        for t, device in self.parked:
            t.data = t.data.to(device, copy=True, non_blocking=self.pin)
            moved += t.numel() * t.element_size()
        if self.pin:
            torch.cuda.synchronize()
        self.parked = []
        return moved


def optimizer_tensors(optimizer: Any, module: torch.nn.Module) -> list[torch.Tensor]:
    """What an optimizer owns beyond the model: the tensors of its state (Adam's moments),
    and the parameters it steps that are not the model's (fp32 master copies)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a DeepSpeed wrapper's torch optimizer
    own = {id(p) for p in module.parameters()}
    out = [p for g in inner.param_groups for p in g["params"] if id(p) not in own]
    return out + state_tensors(inner)


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of a torch optimizer's state (Adam's moments); for a DeepSpeed ZeRO
    optimizer, give its inner torch optimizer (`.optimizer`)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
