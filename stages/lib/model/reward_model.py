"""Reward models: checkpoints with a scalar head, checked at plan time, loaded and scored.

Input: a checkpoint folder that `AutoModelForSequenceClassification` loads with one label
(`config.json` `architectures` like `LlamaForSequenceClassification`, `id2label` of one
entry); token id sequences. Output: `head_problem` (why a folder is not one, read from its
`config.json` alone: no torch, for `pipe validate`), `load_reward_model` (frozen, in the
compute dtype) and `score` (each sequence's scalar at its last token, in micro batches).

The score is read at each sequence's last token (its length, not a search for the pad id:
a completion ending in an end-of-sequence id that doubles as the pad id keeps it), from the
decoder's hidden state through the `score` head, as Hugging Face's sequence classifiers and
OpenRLHF's reward models read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

HEAD_SUFFIX = "ForSequenceClassification"


def head_problem(model_dir: str) -> str | None:
    """Why `model_dir` (a folder holding `config.json`) is not a reward model, or None: its
    architectures name no `...ForSequenceClassification`, or its head has more than one
    label."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    archs = [str(a) for a in config.get("architectures") or []]
    if not any(a.endswith(HEAD_SUFFIX) for a in archs):
        named = ", ".join(archs) or "none"
        return (
            f"its config.json architectures ({named}) name no scalar head "
            f"(...{HEAD_SUFFIX}): a reward model is a checkpoint that "
            "AutoModelForSequenceClassification loads with num_labels 1, e.g. the output of "
            "a train stage with algorithm: rm"
        )
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, dict) else config.get("num_labels", 1)
    if count != 1:
        return f"its head has {count} labels (id2label); a reward model's has one (num_labels 1)"
    return None


def load_reward_model(model_dir: str, bf16: bool, device: str) -> Any:
    """The reward model of `model_dir` in the compute dtype (bf16 when `bf16`, else fp32), on
    `device`, in eval mode without gradients."""
    import torch
    from transformers import AutoModelForSequenceClassification

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype)
    model.requires_grad_(False)
    return model.to(device).eval()


def score(
    model: Any, sequences: Sequence[Sequence[int]], micro_batch: int, pad_id: int = 0
) -> list[float]:
    """Each token id sequence's score under `model` (a scalar-head sequence classifier), in
    micro batches of `micro_batch` right-padded sequences, read at each one's last token."""
    import torch

    device = next(model.parameters()).device
    base = getattr(model, model.base_model_prefix)
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch):
            micro = [list(s) for s in sequences[start : start + micro_batch]]
            lengths = torch.tensor([len(s) for s in micro], device=device)
            width = int(lengths.max())
            ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in micro], device=device)
            mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
            hidden = base(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            last = hidden[torch.arange(len(micro), device=device), lengths - 1]
            out += model.score(last)[:, 0].float().tolist()
    return out
