"""Plan, part of: the memory model. What each role needs per GPU and on the host.

Input: `MemoryNeed`s (a kind's `memory_needs` hook: the model's shape or checkpoint, and
the resolved settings that decide memory), the devices each role holds, the device's
memory. Output: an `Estimate` per role (`gpu_bytes`, `host_bytes`, and the parts:
weights, gradients, optimizer, activations, buffers, vllm), per GPU; and the peak RSS of
a rank that trains on the CPU. Pure and fast: no torch; a
model's parameters are counted from its `config.json` (or the tiny-model spec).

Model states (mixed precision, the accounting of DeepSpeed's own estimators, per GPU of
N data-parallel ranks, P parameters):

| ZeRO | weights | gradients | optimizer (fp32 master + Adam m, v) |
|---|---|---|---|
| 0 | 2P | 2P | 12P |
| 1 | 2P | 2P | 12P/N |
| 2 | 2P | 6P/N (16-bit + fp32) | 12P/N |
| 3 | 2P/N + 4 x largest layer (the gather buffer) | 4P/N (fp32) | 12P/N |

`adam_offload` moves the optimizer states (and, from ZeRO-2, the fp32 gradients) to the
host; DeepSpeed's host figure (pinned buffers included, its `additional_buffer_factor`
1.5) is used as it is. In fp32 (no bf16) weights and gradients take 4 bytes. Activations
per micro batch follow Korthikanti et al. (2022): `s*b*h*(34 + 5*a*s/h)` bytes per layer
without recomputation, the layer inputs `2*s*b*h` per layer plus one layer's worth with
full checkpointing, and the fp32 logits `4*s*b*V`; twice that in fp32.

In fp32 (no bf16) ZeRO 1-3 still keep their own fp32 copy of the partition beside the
model's weights (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`, cloned
whatever the model's dtype), so the optimizer there is 12P/N as in mixed precision; only
ZeRO-0 steps the model's own fp32 weights (8P).

With LoRA (`MemoryNeed.lora_rank`) the frozen base is whole on every rank, and the table's
gradients and optimizer states count the adapters only (`engine.plan.adapters`).

Buffers (DeepSpeed's working memory beside the model states, not in its estimators): the
gradient communication buffers while backward runs, or the optimizer step's temporaries,
whichever is larger (they are not alive at the same time). Communication: ZeRO-0 flattens
the gradients into all-reduce buckets of up to 5e8 elements (`MEMORY_OPT_ALLREDUCE_SIZE`),
ZeRO-1/2 keep one reduce bucket of hidden^2 elements (two with `overlap_comm`; the size is
ours, `ds_buckets`, Hugging Face's rule), ZeRO-3 its reduce bucket (DeepSpeed's 5e8
elements) plus the gathered weights it keeps alive (up to `stage3_max_live_parameters`, 1e9:
the whole of a small model). Step: torch's AdamW makes an fp32 copy of v for the
denominator: of all the tensors it steps at once on a GPU (foreach, then in place), of one
tensor at a time on the CPU (two: the square root, then the quotient), the largest the peak;
under ZeRO 1-3 the tensor stepped is the rank's flat partition; with `adam_offload`
DeepSpeed's CPU Adam steps in place on the host. ZeRO-1/2 with `adam_offload` add, while
backward runs, the offload path's own device buffers (`offload_buffers`, each beside the
line of DeepSpeed 0.19.8 that allocates it): a staging buffer of the largest tensor, and for
the gradient on its way to the host a copy of it (an oversized gradient is cloned) and its
fp64 copy for the norm.

A rank that trains on the CPU (`cpu_rank_bytes`) holds all of it in its RSS: the per-GPU
parts, DeepSpeed's host figure under offload (its 1.5 margin is real there: the offloaded
optimizer keeps its own gradient and staging copies on the host), and the process's own
runtime (the interpreter and libraries: the RSS of a rank with no model, which the caller
measures). A vLLM engine takes `vllm_gpu_memory_utilization` x device memory (weights and KV
cache inside it). A frozen model (a reference policy, the local engine's copy) holds its
weights in the compute dtype, whole on every rank, or under ZeRO-3 `w*P/N` plus the gather
buffer of the table; one that loads inside another role's processes (`MemoryNeed.inside`,
when its own role holds no devices) is counted on that role's devices. Colocated roles are
summed; with `vllm_enable_sleep` the engine's share is free while the trainer runs, and with
`deepspeed_enable_sleep` the trainer's gradients and optimizer states are while the engine
generates: the peak is the larger of the two phases. Those states then sit in the host's
memory: a sleeping trainer's host figure counts them.

Host memory per rank (`host_bytes`) is DeepSpeed's host figure, plus what sleep moves
there; `engine.plan.budget` sums it over the ranks a node holds. Not counted: each process's
own runtime (interpreter, libraries, CUDA context) and the copy of its weights a vLLM
engine keeps on the host while asleep (the engine's need carries no model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.hub import cached_file
from engine.plan.adapters import lora_params
from engine.stage import MemoryNeed

GB = 10**9
PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "vllm")
ALLREDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's ZeRO-0 all-reduce bucket
MAX_LIVE_PARAMETERS = 1_000_000_000  # elements: ZeRO-3's default stage3_max_live_parameters
REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size (ZeRO-3)


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
    head_dim: int = 0  # 0: hidden // heads


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
    largest = max(embed, per_layer)
    return ModelShape(params, layers, hidden, inter, heads, kv, vocab, tied, largest, d)


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
        path = cached_file(str(model), "config.json") or ""  # a hub id the cache holds
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return shape_from_config(json.load(f))


@dataclass(frozen=True)
class Estimate:
    """One role's bytes per GPU and per rank on the host; once placed, its ranks per node
    (`nodes`), which hold `ranks x host_bytes` of their node's host memory."""

    gpu_bytes: int
    host_bytes: int
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    nodes: dict[str, int] = field(default_factory=dict)
    inside: str = ""  # loaded in this other role's processes, on its devices

    def as_dict(self) -> dict[str, Any]:
        out = {
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "parts": dict(self.parts),
            "nodes": {
                node: {"ranks": ranks, "host_bytes": ranks * self.host_bytes}
                for node, ranks in self.nodes.items()
            },
        }
        return out | ({"inside": self.inside} if self.inside else {})


def _estimate(parts: dict[str, int], host: int) -> Estimate:
    full = {p: int(parts.get(p, 0)) for p in PARTS}
    return Estimate(sum(full.values()), int(host), full)


def model_states(
    params: int, largest: int, zero: int, dp: int, per_node: int, offload: bool, bf16: bool
) -> tuple[dict[str, int], int]:
    """Per-GPU weights/gradients/optimizer and per-GPU host bytes (the module's table)."""
    w = 2 if bf16 else 4  # a weight, and a gradient, in the training precision
    grads = w + 4 if bf16 else w  # mixed precision keeps an fp32 copy of the gradients too
    opt = 12 if bf16 or zero > 0 else 8  # fp32 master (ZeRO's own copy) + Adam's m and v
    p, n = params, max(dp, 1)
    local = min(max(per_node, 1), n)  # ranks of a node: DeepSpeed's host figures are per node
    nodes = -(-n // local)
    host = 0
    if zero == 3:
        parts = {
            "weights": w * p // n + 4 * largest,
            "gradients": 4 * p // n,  # the fp32 gradient partition
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


def ds_buckets(hidden: int, zero: int) -> dict[str, int]:
    """The ds_config bucket sizes for a model of this hidden size: ZeRO-1/2's reduce bucket
    is hidden^2 elements (Hugging Face's `auto` rule) instead of DeepSpeed's 5e8, which
    would hold a small model's gradients several times over. ZeRO-3 keeps DeepSpeed's
    defaults: with small buckets its gloo reduce-scatter hung in our 2-rank CPU runs."""
    return {"reduce_bucket_size": hidden * hidden} if zero in (1, 2) else {}


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the model's largest weight tensor (DeepSpeed's `largest_param_numel`): the
    embedding or the output layer, else an MLP or attention projection."""
    return max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate, shape.hidden**2)


def offload_buffers(largest: int, params: int, dp: int, bf16: bool, bucket: int) -> dict[str, int]:
    """ZeRO-1/2's device buffers under `offload_optimizer: cpu` beside the reduce bucket, alive
    together while backward runs (DeepSpeed 0.19.8, deepspeed/runtime/zero/stage_1_and_2.py).
    The fp32 master, its gradient and the bit16 staging copy are on the host (:560-575, :937,
    `self.device` is 'cpu' under offload: :278), so they are not here."""
    w, n = (2 if bf16 else 4), max(dp, 1)
    return {
        # requirement found in stage_1_and_2.py:659: `temp_grad_buffer_for_gpu_offload =
        # torch.zeros(largest_param_numel, device=<accelerator>, dtype=self.dtype)`, kept
        "staging": w * largest,
        # requirement found in stage_1_and_2.py:1443-1446: with offload (`_offload_gradient_
        # safety_enabled`, :232) a gradient larger than the reduce bucket is cloned, and the
        # clone is held until the next gradient's hook reduces it (:1422-1424) and copies it
        # to the host (:2271, `copy_grads_in_partition` :2161-2178)
        "clone": w * largest if largest > bucket else 0,
        # requirement found in stage_1_and_2.py:1886: `set_norm_for_param_grad_in_gpu` takes
        # the norm of `accumulated_grad.data.to(get_norm_dtype())`, fp64 wherever the
        # accelerator has it (runtime/zero/utils.py:59): a copy of this rank's slice
        "norm": 8 * min(largest, -(-params // n)),
    }


def buffers(
    shape: ModelShape, zero: int, dp: int, offload: bool, bf16: bool, overlap: bool, cpu: bool
) -> int:
    """Communication buffers or step temporaries, the larger (module docstring)."""
    w, p, n = (2 if bf16 else 4), shape.params, max(dp, 1)
    if zero == 0:
        comm = w * min(p, ALLREDUCE_BUCKET)
    elif zero < 3:
        bucket = ds_buckets(shape.hidden, zero)["reduce_bucket_size"]
        comm = w * bucket * (2 if overlap else 1)
        if offload:
            comm += sum(offload_buffers(largest_tensor(shape), p, dp, bf16, bucket).values())
    else:  # allocated whole on a GPU; on the CPU only the pages the gradients reach count
        bucket = min(p, REDUCE_BUCKET) if cpu else REDUCE_BUCKET
        comm = w * (min(p, MAX_LIVE_PARAMETERS) + bucket)
    stepped = p // n if zero > 0 else (shape.largest_layer_params if cpu else p)
    step = 0 if offload and zero > 0 and not cpu else (2 if cpu else 1) * 4 * stepped
    return max(comm, step)


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
    if need.profile == "frozen":  # whole on each rank, or split over them by ZeRO-3
        w, n = (2 if need.bf16 else 4), max(dp, 1)
        whole = need.zero_stage != 3
        weights = (
            w * shape.params if whole else w * shape.params // n + 4 * shape.largest_layer_params
        )
        return _estimate({"weights": weights}, 0)
    parts, host = _trainer_parts(need, shape, dp, per_node, cpu=False)
    if need.sleep:
        # deepspeed_enable_sleep: DeepSpeed's `offload_states` (runtime/engine.py) moves the
        # optimizer states and gradients to pinned host memory while the engine generates
        host += parts["gradients"] + parts["optimizer"]
    return _estimate(parts, host)


def _trainer_parts(
    need: MemoryNeed, shape: ModelShape, dp: int, per_node: int, cpu: bool
) -> tuple[dict[str, int], int]:
    if need.lora_rank:
        parts, host = _lora_parts(need, shape, dp, per_node, cpu)
    else:
        parts, host = model_states(
            shape.params,
            shape.largest_layer_params,
            need.zero_stage,
            dp,
            per_node,
            need.adam_offload,
            need.bf16,
        )
        parts["buffers"] = buffers(
            shape, need.zero_stage, dp, need.adam_offload, need.bf16, need.overlap_comm, cpu
        )
    parts["activations"] = activations(  # the full model's, adapters or not
        shape, need.micro_batch, need.seq_len, need.gradient_checkpointing, need.bf16
    )
    return parts, host


def _lora_parts(
    need: MemoryNeed, shape: ModelShape, dp: int, per_node: int, cpu: bool
) -> tuple[dict[str, int], int]:
    """A LoRA trainer: the frozen base whole on every rank in the training dtype, and the model
    states of the table for the adapters alone (their gradients, fp32 master and Adam's m, v:
    the base has none); buffers sized on the adapters."""
    adapters, largest = lora_params(shape, need.lora_rank, need.lora_targets)
    parts, host = model_states(
        adapters, largest, need.zero_stage, dp, per_node, need.adam_offload, need.bf16
    )
    parts["weights"] = (2 if need.bf16 else 4) * (shape.params + adapters)
    small = replace(shape, params=adapters, largest_layer_params=largest)
    parts["buffers"] = buffers(
        small, need.zero_stage, dp, need.adam_offload, need.bf16, need.overlap_comm, cpu
    )
    return parts, host


def cpu_rank_bytes(need: MemoryNeed, dp: int, per_node: int, runtime: int) -> int | None:
    """The peak RSS of a trainer rank on the CPU (gloo), `runtime` the RSS of a rank with no
    model: its per-GPU parts, what offload moves to the host, and the runtime (module
    docstring). Without offload the host figure is the weights the rank loads, which on the
    CPU are the same memory as its parts; None when the model's shape is unknown."""
    shape = read_shape(need.model)
    if shape is None:
        return None
    parts, host = _trainer_parts(need, shape, dp, per_node, cpu=True)
    return sum(parts.values()) + (host if need.adam_offload else 0) + runtime


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
                freed = need.sleep and part in ("gradients", "optimizer", "activations", "buffers")
                gen_phase[part] += 0 if freed else value
    peak = train_phase if sum(train_phase.values()) >= sum(gen_phase.values()) else gen_phase
    return _estimate(peak, host)


def with_changes(need: MemoryNeed, **changes: Any) -> MemoryNeed:
    return replace(need, **changes)


def fmt(n: int) -> str:
    return f"{n / GB:.1f} GB"
