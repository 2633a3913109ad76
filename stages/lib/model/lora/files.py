"""peft's adapter files: what `save: adapter` writes and what a vLLM server loads.

Input: a model with adapters (`stages.lib.model.lora.wrap`). Output: the adapters' weights
under peft's saved names (`adapter_state`), and a folder of peft's files
(`adapter_config.json`, `adapter_model.safetensors`) written beside its place and renamed
into it (`write_adapter_files`).
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_state(module: Any) -> dict[str, Any]:
    """The adapters' weights on the host under peft's saved names (no adapter name)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(module)
    return {k: v.detach().cpu() for k, v in state.items()}


def write_adapter_files(
    module: Any,
    state: dict[str, Any],
    folder: str,
    base_dir: str | None = None,
    beside: Any = None,
) -> None:
    """`state` as peft's files in `folder`, with the module's adapter config (naming
    `base_dir` as its base, when given); `beside(tmp)` adds files before the folder is
    renamed into place (atomically: written to a temporary sibling first)."""
    from safetensors.torch import save_file

    tmp = f"{folder.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.copy(module.peft_config["default"])  # the live one stays as it trains
    if base_dir is not None:
        config.base_model_name_or_path = os.path.abspath(base_dir)
    config.inference_mode = True
    config.save_pretrained(tmp)
    if beside is not None:
        beside(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
