"""The plan-time rules of `ring_attn_size` (sequence parallelism), for train and rl.

Input: a resolved config with `ring_attn_size` (train's, rl's), its `ResolveContext`, the
stage's ranks and its model as the memory model reads it. Output: located diagnostics, and the
sequence length one rank holds (`per_rank_length`, what the memory model counts). Light: no
torch here; the mechanism is `stages.lib.distributed.seqpar`, run in the ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from engine.errors import Diagnostic
from engine.stage import ResolveContext


def per_rank_length(max_length: int, ring_attn_size: int) -> int:
    """The positions one rank holds of a `max_length` sequence split over `ring_attn_size`
    ranks (the width is padded to a multiple of it)."""
    return -(-max_length // ring_attn_size)


def data_parallel_ranks(ranks: int, ring_attn_size: int) -> int:
    """The data-parallel ranks (batch sizes divide over them): sequence-parallel groups."""
    return ranks // ring_attn_size if ranks % ring_attn_size == 0 else ranks


def check_ring_attn(cfg: Any, ctx: ResolveContext, ranks: int, model: Any) -> list[Diagnostic]:
    """What train's sequence parallelism does not do, refused with the reason: ranks that do
    not split into groups of `ring_attn_size`, packed rows, losses over whole sequences (dpo,
    rm), a model whose heads do not split (read from its config when plan can read it; the
    ranks check it again, with its attention interface, when they load it)."""
    size = cfg.ring_attn_size
    if size == 1:
        return []
    out = []
    here = f"ring_attn_size {size} ({ctx.source('ring_attn_size')})"
    if ranks % size:
        out.append(
            ctx.error(
                "ring_attn_size",
                f"{ranks} rank(s) do not split into sequence-parallel groups of {size}: use a "
                f"divisor of {ranks}, or give the stage a multiple of {size} "
                f"({'GPUs' if ctx.gpus else 'num_processes'})",
            )
        )
    if cfg.packing_samples:
        out.append(
            ctx.error(
                "packing_samples",
                f"packed rows cannot be split across ranks with {here}: attention over the "
                "gathered rows is causal over the whole row (SDPA without the packed rows' "
                "block mask); turn packing_samples off",
            )
        )
    if cfg.algorithm != "sft":
        out.append(
            ctx.error(
                "ring_attn_size",
                f"sequence parallelism trains sft only; algorithm is {cfg.algorithm} "
                f"({ctx.source('algorithm')}), whose loss reads whole sequences' "
                "log-probabilities: set ring_attn_size 1",
            )
        )
    out += _check_heads(ctx, size, model)
    return out


def model_heads(model: Any) -> tuple[int, int] | None:
    """A model's (attention heads, key/value heads), from a tiny-model spec or a config
    mapping, or a checkpoint folder's `config.json`; None when plan cannot read them."""
    config = model
    if isinstance(model, str):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    if not isinstance(config, Mapping):
        return None
    config = config.get("text_config") or config  # a multimodal checkpoint's language model
    heads = config.get("num_attention_heads") or config.get("num_heads")
    if not isinstance(heads, int):
        return None
    kv = config.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) else heads


def _check_heads(ctx: ResolveContext, size: int, model: Any) -> list[Diagnostic]:
    found = model_heads(model)
    if found is None or (found[0] % size == 0 and found[1] % size == 0):
        return []
    return [
        ctx.error(
            "ring_attn_size",
            f"{size} does not divide the model's attention heads ({found[0]}) and key/value "
            f"heads ({found[1]}): each rank attends with 1/{size} of them",
        )
    ]


def refuse_ring_attn(cfg: Any, ctx: ResolveContext, missing: str) -> list[Diagnostic]:
    """A kind that declares `ring_attn_size` but does not split sequences yet: > 1 refused,
    saying what is `missing`."""
    if cfg.ring_attn_size == 1:
        return []
    return [
        ctx.error(
            "ring_attn_size",
            f"sequence parallelism is not wired into this stage yet ({missing}): set "
            "ring_attn_size 1",
        )
    ]
