"""Resumable checkpoints of a training run, and its per-step loss log.

Input: a `Trainer`, the step reached and the run's counters.
Output: `<stage_dir>/checkpoints/step_NNNNNNNN/` (the trainer's own files:
DeepSpeed's sharded model and optimizer states, or one torch state file; the
RNG state of each rank; `trainer_state.json`), and `checkpoints/latest`
naming the newest complete one.

A checkpoint counts only once `latest` names it: `trainer_state.json` is
written after every rank's files, and `latest` is replaced atomically after
that, so a run killed while saving resumes from the previous checkpoint.
Older checkpoints are removed once a newer one is complete. Nothing here
imports torch at module level: the stage process reads `latest` before it
launches the ranks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

from stages.lib.io.jsonl import atomic_write

LATEST = "latest"
STATE = "trainer_state.json"


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def latest(root: str) -> tuple[str, dict[str, Any]] | None:
    """The newest complete checkpoint's tag and trainer state, or None."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            tag = f.read().strip()
        with open(os.path.join(root, tag, STATE), encoding="utf-8") as f:
            state: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return tag, state


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(trainer: Any, root: str, step: int, state: dict[str, Any], rank: int) -> None:
    """Save a checkpoint for `step` on every rank; rank 0 then marks it complete."""
    import torch

    tag = tag_of(step)
    if rank == 0:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
        os.makedirs(os.path.join(root, tag))
    _barrier()
    trainer.save(root, tag)
    torch.save(_rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        atomic_write(os.path.join(root, tag, STATE), json.dumps(state, indent=1))
        atomic_write(os.path.join(root, LATEST), tag)
        for name in os.listdir(root):
            if name.startswith("step_") and name != tag:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _barrier()


def restore(trainer: Any, root: str, tag: str, rank: int) -> None:
    """Load the trainer's states and this rank's RNG from checkpoint `tag`."""
    import torch

    trainer.load(root, tag)
    rng_file = os.path.join(root, tag, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def trim_loss_log(path: str, last_step: int) -> None:
    """Keep the loss lines of steps up to `last_step` (the ones a resumed run will not redo)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= last_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    atomic_write(path, "".join(kept))


def read_loss_log(path: str) -> list[dict[str, Any]]:
    """Every record of a loss log."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
