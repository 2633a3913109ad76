"""A stage's final checkpoint, in the dtype the run resolved, with the input's other files.

Input: the trained module (and, under ZeRO-3, its gathered state dict), the input checkpoint
folder the run started from, the output folder and the resolved save dtype
(`stages.lib.model.dtypes.resolve_save_dtype`: `auto` is the input checkpoint's own dtype).
Output: a Hugging Face checkpoint at `output` (written to a temporary sibling, then renamed
into place): the weights cast to the save dtype (tied weights stay one tensor), the input's
`config.json` with only its dtype changed (fields the run flips to train, such as
`use_cache`, come out as they went in; a reward model's head, labels and pad id are the
`fields` the caller gives: `stages.lib.model.reward_model.reward_config`), and every other file of
the input that is not weights (tokenizer files, chat template, generation_config.json) copied
through unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _cast(state: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """`state` on the host in `dtype` (floating tensors only); tensors that share storage
    (tied embeddings) stay shared, so `save_pretrained` still writes them once."""
    out: dict[str, Any] = {}
    seen: dict[tuple[int, tuple[int, ...]], Any] = {}
    for name, t in state.items():
        if not t.is_floating_point():
            out[name] = t.detach().cpu()
            continue
        key = (t.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen[key] = t.detach().to("cpu", dtype)
        out[name] = seen[key]
    return out


def write_checkpoint(
    module: Any,
    state: dict[str, Any] | None,
    model_dir: str,
    output: str,
    dtype: str,
    fields: dict[str, Any] | None = None,
    finish: Callable[[str], None] | None = None,
) -> None:
    """Write `module` (its weights `state` when given: ZeRO-3's gathered dict) as a checkpoint
    at `output` in `dtype`, beside the input's files, its config the input's with `fields` set
    (see the module docstring); `finish`, when given, edits the folder before it is renamed
    into place (a reward model's tokenizer pad: `stages.lib.model.reward_model.tokenizer_pad`)."""
    import torch

    tmp = f"{output.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    weights = _cast(state if state is not None else module.state_dict(), getattr(torch, dtype))
    module.save_pretrained(tmp, state_dict=weights)
    _config_as_input(model_dir, tmp, dtype, fields or {})
    if os.path.exists(f"{tmp}/generation_config.json"):
        os.remove(f"{tmp}/generation_config.json")  # the input's comes through unchanged, if any
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if os.path.isfile(src) and not _is_weights_or_config(name):
            shutil.copy(src, os.path.join(tmp, name))
    if finish is not None:
        finish(tmp)
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)


def _is_weights_or_config(name: str) -> bool:
    return name == "config.json" or name in WEIGHT_INDEXES or name.endswith(WEIGHTS)


def _config_as_input(model_dir: str, out_dir: str, dtype: str, fields: dict[str, Any]) -> None:
    """The input's config.json in `out_dir`, its dtype (under the keys it uses) set to `dtype`
    and `fields` set."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    config.update(dict.fromkeys(keys, dtype))
    config.update(fields)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
