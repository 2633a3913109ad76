"""Which torch device in-process work of a stage uses: its first GPU, or the CPU.

Input: the stage's context (its devices on this node). Output: a torch device
string. A Dask worker sees the devices its `CUDA_VISIBLE_DEVICES` lists; the
stage's device id is found in that list (or taken as the index when the worker
sets none), so generation lands on the GPU the placement gave the stage.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.stage import StageContext


def torch_device(ctx: StageContext | None, role: str | None = None) -> str:
    """`cuda:<i>` for the stage's first device when CUDA is usable here, else `cpu`."""
    ids = ctx.devices(role) if ctx is not None else ()
    if not ids:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    first = str(ids[0])
    return f"cuda:{own.index(first) if first in own else ids[0]}"
