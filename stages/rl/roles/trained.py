"""What the actor's and the critic's ranks share: a model trained on this rank.

Input: the `ActorBrief`, this rank's place (rank, world size, device) and the role's model.
Output: the trainer around the model (`stages.lib.distributed.rank.make_trainer`, its schedule over
the run's `total_updates`), resumed from the brief's tag when it names one, and the hybrid
engine's `offload` / `reload` requests.
"""

from __future__ import annotations

from typing import Any

from stages.lib.chat.tokens import pad_id
from stages.lib.distributed.rank import make_trainer


class TrainedRank:
    """A trained role's rank: the brief and its config, where the rank runs, its trainer."""

    def __init__(self, brief: Any, rank: int, world: int, device: str, model: Any) -> None:
        self.brief, self.cfg = brief, brief.config
        self.rank, self.world, self.device = rank, world, device
        self.pad_id = pad_id(None, model.config)
        self.trainer = make_trainer(
            brief.trainer, brief.ds_config, self.cfg, model, brief.total_updates, device
        )

    def resume(self, folder: str) -> bool:
        """The trainer's state at the brief's resume tag, from `<stage_dir>/<folder>`;
        whether the brief names one."""
        if not self.brief.resume_tag:
            return False
        self.trainer.load(f"{self.brief.stage_dir}/{folder}", self.brief.resume_tag)
        return True

    def offload(self, payload: Any) -> str:
        """The optimizer side off the GPU while the engine generates (hybrid engine; how:
        `stages.lib.distributed.sleep`); what moved."""
        return str(self.trainer.offload())

    def reload(self, payload: Any) -> str:
        """The optimizer side back on the GPU before the next update."""
        return str(self.trainer.reload())
