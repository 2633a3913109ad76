"""Tiny reward models for tests: a policy checkpoint built by the project's builder and a
scalar-head checkpoint on its config and tokenizer (`LlamaForSequenceClassification`, one
label), its head scaled so that scores spread well beyond a unit."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [f"{a} + {b} =" for a in range(10) for b in range(10)]


def build_policy(out: Path, seed: int = 0) -> Path:
    """A tiny Llama policy (`TinyModel`) with its tokenizer trained on the arithmetic prompts."""
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model

    spec = TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300)
    texts = PROMPTS + [str(n) for n in range(19)]
    build_tiny_model(spec, texts, str(out), seed=seed)
    return out


def build_reward_model(
    policy: Path,
    out: Path,
    scale: float = 50.0,
    seed: int = 1,
    stats: dict[str, float] | None = None,
) -> Path:
    """A scalar-head checkpoint of `policy`'s architecture and tokenizer, random weights, its
    head multiplied by `scale`; `stats`, the `mean` and `std` normalize_reward divides by, in
    its config when given."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    config.architectures = ["LlamaForSequenceClassification"]
    for key, value in (stats or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
