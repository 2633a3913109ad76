"""Plan, part of the memory model: the parameters of LoRA adapters on a decoder.

Input: a `ModelShape` (`engine.plan.memory`), the adapters' rank and target module names.
Output: the adapters' parameter count and their largest tensor, which the memory model
counts gradients and optimizer states for in place of the frozen base's. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def lora_params(shape: Any, rank: int, targets: Sequence[str]) -> tuple[int, int]:
    """LoRA's parameters on the projections of `shape` (a `ModelShape`, not imported: the
    memory model imports this module) named in `targets` (others count none), `rank x (in +
    out)` per adapted linear layer; and the largest adapter tensor."""
    h, d = shape.hidden, shape.head_dim or shape.hidden // max(shape.heads, 1)
    q, kv, inter = shape.heads * d, shape.kv_heads * d, shape.intermediate
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    adapted = [dims[t] for t in dict.fromkeys(targets) if t in dims]
    per_layer = sum(rank * (i + o) for i, o in adapted)
    largest = max((rank * max(i, o) for i, o in adapted), default=0)
    return shape.layers * per_layer, largest
