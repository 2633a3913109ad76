"""The step loop of one rank: micro batches -> loss -> optimizer step, logging, checkpoints.

Input: a `Trainer`, the `BatchPlan`, the `TrainingSet`, and where to write.
Output: the trained `Trainer` (weights in place), `<stage_dir>/loss.jsonl`
(one line per step, rank 0), resumable checkpoints every `save_steps` and at
the end, and the run's counters.

Each step's loss is the mean over the whole global batch: the summed loss of
every response token (SFT) or pair (DPO, RM) divided by the global batch's count,
so micro batches and ranks of different sizes weigh what they hold. The
reported loss is all-reduced over ranks; nothing else crosses ranks per step, but for
attention's exchanges within a sequence-parallel group (`ring_attn_size`: each rank of a
group takes the group's micro batches and holds a share of every row; its summed loss is its
share's, and the shares add up to the rows').

One name, two sides of one concept (a kind's step loop: one train rank's;
`stages/rl/controller/loop.py`: the rl controller's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stages.lib.distributed import seqpar
from stages.lib.distributed.seqpar import SeqPar
from stages.lib.io.metrics import Metrics
from stages.lib.model.logits import flat_head
from stages.train import ckpt as train_ckpt
from stages.train.batch_plan import BatchPlan, Micro, Step
from stages.train.data import TrainingSet
from stages.train.heldout import HeldOut
from stages.train.loss import Batch, collate, dpo_terms, sequence_logprobs, sft_loss_sum
from stages.train.pairwise import HeldOutPairs, reward_loss
from stages.train.threads import ThreadTuner

if TYPE_CHECKING:
    from stages.train import TrainConfig

log = logging.getLogger("pipe.train")
LOG_EVERY_S = 30.0


@dataclass
class Counters:
    """What a run has done: carried over a resume through the checkpoint."""

    step: int = 0
    tokens: int = 0
    samples: int = 0
    train_time_s: float = 0.0
    run_tokens: int = 0  # this process's run only (tokens/s of this run)
    run_samples: int = 0
    run_time_s: float = 0.0
    run_steps: int = 0
    stopped: bool = False  # the held-out target was reached: training is over
    last: dict[str, float] = field(default_factory=dict)

    def state(self) -> dict[str, Any]:
        return {
            "stopped": self.stopped,
            "step": self.step,
            "tokens": self.tokens,
            "samples": self.samples,
            "train_time_s": round(self.train_time_s, 3),
        }


@dataclass
class Loop:
    """One rank's training loop."""

    cfg: TrainConfig
    trainer: Any
    plan: BatchPlan
    data: TrainingSet
    device: str
    pad_id: int
    stage_dir: str
    rank: int = 0
    world: int = 1
    reference: torch.nn.Module | None = None
    resume_key: str = ""
    threads: ThreadTuner | None = None  # num_threads: auto
    held_out: HeldOut | HeldOutPairs | None = None  # eval_input: scored every eval_steps
    sp: SeqPar | None = None  # ring_attn_size > 1: this rank's sequence-parallel group
    counters: Counters = field(default_factory=Counters)
    _ref_cache: dict[int, torch.Tensor] = field(default_factory=dict)

    # --- one step --------------------------------------------------------------

    def run_step(self, step: Step) -> dict[str, float]:
        """Forward and backward every micro batch of this rank, then update."""
        units = self.data.units
        if self.cfg.algorithm != "sft":  # dpo, rm: every pair weighs the same
            norm = len(step.units)
        else:
            norm = sum(self.data.examples[s].response_len for u in step.units for s in units[u])
        sp = self.sp  # its ranks take their group's micro batches, each a share of every row
        micros = step.micro[self.rank if sp is None else sp.dp_rank]
        lr = self.trainer.lr()  # the rate this step's update uses
        sums = torch.zeros(3, dtype=torch.float64)  # loss; pairs: right-order count, margin/gap
        for i, micro in enumerate(micros):
            self.trainer.begin_micro(i == len(micros) - 1)
            batch = collate(micro, self.data.examples, self.pad_id, self.cfg.packing_samples)
            if sp is not None:
                batch = batch.shard(sp)
            with seqpar.active(sp):  # backward too: checkpointing recomputes attention there
                loss_sum, extra = self._micro_loss(micro, batch)
                # a shard's sum over the global count, x world: the trainers' average over the
                # ranks is the sequence-parallel ranks' sum (`stages.lib.distributed.seqpar`)
                self.trainer.backward(loss_sum * (self.world / norm))
            sums += torch.tensor([loss_sum.item(), *extra], dtype=torch.float64)
        grad_norm = self.trainer.step()
        if self.world > 1:  # NCCL reduces device tensors only
            reduced = sums.to(self.device)
            dist.all_reduce(reduced)
            sums = reduced.cpu()
        out = {"loss": float(sums[0]) / norm, "lr": lr}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        if self.cfg.algorithm != "sft":
            out["accuracy"] = float(sums[1]) / norm
            out["margin" if self.cfg.algorithm == "dpo" else "reward_gap"] = float(sums[2]) / norm
        return out

    def _micro_loss(self, micro: Micro, batch: Batch) -> tuple[torch.Tensor, list[float]]:
        """One micro batch's forward and summed loss."""
        if self.cfg.algorithm == "rm":  # a scalar head: no vocabulary logits
            return reward_loss(self.trainer, micro, batch, self.data, self.device)
        scored = batch.scored(self.device)  # logits only where the loss reads them
        with flat_head(self.trainer.module, scored):
            logits = self.trainer.forward(batch.model_inputs(self.device))
        return self._loss(micro, batch, scored, logits)

    def _loss(
        self, micro: Micro, batch: Batch, scored: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[float]]:
        """The micro batch's summed loss from `logits` at its `scored` positions."""
        if self.cfg.algorithm != "dpo":
            return sft_loss_sum(logits, batch.at(scored)), [0.0, 0.0]
        if micro.dummy:
            return logits.sum() * 0.0, [0.0, 0.0]
        order = self._pair_order(micro, batch)
        policy = sequence_logprobs(logits, batch.at(scored))[order]
        losses, margins = dpo_terms(policy, self._reference(micro, batch, order), self.cfg.beta)
        return losses.sum(), [float((margins > 0).sum()), float(margins.sum())]

    def _pair_order(self, micro: Micro, batch: Batch) -> torch.Tensor:
        slot = {s: i for i, s in enumerate(batch.seqs)}
        order = [slot[s] for u in micro.units for s in self.data.units[u]]
        return torch.tensor(order, device=self.device)

    def _reference(self, micro: Micro, batch: Batch, order: torch.Tensor) -> torch.Tensor:
        """The frozen reference model's (chosen, rejected) log-probabilities, cached per pair
        (with LoRA the policy's own base, its adapters disabled, as TRL does with peft)."""
        if any(u not in self._ref_cache for u in micro.units):
            scored = batch.scored(self.device)
            model, frozen = self.reference, contextlib.nullcontext()
            if model is None:  # LoRA: the reference is the frozen base, the adapters off
                model = self.trainer.module
                frozen = model.disable_adapter()
            with torch.no_grad(), frozen, flat_head(model, scored):
                logits = model(**batch.model_inputs(self.device)).logits
                lp = sequence_logprobs(logits, batch.at(scored))[order].detach()
            for k, u in enumerate(micro.units):
                self._ref_cache[u] = lp[2 * k : 2 * k + 2]
        return torch.cat([self._ref_cache[u] for u in micro.units])

    # --- the loop ----------------------------------------------------------------

    def run(self) -> Counters:
        """Train from `counters.step` to the plan's last step."""
        c, total = self.counters, self.plan.total_steps
        last_log = time.perf_counter()
        with contextlib.ExitStack() as stack:
            loss_log, track = None, Metrics(None)
            if self.rank == 0:
                loss_log = stack.enter_context(
                    open(f"{self.stage_dir}/loss.jsonl", "a", encoding="utf-8")
                )
                track = Metrics(self.stage_dir)
            while c.step < total and not c.stopped:
                if self.threads is not None:
                    torch.set_num_threads(self.threads.threads_for(c.run_steps))
                t = time.perf_counter()
                step = self.plan.step(c.step)
                record = self.run_step(step)
                seconds = time.perf_counter() - t
                tokens = self._count(step, seconds)
                if self.threads is not None:
                    self.threads.record(c.run_steps - 1, tokens, seconds)
                c.last = {"step": c.step, **record, "epoch": step.epoch, "tokens": c.tokens}
                if self.held_out is not None and (
                    c.step % self.cfg.eval_steps == 0
                    or (self.cfg.algorithm == "rm" and c.step == total)  # and at the end
                ):
                    c.last["eval_accuracy"] = self._held_out()
                    target = self.cfg.target_accuracy
                    c.stopped = target is not None and c.last["eval_accuracy"] >= target
                if loss_log is not None:
                    loss_log.write(json.dumps(c.last) + "\n")
                    per_s = {"tokens_per_s": tokens / max(seconds, 1e-9)}
                    track.log(c.step, {**c.last, **per_s, "step": None})
                now = time.perf_counter()
                if (
                    c.step % self.cfg.logging_steps == 0
                    or c.step == total
                    or now - last_log > LOG_EVERY_S
                ):
                    self._progress(c.last, total)
                    last_log = now
                if c.stopped and self.rank == 0:
                    log.info(
                        "held-out accuracy %.3f reached the target %.3f at step %d: done",
                        c.last["eval_accuracy"],
                        self.cfg.target_accuracy,
                        c.step,
                    )
                if c.step % self.cfg.save_steps == 0 or c.step == total or c.stopped:
                    if loss_log is not None:
                        loss_log.flush()
                    self._save(step)
        return c

    def _held_out(self) -> float:
        """Held-out greedy accuracy: every rank generates its share of the prompts with the
        model as it is (under ZeRO-3 each forward gathers the weights on all ranks, which
        therefore run in lockstep: `HeldOut.accuracy`), the counts summed over the ranks;
        every rank gets the figure."""
        assert self.held_out is not None
        right, total = self.held_out.accuracy(self.trainer.module, self.rank, self.world)
        if self.world > 1:
            shared = torch.tensor([right, total], dtype=torch.float64, device=self.device)
            dist.all_reduce(shared)
            right, total = int(shared[0].item()), int(shared[1].item())
        score = right / max(total, 1)
        if self.rank == 0:
            log.info("step %d: held-out accuracy %.3f", self.counters.step, score)
        return score

    def _count(self, step: Step, seconds: float) -> int:
        """Add a finished step to the counters; its real tokens."""
        c = self.counters
        tokens = sum(
            len(self.data.examples[s].input_ids) for u in step.units for s in self.data.units[u]
        )
        c.step += 1
        c.run_steps += 1
        c.tokens += tokens
        c.run_tokens += tokens
        c.samples += len(step.units)
        c.run_samples += len(step.units)
        c.train_time_s += seconds
        c.run_time_s += seconds
        return tokens

    def _progress(self, record: dict[str, Any], total: int) -> None:
        if self.rank != 0:
            return
        c = self.counters
        rate = c.run_steps / max(c.run_time_s, 1e-9)
        extra = f" accuracy {record['accuracy']:.3f}" if "accuracy" in record else ""
        log.info(
            "step %d/%d loss %.4f%s lr %.2e tokens/s %.0f samples/s %.1f steps/s %.2f eta %.0fs",
            c.step,
            total,
            record["loss"],
            extra,
            record["lr"],
            c.run_tokens / max(c.run_time_s, 1e-9),
            c.run_samples / max(c.run_time_s, 1e-9),
            rate,
            (total - c.step) / max(rate, 1e-9),
        )

    def _save(self, step: Step) -> None:
        t = time.perf_counter()
        state = {
            **self.counters.state(),
            "epoch": (step.index + 1) // self.plan.steps_per_epoch,
            "batch_in_epoch": (step.index + 1) % self.plan.steps_per_epoch,
            "total_steps": self.plan.total_steps,
            "world_size": self.world,
            "resume_key": self.resume_key,
        }
        root = f"{self.stage_dir}/checkpoints"
        train_ckpt.save(self.trainer, root, self.counters.step, state, self.rank)
        if self.rank == 0:
            log.info(
                "saved checkpoint at step %d in %.2fs", self.counters.step, time.perf_counter() - t
            )
