"""One rank of the `ref` role, run as its own process: `python -m stages.rl.roles.ref BRIEF.json`.

Input: the `ActorBrief` the actor reads (its ds_config says whether ZeRO-3 splits the
weights) and the rank in the environment; the ref role's ranks form their own
torch.distributed job on the role's devices (`stages.rl.roles.frozen` says when it has them).
Output: answers to the stage's requests: `ref_logprobs` (each sample's completion
log-probabilities under the frozen reference, in the compute dtype; every rank scores every
world-th sample, in as many passes as the busiest rank, and rank 0 returns them in order),
`stop`.
"""

from __future__ import annotations

import logging
from typing import Any

from stages.lib.chat.tokens import pad_id
from stages.lib.distributed.rank import exit_now
from stages.rl.roles.frozen import load_reference, reference_logprobs
from stages.rl.roles.rank_process import gather_shares, log_placed

log = logging.getLogger("pipe.rl.ref")


class RefRank:
    """One rank of the `ref` role: the frozen reference, scoring its share of each batch."""

    WHAT = "reference"  # the frozen model it holds (`stages.rl.roles.teacher`: the teacher)

    def __init__(self, brief: Any, rank: int, world: int, device: str) -> None:
        self.brief, self.cfg = brief, brief.config
        self.rank, self.world, self.device = rank, world, device
        self.module, self.engine = load_reference(
            brief.model_dir, self.cfg.bf16, brief.ds_config, device
        )
        self.pad_id = pad_id(None, self.module.config)
        self.kind = f"frozen {self.WHAT}, {next(self.module.parameters()).dtype}"
        log_placed(log, self.WHAT, rank, world, self.kind)
        if self.engine is not None:
            params = list(self.module.parameters())
            held = sum(p.ds_tensor.numel() for p in params)
            log.info(
                "zero 3: %d of %d elements held on this rank", held, sum(p.ds_numel for p in params)
            )

    def ref_logprobs(self, payload: dict[str, Any]) -> list[list[float]] | None:
        """Every world-th sample from this rank; rank 0 returns them all, in order."""
        from stages.rl.algo.logprobs import Sample

        samples = [Sample(**s) for s in payload["samples"]]
        mine = samples[self.rank :: self.world]
        size = self.cfg.micro_train_batch_size
        busiest = -(-len(samples) // self.world)
        passes = -(-busiest // size)  # ZeRO-3: every rank in every pass
        scored = reference_logprobs(self.module, mine, self.device, self.cfg, self.pad_id, passes)
        return gather_shares(scored, len(samples), self.rank, self.world)


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(run_role(None, log, RefRank, lambda r: {"ref_logprobs": r.ref_logprobs}))
