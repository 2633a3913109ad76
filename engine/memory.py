"""Plan, part of: the memory model. What each role needs per GPU and on the host.

Input: `MemoryNeed`s (a kind's `memory_needs` hook: the model's shape or checkpoint, and
the resolved settings that decide memory), the devices each role holds, the device's
memory. Output: an `Estimate` per role (`gpu_bytes`, `host_bytes`, and the parts:
weights, gradients, optimizer, activations, vllm), per GPU. Pure and fast: no torch; a
model's parameters are counted from its `config.json` (or the tiny-model spec).

Model states (mixed precision, the accounting of DeepSpeed's own estimators, per GPU of
N data-parallel ranks, P parameters):

| ZeRO | weights | gradients | optimizer (fp32 master + Adam m, v) |
|---|---|---|---|
| 0 | 2P | 2P | 12P |
| 1 | 2P | 2P | 12P/N |
| 2 | 2P | 6P/N (16-bit + fp32) | 12P/N |
| 3 | 2P/N + 4 x largest layer (the gather buffer) | 6P/N | 12P/N |

`adam_offload` moves the optimizer states (and, from ZeRO-2, the fp32 gradients) to the
host; DeepSpeed's host figure (pinned buffers included, its `additional_buffer_factor`
1.5) is used as it is. In fp32 (no bf16) weights and gradients take 4 bytes and there is
no separate master copy (optimizer 8P). Activations per micro batch follow Korthikanti
et al. (2022): `s*b*h*(34 + 5*a*s/h)` bytes per layer without recomputation, the layer
inputs `2*s*b*h` per layer plus one layer's worth with full checkpointing, and the
fp32 logits `4*s*b*V`; twice that in fp32. A vLLM engine takes
`vllm_gpu_memory_utilization` x device memory (weights and KV cache inside it).
Colocated roles are summed; with `vllm_enable_sleep` the engine's share is free while
the trainer runs, and with `deepspeed_enable_sleep` the trainer's gradients and optimizer
states are while the engine generates: the peak is the larger of the two phases.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.stage import MemoryNeed

GB = 10**9
PARTS = ("weights", "gradients", "optimizer", "activations", "vllm")


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    largest_layer_params: int


def shape_from_dims(
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    tied: bool = False,
    head_dim: int | None = None,
    qkv_bias: bool = False,
) -> ModelShape:
    """A Llama/Qwen/Mistral-style decoder's parameter count from its dimensions."""
    inter = intermediate or 4 * hidden
    kv = kv_heads or heads
    d = head_dim or hidden // heads
    attn = (
        hidden * heads * d * 2 + hidden * kv * d * 2 + (heads * d + 2 * kv * d if qkv_bias else 0)
    )
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embed = vocab * hidden
    params = layers * per_layer + embed * (1 if tied else 2) + hidden
    return ModelShape(params, layers, hidden, inter, heads, kv, vocab, tied, max(embed, per_layer))


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a Hugging Face `config.json` of a decoder-only model."""
    arch = " ".join(config.get("architectures") or [])
    return shape_from_dims(
        hidden=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=int(config["num_attention_heads"]),
        vocab=int(config["vocab_size"]),
        intermediate=config.get("intermediate_size"),
        kv_heads=config.get("num_key_value_heads"),
        tied=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim"),
        qkv_bias=bool(config.get("attention_bias", "Qwen2" in arch)),
    )


def read_shape(model: Any) -> ModelShape | None:
    """A checkpoint directory's shape from its `config.json` alone, or a tiny-model spec's
    (a mapping with hidden_size, num_layers, num_heads, vocab_size); None when unknown."""
    if isinstance(model, Mapping) and "num_hidden_layers" in model:
        return shape_from_config(model)
    if isinstance(model, Mapping):
        return shape_from_dims(
            int(model["hidden_size"]),
            int(model["num_layers"]),
            int(model["num_heads"]),
            int(model["vocab_size"]),
            model.get("intermediate_size"),
            tied=True,
        )
    path = os.path.join(str(model), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return shape_from_config(json.load(f))


@dataclass(frozen=True)
class Estimate:
    gpu_bytes: int
    host_bytes: int
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "parts": dict(self.parts),
        }


def _estimate(parts: dict[str, int], host: int) -> Estimate:
    full = {p: int(parts.get(p, 0)) for p in PARTS}
    return Estimate(sum(full.values()), int(host), full)


def model_states(
    params: int, largest: int, zero: int, dp: int, per_node: int, offload: bool, bf16: bool
) -> tuple[dict[str, int], int]:
    """Per-GPU weights/gradients/optimizer and per-GPU host bytes (the module's table)."""
    w = 2 if bf16 else 4  # a weight, and a gradient, in the training precision
    grads = w + 4 if bf16 else w  # mixed precision keeps an fp32 copy of the gradients too
    opt = 12 if bf16 else 8  # fp32 master (mixed precision only) + Adam's m and v
    p, n = params, max(dp, 1)
    local = min(max(per_node, 1), n)  # ranks of a node: DeepSpeed's host figures are per node
    nodes = -(-n // local)
    host = 0
    if zero == 3:
        parts = {
            "weights": w * p // n + 4 * largest,
            "gradients": (grads - w) * p // n,
            "optimizer": opt * p // n,
        }
        host = int(largest * 4 * local * 1.5) // local
        if offload:
            parts["gradients"] = parts["optimizer"] = 0
            host = int(p * 16 / nodes * 1.5) // local
    elif zero == 2:
        parts = {"weights": w * p, "gradients": grads * p // n, "optimizer": opt * p // n}
        host = int(p * 4 * 1.5)  # each rank loads the fp32 weights on the host first
        if offload:
            parts["gradients"] = parts["optimizer"] = 0
            host = int(p * max(4 * n, 16) * 1.5) // local
    else:
        parts = {
            "weights": w * p,
            "gradients": w * p,
            "optimizer": opt * p // (n if zero == 1 else 1),
        }
        if offload and zero == 1:
            host, parts["optimizer"] = parts["optimizer"], 0
    return parts, host


def activations(shape: ModelShape, micro: int, seq: int, checkpointing: bool, bf16: bool) -> int:
    s, b, h, a, v = seq, micro, shape.hidden, shape.heads, shape.vocab
    layer = s * b * h * (34 + 5 * a * s / h)
    body = shape.layers * 2 * s * b * h + layer if checkpointing else shape.layers * layer
    return int((body if bf16 else 2 * body) + 4 * s * b * v)


def estimate(need: MemoryNeed, dp: int, per_node: int, device_bytes: int | None) -> Estimate | None:
    """One role's estimate per GPU; None when its model's shape is unknown."""
    if need.profile == "engine":
        return _estimate({"vllm": int(need.utilization * (device_bytes or 0))}, 0)
    shape = read_shape(need.model)
    if shape is None:
        return None
    if need.profile == "frozen":
        w = 2 if need.bf16 else 4
        return _estimate({"weights": w * shape.params}, 0)
    parts, host = model_states(
        shape.params,
        shape.largest_layer_params,
        need.zero_stage,
        dp,
        per_node,
        need.adam_offload,
        need.bf16,
    )
    parts["activations"] = activations(
        shape, need.micro_batch, need.seq_len, need.gradient_checkpointing, need.bf16
    )
    return _estimate(parts, host)


def colocated(items: Sequence[tuple[MemoryNeed, Estimate]]) -> Estimate:
    """Roles sharing devices: summed; sleeping shares freed in the other phase (the peak)."""
    train_phase = {p: 0 for p in PARTS}
    gen_phase = {p: 0 for p in PARTS}
    host = 0
    for need, est in items:
        host += est.host_bytes
        for part, value in est.parts.items():
            if need.profile == "engine":
                gen_phase[part] += value
                train_phase[part] += 0 if need.sleep else value
            else:
                train_phase[part] += value
                freed = need.sleep and part in ("gradients", "optimizer", "activations")
                gen_phase[part] += 0 if freed else value
    peak = train_phase if sum(train_phase.values()) >= sum(gen_phase.values()) else gen_phase
    return _estimate(peak, host)


def with_changes(need: MemoryNeed, **changes: Any) -> MemoryNeed:
    return replace(need, **changes)


def fmt(n: int) -> str:
    return f"{n / GB:.1f} GB"
