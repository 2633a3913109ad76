"""One critic rank (PPO), run as its own process: `python -m stages.rl.roles.critic BRIEF.json`.

Input: the same `ActorBrief` the actor reads (the critic starts from the policy's
checkpoint: its decoder, and a value head initialised to zero) and the rank in the
environment; the critic's ranks form their own torch.distributed job, on the critic
role's devices. Output: answers to the stage's requests: `values` (the value of the state
before each completion token), `train` (the clipped value loss over the batch,
`ppo_epochs` passes, one optimizer step per `train_batch_size` samples, per-token losses
over the step's token count), `offload`/`reload` (the optimizer side, for the hybrid
engine, as the actor's), `save`, `stop`.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from stages.lib.distributed.rank import exit_now, load_model
from stages.rl.roles.trained import TrainedRank

log = logging.getLogger("pipe.rl.critic")


def build_critic(model_dir: str, ds_config: dict[str, Any] | None) -> Any:
    """The policy's decoder with a scalar value head (zero-initialised: values start at 0).
    The decoder loads as the actor's model does (`load_model`: under ZeRO-3 partitioned as it
    is built, no rank holding the whole model); DeepSpeed partitions the small value head,
    made outside `zero.Init`, when it wraps the module."""
    import torch

    class Critic(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.decoder = lm.get_decoder()
            self.config = lm.config
            self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

        def forward(
            self,
            input_ids: Any,
            rows: Any,
            cols: Any,
            attention_mask: Any = None,
            position_ids: Any = None,
            use_cache: bool | None = None,
        ) -> Any:
            """The value of the states at (rows, cols): the decoder over the whole batch
            (padded rows with their mask, or packed rows with their position ids), the head
            over those positions alone."""
            hidden = self.decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
            )
            return self.value_head(hidden.last_hidden_state[rows, cols]).squeeze(-1)

        def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
            self.decoder.gradient_checkpointing_enable(**kwargs)

    return Critic(load_model(model_dir, ds_config))


class CriticRank(TrainedRank):
    """The critic, its trainer, and what each request does."""

    def __init__(self, brief: Any, rank: int, world: int, device: str) -> None:
        super().__init__(brief, rank, world, device, build_critic(brief.model_dir, brief.ds_config))
        self.resume("critic_checkpoints")

    def values(self, payload: dict[str, Any]) -> list[list[float]]:
        import torch

        from stages.rl.algo.logprobs import Sample, completion_values

        samples = [Sample(**s) for s in payload["samples"]]
        out: list[list[float]] = []
        size = self.cfg.micro_train_batch_size
        with torch.no_grad():
            for lo in range(0, len(samples), size):
                chunk = samples[lo : lo + size]
                out += [
                    v.tolist()
                    for v in completion_values(
                        self.trainer.module, chunk, self.device, self.pad_id, self.trainer
                    )
                ]
        return out

    def train(self, payload: dict[str, Any]) -> dict[str, float]:
        """`ppo_epochs` passes over the batch; one optimizer step per `train_batch_size`
        samples, in as many forward/backward passes on every rank (`stages.rl.algo.micro`);
        returns the value loss per token over all ranks."""
        from stages.rl.algo.logprobs import Sample

        samples = [Sample(**s) for s in payload["samples"]]
        rng = random.Random(self.cfg.seed * 7_919 + payload["step"])
        total, tokens = 0.0, 0
        for _ in range(self.cfg.ppo_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for lo in range(0, len(order), self.cfg.train_batch_size):
                chunk = [samples[i] for i in order[lo : lo + self.cfg.train_batch_size]]
                total += self._update(chunk)
                tokens += sum(s.completion_len for s in chunk)
        return {"value_loss": self._sum_over_ranks(total) / max(tokens, 1)}

    def _update(self, chunk: list[Any]) -> float:
        """One optimizer step over `chunk`; returns this rank's summed value loss. Per-token
        losses are divided by the step's token count over all ranks (the trainer averages
        gradients over ranks, hence the factor `world`)."""
        import torch

        from stages.rl.algo.logprobs import completion_values
        from stages.rl.algo.micro import plan_micros
        from stages.rl.algo.ppo import value_loss

        norm = sum(s.completion_len for s in chunk)
        size, dynamic = self.cfg.micro_train_batch_size, self.cfg.use_dynamic_batch
        micros = plan_micros(chunk, self.world, size, dynamic, self.cfg.packing_samples)[self.rank]
        total = 0.0
        for i, planned in enumerate(micros):
            micro = planned or chunk[:1]  # a dummy pass keeps the ranks in step: weight 0
            self.trainer.begin_micro(i == len(micros) - 1)
            values = torch.cat(
                completion_values(
                    self.trainer.module,
                    micro,
                    self.device,
                    self.pad_id,
                    self.trainer,
                    self.cfg.packing_samples,
                )
            )
            old = torch.tensor([v for s in micro for v in s.old_values], device=self.device)
            ret = torch.tensor([v for s in micro for v in s.returns], device=self.device)
            loss = value_loss(values, old, ret, self.cfg.eps_clip).sum()
            self.trainer.backward(loss * (self.world / norm if planned else 0.0))
            total += loss.item() if planned else 0.0
        self.trainer.step()
        return total

    def _sum_over_ranks(self, value: float) -> float:
        """`value` summed over the critic's ranks (NCCL reduces device tensors only)."""
        if self.world == 1:
            return value
        import torch
        import torch.distributed as dist

        reduced = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced)
        return float(reduced.item())

    def save(self, payload: dict[str, Any]) -> str:
        root = f"{self.brief.stage_dir}/critic_checkpoints"
        self.trainer.save(root, payload["tag"])
        return f"{root}/{payload['tag']}"


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(
        run_role(
            None,
            log,
            CriticRank,
            lambda c: {
                "values": c.values,
                "train": c.train,
                "save": c.save,
                "offload": c.offload,
                "reload": c.reload,
            },
            seed_offset=1,
        )
    )
