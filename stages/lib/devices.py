"""Where a stage's in-process work runs: which torch device, and whether inside a Dask worker.

Input: the stage's context (its devices on this node). Output: a torch device
string. A Dask worker sees the devices its `CUDA_VISIBLE_DEVICES` lists; the
stage's device id is found in that list (or taken as the index when the worker
sets none), so generation lands on the GPU the placement gave the stage.
`in_dask_worker` says whether the body runs as a Dask task (so it may submit
tasks of its own: collect's shards, filter's partitions).
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


def in_dask_worker() -> bool:
    """Whether this code runs inside a Dask worker task."""
    try:
        from distributed import get_worker

        get_worker()
    except (ImportError, ValueError):
        return False
    return True
