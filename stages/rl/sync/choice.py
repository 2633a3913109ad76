"""Which weight-sync backend runs, and why: one rule for `pipe plan` and the run.

Input: the backend asked for (`vllm_sync_backend`), whether the actor and
the engines are on GPUs, and whether actor rank 0 shares a GPU with an engine. Output: a
`SyncChoice`, the backend that runs and, when it is not the one asked for, the reason
(`settings.json` records it; the plan warns with it). Light (no torch): the plan reads it.

- vLLM servers and local engines alike: `gloo` and `nccl` are a collective into the
  engines (into vLLM's own workers through our worker extension), `disk` the explicit
  choice of a file; never a silent fallback to it.
- `nccl` needs a GPU at both ends; otherwise `gloo`.
- LoRA with vLLM servers: the adapters travel as files through vLLM's own LoRA support
  (`LORA_SYNC`, `stages.rl.sync.vllm.VLLMLoraReceiver`); the backend asked for is not used.
- `nccl` with actor rank 0 and an engine on one GPU (`colocate` putting the local engine
  with the actor, as the high-performance profile does): NCCL refuses two ranks of one
  communicator on one device ("Duplicate GPU detected", ncclInvalidUsage; seen on an H100),
  so `gloo` carries the weights through host memory. For NCCL, give the `vllm` role
  devices of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Backend = Literal["nccl", "gloo", "disk"]

SAME_GPU = (
    "actor rank 0 and the engine share one GPU (colocate), and NCCL refuses two ranks of one "
    "group on one device ('Duplicate GPU detected'), so gloo carries the weights through "
    "host memory; for NCCL give the vllm role GPUs of its own (colocate: none)"
)


LORA_SYNC = (
    "each sync writes the actor's adapters (peft files, no base weights) to a new folder that "
    "every server loads as a new LoRA adapter (/v1/load_lora_adapter), the previous one "
    "unloaded; requests name the newest"
)


@dataclass(frozen=True)
class SyncChoice:
    """The backend that runs; `reason` when it differs from the one asked for."""

    backend: Backend
    reason: str | None = None


def choose_sync(
    wanted: Backend, *, actor_gpu: bool, engine_gpu: bool, shared_gpu: bool
) -> SyncChoice:
    """The backend for `wanted` given where the actor's rank 0 and the engines are (vLLM
    servers and local engines alike)."""
    if wanted != "nccl":
        return SyncChoice(wanted)
    if not (actor_gpu and engine_gpu):
        return SyncChoice(
            "gloo", "nccl needs GPUs on both ends; this run has none there, so gloo carries them"
        )
    if shared_gpu:
        return SyncChoice("gloo", SAME_GPU)
    return SyncChoice("nccl")


def shared_gpu(actor_rank0: tuple[Any, int] | None, slots: Iterable[Any]) -> bool:
    """Whether actor rank 0's (worker, device) is one an engine runs on: each worker's engine
    takes the first of that worker's `vllm` devices."""
    engines: dict[Any, int] = {}
    for s in slots:
        if s.role == "vllm" and s.devices:
            engines[s.worker] = min(engines.get(s.worker, s.devices[0]), *s.devices)
    return actor_rank0 is not None and actor_rank0 in engines.items()
