"""Sequence parallelism (`ring_attn_size`): one long sequence split across the ranks of a group.

Input: the ranks' process group (torch.distributed, gloo or NCCL), the sequence-parallel size S
(`ring_attn_size`), a causal LM whose attention runs through transformers' `sdpa` interface
(every Llama-like model transformers ships), and per micro batch its full-width tensors.
Output: `SeqPar`, this rank's place in the world split into data-parallel x sequence-parallel
groups (S consecutive ranks form one sequence-parallel group: on GPUs one node's, whose links
are the fast ones); each tensor's shard of the sequence (`shard`); and, while `active(sp)` is
open, attention that sees the whole sequence (`install` registers it with transformers).

The method is DeepSpeed-Ulysses (Jacobs et al. 2023; DeepSpeed's `UlyssesSPAttentionHF` is the
same exchange): each rank holds a contiguous 1/S of the sequence and computes everything but
attention on it alone (embeddings, MLPs, norms, rotary embeddings at the global position ids,
the head and the loss). In attention an all-to-all trades the sequence split for a head split:
each rank gets the whole sequence for H/S of the query heads (and of the key/value heads),
runs causal SDPA on it, and a second all-to-all trades back. Both exchanges are autograd
functions whose backward is the inverse all-to-all, so each rank's backward sends the
gradient of its shard's loss into the other ranks' activations: the gradients summed over a
group are the gradient of the whole sequence's loss.

The loss: each rank sums its shard's token losses and the step divides by the global batch's
token count, so the shards' sums add up to the one-rank loss; the trainers average gradients
over all W ranks (DeepSpeed's data-parallel reduction, or the torch trainer's all-reduce) and
the step scales each rank's loss by W / tokens, which makes that average the sum over the
sequence-parallel ranks and the mean over the data-parallel ones: the same update as one rank
on the whole batch. The ranks of a group take the same micro batches (`SeqPar.dp_rank`).

Why not DeepSpeed's own registration: it needs DeepSpeed's communication layer (the torch
trainer has none), builds its groups itself (the world split is ours, planned at resolve)
and keeps a fixed micro batch size; the exchange is 40 lines here, over plain
torch.distributed, for both trainers. What it supports is what DeepSpeed's does without
flash-attention: causal attention over right-padded rows (padding only ever follows a row's
real tokens, which causal attention never lets them see), no packed rows (SDPA would need
their block mask at the full width), key/value heads divisible by S.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ATTENTION = "sdpa"  # the transformers attention interface the exchange wraps


@dataclass(frozen=True)
class SeqPar:
    """This rank's place in the world split into data-parallel x sequence-parallel groups."""

    size: int  # S: ranks per sequence-parallel group
    rank: int  # this rank's index in its group: it holds the rank-th 1/S of the sequence
    dp_rank: int  # its group's index: the batch plan's rank whose micro batches it takes
    dp_size: int  # the number of groups: the batch plan's world
    group: Any  # torch.distributed's ProcessGroup of the S ranks


def split_world(size: int, rank: int, world: int) -> SeqPar:
    """This rank's `SeqPar` under `ring_attn_size` = `size`: the world's ranks in groups of
    `size` consecutive ranks. Every rank calls it (each group is made by all ranks)."""
    if size < 1 or world % size:
        raise ValueError(f"world size {world} is not divisible by ring_attn_size {size}")
    group = None
    for first in range(0, world, size):
        made = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            group = made
    return SeqPar(size, rank % size, rank // size, world // size, group)


def check_heads(config: Any, size: int, max_length: int | None = None) -> None:
    """Refuse a model whose heads do not split over `size` ranks, whose attention is not the
    `sdpa` interface the exchange wraps (eager attention builds the full mask itself), or whose
    sliding-window layers would see a window shorter than `max_length` (the exchange attends
    causally over the whole row: the window's mask is the local shard's, and is dropped)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if window and max_length is not None and window < max_length:
        raise ValueError(
            f"ring_attn_size {size}: the model's sliding-window attention ({window} tokens) "
            f"would attend over whole rows of up to max_length {max_length}; set max_length "
            f"{window} or less, or ring_attn_size 1"
        )
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size or kv % size:
        raise ValueError(
            f"ring_attn_size {size} must divide the model's attention heads ({heads}) and "
            f"key/value heads ({kv}): each rank attends with 1/{size} of them"
        )
    used = getattr(config, "_attn_implementation", None)
    if used != ATTENTION:
        raise ValueError(
            f"ring_attn_size {size} needs the model's attention through transformers' "
            f"'{ATTENTION}' interface; it uses '{used}'"
        )


def shard(tensor: torch.Tensor, sp: SeqPar, fill: int) -> torch.Tensor:
    """This rank's contiguous 1/S of `tensor` along dim 1 (the sequence), the width first
    padded on the right with `fill` to a multiple of S."""
    width = tensor.shape[1]
    padded = -(-width // sp.size) * sp.size
    if padded != width:
        pad = torch.full((tensor.shape[0], padded - width), fill, dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad.to(tensor.device)], dim=1)
    local = padded // sp.size
    return tensor[:, sp.rank * local : (sp.rank + 1) * local]


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 to rank i of the group, chunk j of the result from rank j; its
    gradient goes back the same way (the exchange is its own inverse)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # and the result laid out as it (empty_like keeps a view's strides)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllToAll.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


def gather_sequence(x: torch.Tensor, sp: SeqPar) -> torch.Tensor:
    """[B, H, L, D] (all heads, this rank's L positions) -> [B, H/S, S*L, D] (its heads, the
    whole sequence in order)."""
    b, h, n, d = x.shape
    s = sp.size
    x = x.reshape(b, s, h // s, n, d).transpose(0, 1)  # [S, B, H/S, L, D]: chunk i to rank i
    x = _exchange(x, sp.group)  # chunk j: rank j's positions of this rank's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // s, s * n, d)


def scatter_sequence(x: torch.Tensor, sp: SeqPar) -> torch.Tensor:
    """[B, S*L, H/S, D] (attention's output: its heads, the whole sequence) -> [B, L, H, D]
    (all heads, this rank's positions)."""
    b, total, hl, d = x.shape
    s = sp.size
    x = x.reshape(b, s, total // s, hl, d).transpose(0, 1)  # chunk i: rank i's positions
    x = _exchange(x, sp.group)  # chunk j: rank j's heads at this rank's positions
    return x.permute(1, 2, 0, 3, 4).reshape(b, total // s, s * hl, d)


_ACTIVE: list[SeqPar] = []  # the group attention exchanges over, while `active` is open
_CORE: list[Callable[..., Any]] = []  # the attention function the exchange wraps


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' attention call: with a group active, over the whole sequence (causal, the
    local mask dropped: it is for the shard's width); otherwise the wrapped function as is."""
    core = _CORE[0]
    if not _ACTIVE:
        return core(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    sp = _ACTIVE[-1]
    q, k, v = (gather_sequence(t, sp) for t in (query, key, value))
    out, weights = core(module, q, k, v, None, *args, **kwargs)
    return scatter_sequence(out, sp), weights


def install() -> None:
    """Put the exchange in front of transformers' `sdpa` attention, in this process (idempotent).
    Outside `active` it calls the original: generation and held-out scoring are unchanged."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _CORE:
        return
    _CORE.append(ALL_ATTENTION_FUNCTIONS[ATTENTION])
    AttentionInterface.register(ATTENTION, _attention)


@contextlib.contextmanager
def active(sp: SeqPar | None) -> Iterator[None]:
    """Attention exchanges over `sp`'s group while open (a training step's forwards and
    backwards: gradient checkpointing recomputes attention in the backward); None: no-op."""
    if sp is None:
        yield
        return
    install()
    _ACTIVE.append(sp)
    try:
        yield
    finally:
        _ACTIVE.pop()
