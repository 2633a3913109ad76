"""The actor's side of the mismatch figures and of the mismatch corrections (`tis_mode`).

Input: a step's samples (with the engine's log-probabilities, the behaviour policy mu), the
actor's model and trainer, and how the step cuts them into micro batches. Output: the
figures reduced over the ranks (`gap_figures`); with a correction, the actor's own
log-probabilities of every sample before the step's first update (pi_old, `proximal`) and
each token's importance weight, the figures over all of them, the weights' statistics, and
the samples with the tokens a mask mode took out of the loss out of their loss mask.

Which weights the figures see: the first optimizer step's forward of the first ppo epoch
runs on the weights the engine sampled with, in synchronous steps; so does the no-grad pass
of `proximal`. With `async_train` the engine may have sampled a version behind, and the
figures then include that staleness (the step's row records it beside them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from stages.rl.algo.correction import correct
from stages.rl.algo.logprobs import Sample, completion_logprobs
from stages.rl.algo.mismatch import Gap, tis_stats
from stages.rl.algo.options import correction_of


def gap_figures(gap: Gap, world: int, device: str) -> dict[str, float]:
    """The figures over every rank's tokens: the sums added, the largest kept."""
    if world > 1:  # NCCL reduces device tensors only
        import torch.distributed as dist

        sums = torch.tensor(gap.as_sums(), dtype=torch.float64, device=device)
        top = torch.tensor([gap.max], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        gap = Gap.of(sums.tolist(), float(top[0]))
    return gap.figures()


def proximal(
    actor: Any,
    samples: Sequence[Sample],
    steps: Sequence[Sequence[Sample]],
    plan: Callable[[list[Any]], list[list[Any]]],
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict[str, float], list[Sample]]:
    """Per corrected sample (by `id`), the actor's log-probabilities of its completion before
    any update of the step, without gradients, and its tokens' importance weights; the
    figures and the weights' statistics over every sample; and the samples, each with the
    tokens a mask mode took out of the loss out of its loss mask (the others as they were).
    This rank scores its micro batches (`plan`) of the first epoch's optimizer `steps`, as
    many passes as every other rank (ZeRO-3 gathers weights in each; an empty micro batch is
    a dummy pass), and the ranks add their shares up, so each holds every sample's."""
    cfg, device = actor.cfg, actor.device
    c = correction_of(cfg)
    assert c is not None, "proximal runs with a mismatch correction only"
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
    lengths = [s.completion_len for s in samples]
    weights, keep, raw = correct(flat, mu, mask, lengths, c)
    gap = Gap()
    gap.add(flat, mu, mask, lengths)
    gap.mask_out(keep, mask, lengths)
    stats = gap.figures() | tis_stats(weights, raw, c.cap, mask * keep, not c.masks)
    by_sample, out = {}, []
    for s in samples:
        lo, hi = offsets[id(s)], offsets[id(s)] + s.completion_len
        kept = keep[lo:hi]
        if c.masks and bool((kept < 1.0).any()):
            s = replace(s, mask=tuple(int(m) for m in (mask[lo:hi] * kept).tolist()))
        by_sample[id(s)] = (flat[lo:hi], weights[lo:hi])
        out.append(s)
    return by_sample, stats, out
