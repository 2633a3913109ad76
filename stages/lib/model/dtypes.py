"""Which dtype a checkpoint is saved in, and which precision a stage loads checkpoints in.

Input: a setting (`save_dtype` of train and rl; `backend.precision` of a local backend) and
the checkpoint folders it applies to. Output: the dtype's name and why, for the stage's
record (train's metrics, rl's and evaluate's `settings.json`, collect's metrics).

Light (no torch): read from a checkpoint's `config.json` only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
SAVE_DTYPE_HELP = (
    "dtype of the saved checkpoint's weights and config: auto keeps the input checkpoint's "
    "own (a bfloat16 release comes out in bfloat16; a tiny model built from config in "
    "float32), whatever precision training computed in (bf16)."
)
PRECISION_HELP = (
    "dtype every checkpoint of the stage is loaded and generates in: auto is the "
    "checkpoints' own dtype when they all declare the same one, float32 when they differ "
    "(one precision for all, so an evaluate compares like with like)."
)


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a checkpoint folder declares (`dtype`, or the older `torch_dtype`, of its
    config.json); float32 when it declares none (what transformers assumes then), or when
    there is no config.json (the load that follows names what is missing)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return "float32"
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    declared = config.get("dtype") or config.get("torch_dtype")
    return str(declared).removeprefix("torch.") if declared else "float32"


def resolve_save_dtype(setting: str, model_dir: str) -> tuple[str, str]:
    """The dtype a run saves its final checkpoint in, and why."""
    if setting != "auto":
        return setting, "save_dtype"
    return checkpoint_dtype(model_dir), f"auto: the input checkpoint's dtype ({model_dir})"


def resolve_precision(setting: str, model_dirs: Sequence[str]) -> tuple[str, str]:
    """The one dtype every checkpoint in `model_dirs` is loaded in, and why."""
    if setting != "auto":
        return setting, "backend.precision"
    declared = {checkpoint_dtype(d) for d in model_dirs}
    if len(declared) == 1:
        (dtype,) = declared
        return dtype, f"auto: every checkpoint declares {dtype}"
    if not declared:
        return "float32", "auto: no checkpoint"
    mixed = ", ".join(sorted(declared))
    return "float32", f"auto: the checkpoints declare {mixed}, compared at one precision"
