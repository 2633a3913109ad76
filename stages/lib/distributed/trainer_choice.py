"""Which trainer a trained role's ranks run: DeepSpeed, or plain torch with the same interface.

Input: a resolved config with `trainer` (auto, deepspeed or torch) and `lora` (the train and
rl kinds' configs), and whether DeepSpeed is installed where the ranks run (looked up here by
default; a plan, made where it may not be, assumes it is). Output: `choose_trainer(cfg)`,
`deepspeed` or `torch`, what `stages.lib.distributed.trainer` builds and what the resume key,
the ds_config and `deepspeed_enable_sleep` are decided for. Light (no torch).

auto trains with DeepSpeed where it is installed, except a 4-bit LoRA base
(`lora.load_in_4bit`), which only plain torch trains (`stages.lib.model.lora.refusals`);
deepspeed asked for where it is not installed is refused before any rank starts.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

Trainer = Literal["deepspeed", "torch"]


def choose_trainer(cfg: Any, installed: bool | None = None) -> Trainer:
    """deepspeed or torch: what `cfg.trainer` means where DeepSpeed is `installed` or not
    (None: whether it is here)."""
    if installed is None:
        installed = importlib.util.find_spec("deepspeed") is not None
    if cfg.trainer == "deepspeed" and not installed:
        raise RuntimeError("trainer 'deepspeed' asked for, but deepspeed is not installed")
    if cfg.trainer == "auto":
        four_bit = cfg.lora is not None and cfg.lora.load_in_4bit
        return "deepspeed" if installed and not four_bit else "torch"
    return "torch" if cfg.trainer == "torch" else "deepspeed"
