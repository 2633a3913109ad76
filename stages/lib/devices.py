"""Where a stage's in-process work runs: which torch device, how many cores, and whether
inside a Dask worker.

Input: the stage's context (its devices on this node). Output: a torch device string, or the
cores the stage's processes may use (`free_cores`). A Dask worker sees the devices its
`CUDA_VISIBLE_DEVICES` lists; the stage's device id is found in that list (or taken as the
index when the worker sets none), so generation lands on the GPU the placement gave the stage.
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


def free_cores(ctx: StageContext) -> tuple[int, str]:
    """The cores this task's processes may use, at least 1, and how they were counted: those of
    its CPU affinity, less the threads of the cluster's other Dask workers on this host (they
    may run other stages meanwhile; the workers that run this stage's tasks are its own)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover (macOS)
        cores = os.cpu_count() or 1
    held = _held_by_other_workers(ctx)
    how = f"{cores} core(s) here, {held} held by the threads of other Dask workers on this host"
    return max(1, cores - held), how


def _held_by_other_workers(ctx: StageContext) -> int:
    """The threads of the Dask workers on this host that run none of the stage's tasks (0
    outside a Dask worker)."""
    try:
        from distributed import get_client, get_worker
        from distributed.comm.addressing import get_address_host

        me = get_worker()
    except (ImportError, ValueError):
        return 0
    ours = {worker for _, worker in ctx.tasks if worker} | {me.address}
    host = get_address_host(me.address)
    workers = get_client().scheduler_info(n_workers=-1)["workers"]
    return sum(
        int(info.get("nthreads", 1))
        for address, info in workers.items()
        if address not in ours and info.get("host") == host
    )


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # what torch's CPU bf16 GEMMs run natively on


def slow_bf16(device: str, bf16: bool, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """A warning for bf16 training on a CPU that has no native bf16 (neither AVX512-BF16 nor
    AMX, as /proc/cpuinfo lists them), else None: there torch's bf16 forward and backward run
    8-50x slower than fp32 on Gemma 3 270M's shapes (BENCHMARKS "bf16 on a CPU without bf16").
    Not knowable (no /proc/cpuinfo): None."""
    if not bf16 or not device.startswith("cpu") or not os.path.exists(cpuinfo):
        return None
    with open(cpuinfo, encoding="utf-8") as f:
        flags = set(f.read().split())
    if any(flag in flags for flag in CPU_BF16_FLAGS):
        return None
    return (
        "bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
        "torch's bf16 matrix products run 8-50x slower than fp32 here; set bf16: false"
    )
