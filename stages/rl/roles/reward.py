"""One rank of the `reward` role, run as its own process: `python -m stages.rl.roles.reward BRIEF`.

Input: the `ActorBrief` the actor reads, its `model_dir` the reward model's (a scalar-head
checkpoint, `stages.lib.model.reward_model`), and the rank in the environment; the role's
ranks form their own torch.distributed job on the reward role's devices (its own GPUs in the
ratio, or shared with the critic's under `colocate: [[critic, reward]]`, or on the CPU).
Output: answers to the stage's requests: `reward_scores` (each sequence's score, in the
compute dtype, in micro batches of `micro_train_batch_size`; every rank scores every
world-th sequence and rank 0 returns them in order), `stop`. And `RewardRanks`, the
controller's side: started with the other roles, asked for each rollout batch's scores
before its rewards and advantages are made.

The reward model is whole on every rank (not split by ZeRO-3): the memory model counts it so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from stages.lib.distributed.rank import exit_now

log = logging.getLogger("pipe.rl.reward")


class RewardRank:
    """One rank of the `reward` role: the frozen reward model, scoring its share of a batch."""

    def __init__(self, brief: Any, rank: int, world: int, device: str) -> None:
        from stages.lib.chat.tokens import pad_id
        from stages.lib.model.reward_model import load_reward_model
        from stages.rl.roles.rank_process import log_placed

        self.cfg, self.rank, self.world = brief.config, rank, world
        self.model = load_reward_model(brief.model_dir, self.cfg.bf16, device)
        self.pad_id = pad_id(None, self.model.config)
        self.kind = f"reward model, {next(self.model.parameters()).dtype}"
        log_placed(log, "reward model", rank, world, self.kind)

    def reward_scores(self, payload: dict[str, Any]) -> list[float] | None:
        """Every world-th sequence from this rank; rank 0 returns them all, in order."""
        from stages.lib.model.reward_model import score
        from stages.rl.roles.rank_process import gather_shares

        sequences = payload["sequences"]
        mine = sequences[self.rank :: self.world]
        scored = score(self.model, mine, self.cfg.micro_train_batch_size, self.pad_id)
        return gather_shares(scored, len(sequences), self.rank, self.world)


class RewardRanks:
    """The controller's side of the reward role's ranks: started where the role's devices
    are (`Roles.start`), asked for each batch's scores, stopped with the stage."""

    def __init__(self, roles: Any, host: str, brief: Any, model_dir: str) -> None:
        """`brief`: the actor's; the ranks take their own channel and the reward model's
        folder, and no ds_config (the model is whole on every rank)."""
        from stages.rl.roles.channel import StageEnd

        self.roles, self.end = roles, StageEnd(host)
        update = {
            "channel": self.end.address,
            "authkey": self.end.authkey.hex(),
            "model_dir": model_dir,
            "ds_config": None,
        }
        self.thread = roles.start("reward", brief.model_copy(update=update), self.end)

    def alive(self) -> bool:
        return bool(
            self.thread.is_alive() if self.thread is not None else self.roles.remote_alive()
        )

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """Each token id sequence's score from the reward role's ranks."""
        payload = {"sequences": [list(s) for s in sequences]}
        scored = self.end.request("reward_scores", payload, timeout_s=3600, alive=self.alive)
        return [float(x) for x in scored]

    def stop(self) -> None:
        self.end.request("stop", timeout_s=600, alive=self.alive)
        if self.thread is not None:
            self.thread.join(timeout=120)


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(run_role(None, log, RewardRank, lambda r: {"reward_scores": r.reward_scores}))
