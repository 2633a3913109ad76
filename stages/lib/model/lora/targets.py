"""`lora.target_modules` against a model's modules, matched as peft matches them.

Input: the block's `target_modules` (`all-linear`, a regular expression, or names) and a
model's module names (dotted, as `named_modules()` gives them), or a checkpoint folder.
Output: the names that match no module (`unmatched`), the refusal that names them, the
closest real name and the model's adaptable layers (`refusal`), and a checkpoint's module
names read without torch (`checkpoint_modules`: its `.safetensors` headers), or None when they
are known only once it loads (an earlier stage's output, a GGUF file, a model built from config:
the run refuses then, before the first step: `stages.lib.model.lora.wrap.with_lora`).

peft's rule (`check_target_module_exists`): a string is a regular expression the whole module
name must match (`all-linear`: every linear layer but the output head); a list entry matches a
module named it or ending in `.` and it. A list entry that matches nothing is adapted nowhere
and peft says nothing while another entry matches: `[q_proj, v_prj]` trains q_proj alone.

Light: no torch, no peft; `pipe validate` reads the headers.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from stages.lib.model.lora import ALL_LINEAR

HEADER_MAX = 100 * 2**20  # safetensors' own bound on a header's size


@dataclass(frozen=True)
class Modules:
    """A model's module names (every container too, as `named_modules()` lists them) and the
    adaptable layers among them: the modules holding a 2-D weight (linear and embedding)."""

    names: frozenset[str]
    layers: tuple[str, ...]  # the adaptable layers' own names (the last part), sorted


def unmatched(target_modules: str | Sequence[str], names: Iterable[str]) -> list[str]:
    """The targets that match no module, in the order written (a regular expression that
    matches none: itself)."""
    names = list(names)
    if target_modules == ALL_LINEAR:
        return []
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return [] if any(rx.fullmatch(n) for n in names) else [target_modules]
    return [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]


def refusal(target: str, modules: Modules) -> str:
    """Why `target` adapts nothing, with the closest adaptable layer and all of them."""
    close = difflib.get_close_matches(target.rsplit(".", 1)[-1], modules.layers, n=1)
    hint = f": did you mean '{close[0]}'?" if close else ""
    return (
        f"'{target}' matches no module of the model{hint} (peft adapts a module named it, or "
        f"whose name ends in '.{target}'); its linear and embedding layers: "
        f"{', '.join(modules.layers)}"
    )


def from_weights(weights: Iterable[tuple[str, int]]) -> Modules:
    """The modules of a model from its parameters' names and dimensions (`name.weight`, 2):
    each parameter's module and every module above it; the causal LM's `lm_head` always (a
    tied head is not in the checkpoint, and is a module of the loaded model all the same)."""
    names: set[str] = {"lm_head"}
    layers: set[str] = {"lm_head"}
    for key, ndim in weights:
        module, _, param = key.rpartition(".")
        parts = module.split(".") if module else []
        names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        if param == "weight" and ndim == 2 and parts:
            layers.add(parts[-1])
    return Modules(frozenset(names), tuple(sorted(layers)))


def checkpoint_modules(folder: str) -> Modules | None:
    """The modules of the checkpoint in `folder` from its `.safetensors` headers (every shard's;
    the tensors' data is not read); None when it has none (`pytorch_model.bin` is a pickle torch
    must load) or one cannot be read."""
    try:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    except OSError:
        return None
    weights: list[tuple[str, int]] = []
    for name in files:
        header = _header(os.path.join(folder, name))
        if header is None:
            return None
        weights += [(k, len(v.get("shape", ()))) for k, v in header.items() if k != "__metadata__"]
    return from_weights(weights) if weights else None


def _header(path: str) -> dict[str, Any] | None:
    """A `.safetensors` file's header: an 8-byte little-endian length, then that much JSON."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > HEADER_MAX:
                return None
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError):
        return None
    return header if isinstance(header, dict) else None
