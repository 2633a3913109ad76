"""The actor's side of the mismatch figure and of truncated importance sampling.

Input: a step's samples (with the engine's log-probabilities, the behaviour policy mu), the
actor's model and trainer, and how the step cuts them into micro batches. Output: the
figure reduced over the ranks (`gap_figures`); with `tis_cap`, the actor's own
log-probabilities of every sample before the step's first update (pi_old, `proximal`), the
figure over all of them, and the truncated importance weights' statistics.

Which weights the figure sees: the first optimizer step's forward of the first ppo epoch
runs on the weights the engine sampled with, in synchronous steps; so does the no-grad pass
of `proximal`. With `async_train` the engine may have sampled a version behind, and the
figure then includes that staleness (the step's row records it beside the figure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from stages.rl.algo.logprobs import Sample, completion_logprobs
from stages.rl.algo.loss import tis_weights
from stages.rl.algo.mismatch import Gap, tis_stats


def gap_figures(gap: Gap, world: int, device: str) -> dict[str, float]:
    """The figures over every rank's tokens: sum and count added, the largest kept."""
    if world > 1:  # NCCL reduces device tensors only
        import torch.distributed as dist

        sums = torch.tensor([gap.total, gap.count], dtype=torch.float64, device=device)
        top = torch.tensor([gap.max], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        gap = Gap(float(sums[0]), float(sums[1]), float(top[0]))
    return gap.figures()


def proximal(
    actor: Any,
    samples: Sequence[Sample],
    steps: Sequence[Sequence[Sample]],
    plan: Callable[[list[Any]], list[list[Any]]],
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per sample (by `id`), the actor's log-probabilities of its completion before any
    update of the step, without gradients; and the mismatch figure and the truncated weights'
    statistics over every sample. This rank scores its micro batches (`plan`) of the first
    epoch's optimizer `steps`, as many passes as every other rank (ZeRO-3 gathers weights in
    each; an empty micro batch is a dummy pass), and the ranks add their shares up, so each
    holds every sample's."""
    cfg, device = actor.cfg, actor.device
    offsets, at = {}, 0
    for s in samples:
        offsets[id(s)] = at
        at += s.completion_len
    flat = torch.zeros(at, dtype=torch.float32, device=device)
    with torch.no_grad():
        for chunk in steps:
            for planned in plan(list(chunk)):
                micro = planned or list(chunk[:1])
                lp, _ = completion_logprobs(
                    actor.trainer.module,
                    micro,
                    device,
                    cfg.temperature,
                    actor.pad_id,
                    call=actor.trainer,
                    packed=cfg.packing_samples,
                )
                for s, x in zip(planned, lp, strict=False):  # none for a dummy pass
                    flat[offsets[id(s)] : offsets[id(s)] + s.completion_len] = x.float()
    if actor.world > 1:
        import torch.distributed as dist

        dist.all_reduce(flat)  # each sample scored on exactly one rank
    mu = torch.tensor([x for s in samples for x in s.old_logprobs], device=device)
    mask = torch.tensor([m for s in samples for m in s.loss_mask()], device=device)
    gap = Gap()
    gap.add(flat, mu, mask)
    raw = torch.exp(flat - mu)
    stats = gap.figures() | tis_stats(tis_weights(flat, mu, cfg.tis_cap), raw, cfg.tis_cap, mask)
    by_sample = {id(s): flat[offsets[id(s)] : offsets[id(s)] + s.completion_len] for s in samples}
    return by_sample, stats
