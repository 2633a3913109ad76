"""The actor's `train` request: the policy update over one rollout batch.

Input: the `Actor` of this rank (its config, trainer, reference, rank and world) and the
batch's samples (token ids, the engine's log-probabilities, advantages). Output: the update
applied on every rank, and the batch's statistics: loss, KL, clip fraction and entropy per
token over all ranks, updates, tokens, learning rate, mean gradient norm, and the mismatch
figures (`stages.rl.roles.proximal`).

`ppo_epochs` passes over the batch, one optimizer step per `train_batch_size` samples
(`stages.rl.algo.micro.epoch_steps`). Every rank trains on its share of a step's samples in
as many forward/backward passes as every other rank (an empty micro batch is a dummy pass of
weight 0), the trainer averages the gradients, and per-token losses are divided by the
step's token count over all ranks (`loss_agg`: `stages.rl.algo.loss.token_scale`).
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import torch

from stages.rl.algo.logprobs import Sample, completion_logprobs
from stages.rl.algo.loss import masked_policy_terms, token_scale
from stages.rl.algo.micro import epoch_steps, plan_micros
from stages.rl.algo.mismatch import Gap
from stages.rl.algo.options import correction_of, per_token_returns
from stages.rl.roles.proximal import gap_figures, proximal

STATS = ("loss", "kl", "clip_frac", "entropy")


def train(actor: Any, payload: dict[str, Any]) -> dict[str, float]:
    """`ppo_epochs` passes over the batch; one optimizer step per `train_batch_size`.
    Also the mismatch figures (`stages.rl.algo.mismatch`): on the loss's tokens of the first
    optimizer step, from its forward before the update (with a `tis_mode` correction: over
    every sample, from the no-grad pass that gives the ratio its pi_old, and the weights; a
    mask mode's tokens then train as the loss mask's 0s: out of the loss and of the token
    counts that divide it)."""
    cfg = actor.cfg
    samples = [Sample(**s) for s in payload["samples"]]
    rng = random.Random(cfg.seed * 1_000_003 + payload["step"])
    epochs = epoch_steps(samples, rng, cfg.ppo_epochs, cfg.train_batch_size)
    totals: dict[str, float] = dict.fromkeys(STATS, 0.0)
    tokens = updates = 0
    norms = []
    figures: dict[str, float] = {}
    actor.pi_old = None
    if correction_of(cfg) is not None:
        plan = partial(micro_batches, actor)
        actor.pi_old, figures, corrected = proximal(actor, samples, epochs[0], plan)
        swap = {id(s): c for s, c in zip(samples, corrected, strict=True)}
        epochs = [[[swap[id(s)] for s in chunk] for chunk in epoch] for epoch in epochs]
    for chunks in epochs:
        for chunk in chunks:
            gap = Gap() if updates == 0 and actor.pi_old is None else None
            step_stats, norm = update(actor, chunk, gap)
            if gap is not None:
                figures = gap_figures(gap, actor.world, actor.device)
            for k, v in step_stats.items():
                totals[k] += v
            tokens += sum(s.trained_len for s in chunk)
            updates += 1
            if norm is not None:
                norms.append(norm)
    out = {k: v / max(tokens, 1) for k, v in totals.items()}
    out.update(updates=updates, tokens=tokens, lr=actor.trainer.lr(), **figures)
    if norms:
        out["grad_norm"] = sum(norms) / len(norms)
    return out


def micro_batches(actor: Any, chunk: list[Any]) -> list[list[Any]]:
    """This rank's micro batches of the step `chunk`, as many as every other rank's (an
    empty one is a dummy pass: `stages.rl.algo.micro`)."""
    cfg = actor.cfg
    size, dynamic = cfg.micro_train_batch_size, cfg.use_dynamic_batch
    return plan_micros(chunk, actor.world, size, dynamic, cfg.packing_samples)[actor.rank]


def update(actor: Any, chunk: list[Any], gap: Any = None) -> tuple[dict[str, float], float | None]:
    """One optimizer step over `chunk` (this rank takes every world-th sample, in as many
    forward/backward passes as every other rank); `gap`: adds up `|new - old|` of its
    tokens before the update."""
    norm = sum(s.trained_len for s in chunk)  # the step's trained tokens, over all ranks
    sequences = sum(1 for s in chunk if s.trained_len)  # those with a token in the loss
    micros = micro_batches(actor, chunk)
    sums = torch.zeros(4, dtype=torch.float64)
    divisor = norm
    for i, planned in enumerate(micros):
        micro = planned or chunk[:1]  # a dummy pass keeps the ranks in step: weight 0
        lengths = [(s.completion_len, s.trained_len) for s in micro]
        per_token, divisor = token_scale(actor.cfg.loss_agg, lengths, sequences, norm)
        weight = actor.world / divisor if planned else 0.0
        actor.trainer.begin_micro(i == len(micros) - 1)
        loss, kl, clipped, ent, mask = _policy_terms(
            actor, micro, lengths, per_token, gap if planned else None
        )
        actor.trainer.backward(loss * weight)
        n = float(mask.sum()) if planned else 0.0
        sums += torch.tensor(
            [
                loss.item() * (n > 0),
                kl.item() * (n > 0),
                clipped.item() * (n > 0),
                float(ent or 0.0) * n,
            ],
            dtype=torch.float64,
        )
    grad_norm = actor.trainer.step()
    if actor.world > 1:  # NCCL reduces device tensors only
        import torch.distributed as dist

        reduced = sums.to(actor.device)
        dist.all_reduce(reduced)
        sums = reduced.cpu()
    stats = dict(zip(STATS, sums.tolist(), strict=True))
    stats["loss"] *= norm / divisor  # the step's objective x its tokens (train: / tokens)
    return stats, grad_norm


def _policy_terms(
    actor: Any, micro: list[Any], lengths: list[tuple[int, int]], per_token: Any, gap: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    """One micro batch's summed clipped policy loss (with the k3 KL for grpo), its KL and
    clip fraction, its mean entropy and its loss mask; `gap` adds up `|new - old|`."""
    cfg, device = actor.cfg, actor.device
    new, ent = completion_logprobs(
        actor.trainer.module,
        micro,
        device,
        cfg.temperature,
        actor.pad_id,
        True,
        actor.trainer,  # the top-level forward: DeepSpeed's engine, or torch's autocast
        cfg.packing_samples,
    )
    new_t = torch.cat(new)
    old = torch.tensor([lp for s in micro for lp in s.old_logprobs], device=device)
    tis = None
    if actor.pi_old is not None:  # the ratio against pi_old, weighted from pi_old / mu
        old = torch.cat([actor.pi_old[id(s)][0] for s in micro])
        tis = torch.cat([actor.pi_old[id(s)][1] for s in micro])
    adv = torch.tensor(
        [a for s in micro for a in (s.advantages or [s.advantage] * s.completion_len)],
        device=device,
    )
    # observation tokens of a multi-turn episode carry no loss and no KL
    mask = torch.tensor([m for s in micro for m in s.loss_mask()], device=device)
    # ppo and reinforce_pp: the KL is in the reward, not in the loss
    with_kl = cfg.kl_coef > 0 and not per_token_returns(cfg)
    ref = _reference(actor, micro) if with_kl else None
    if gap is not None:
        gap.add(new_t, old, mask, [n for n, _ in lengths])
    scale = None if per_token is None else torch.tensor(per_token, device=device)
    seqs = [n for n, _ in lengths] if cfg.ratio_level == "sequence" else None  # GSPO
    loss, kl, clipped = masked_policy_terms(
        new_t,
        old,
        adv,
        mask,
        cfg.eps_clip,
        ref,
        cfg.kl_coef,
        tis,
        eps_clip_high=cfg.eps_clip_high,
        lengths=seqs,
        scale=scale,
    )
    return loss, kl, clipped, ent, mask


def _reference(actor: Any, micro: list[Any]) -> torch.Tensor:
    """The reference's log-probabilities of `micro`'s completion tokens, flat: sent with
    the samples (the ref role's own ranks scored them), or scored here."""
    if all(s.ref_logprobs for s in micro):
        flat = [x for s in micro for x in s.ref_logprobs]
        return torch.tensor(flat, device=actor.device)
    assert actor.reference is not None, "no reference here and none sent with the samples"
    with torch.no_grad():  # one pass per micro batch, as the actor's own
        ref, _ = completion_logprobs(
            actor.reference,
            micro,
            actor.device,
            actor.cfg.temperature,
            actor.pad_id,
            packed=actor.cfg.packing_samples,
        )
    return torch.cat(ref).float()
