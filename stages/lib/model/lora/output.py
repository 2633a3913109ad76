"""A LoRA stage's output: the adapters merged into an ordinary checkpoint, or alone.

Input: the trained model (adapters on it, or none), the `LoraBlock`, the input checkpoint
folder, the output path and the save dtype. Output: at `output`, an ordinary checkpoint
(`save: merged`, the default; or the trained model itself without LoRA), or peft's adapter
files with the input's tokenizer and template files beside them (`save: adapter`).

Merging reloads the base from the input checkpoint in the save dtype on the host, loads the
trained adapter into it and merges there: one rounding into the save dtype, and the same
path whatever the training precision (a 4-bit base merges into its full-precision weights,
as QLoRA exports do).
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from typing import Any

from stages.lib.model.lora import LoraBlock
from stages.lib.model.lora.files import adapter_state, write_adapter_files
from stages.lib.model.lora.wrap import with_lora


def write_output(
    module: Any,
    state: dict[str, Any] | None,
    lora: LoraBlock | None,
    model_dir: str,
    output: str,
    dtype: str,
) -> None:
    """The stage's final output at `output` in `dtype`: the trained model as a checkpoint
    (`state`: ZeRO-3's gathered weights), or with LoRA merged or the adapter alone."""
    from stages.lib.model.save import write_checkpoint

    if lora is None:
        write_checkpoint(module, state, model_dir, output, dtype)
    elif lora.save == "adapter":
        write_adapter(module, model_dir, output, dtype)
    else:
        write_merged(module, lora, model_dir, output, dtype)


def write_adapter(module: Any, model_dir: str, output: str, dtype: str) -> None:
    """peft's adapter files at `output` (weights in `dtype`), with the input's tokenizer and
    template files beside them; written to a temporary sibling, then renamed into place."""
    import torch

    cast = getattr(torch, dtype)
    state = {k: v.to(cast).contiguous() for k, v in adapter_state(module).items()}
    write_adapter_files(module, state, output, model_dir, partial(_copy_side_files, model_dir))


def write_merged(module: Any, lora: LoraBlock, model_dir: str, output: str, dtype: str) -> None:
    """An ordinary checkpoint at `output`: the base reloaded from `model_dir` in `dtype` on the
    host, the trained adapters loaded into it and merged (module docstring), saved as
    `stages.lib.model.save.write_checkpoint` saves a fully trained model."""
    import torch
    from peft import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from stages.lib.model.save import write_checkpoint

    state = adapter_state(module)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    fresh = with_lora(base, lora, inference=True)
    result = set_peft_model_state_dict(fresh, state)
    missing = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
    if missing:
        raise RuntimeError(f"adapter weights that fit no module of the base: {missing[:3]}")
    merged = fresh.merge_and_unload()
    write_checkpoint(merged, None, model_dir, output, dtype)


def _copy_side_files(model_dir: str, out: str) -> None:
    """The input's files that are not weights or model config (tokenizer, chat template)."""
    from stages.lib.model.save import WEIGHT_INDEXES, WEIGHTS

    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        skip = name in ("config.json", "generation_config.json", *WEIGHT_INDEXES)
        if os.path.isfile(src) and not skip and not name.endswith(WEIGHTS):
            shutil.copy(src, os.path.join(out, name))
