"""What the rl stage hands its actor ranks: one typed, validated brief file.

Input: written by the stage (`stages.rl.run`) as `<stage_dir>/actor_brief.json`.
Output: read once per actor rank (`ActorBrief.read`): the resolved `RLConfig`, the
model directory, the device, the trainer and its ds_config, where the controller
listens, and how weights reach the engine.
"""

from __future__ import annotations

from typing import Literal

from stages.lib.distributed.brief import RankBrief
from stages.rl import RLConfig


class ActorBrief(RankBrief):
    """The resolved config and what the stage decided before launching the actor (where
    the model, the folder, the device, the trainer: `RankBrief`'s fields)."""

    config: RLConfig
    channel: str  # host:port of the stage's listener
    authkey: str  # hex
    sync_backend: Literal["nccl", "gloo", "disk"]
    sync_store: str  # host:port of the weight-sync rendezvous (gloo, nccl)
    sync_world: int = 2  # the sync group: actor rank 0 and every engine
    resume_tag: str | None
    total_updates: int
    ref_in_actor: bool = False  # kl_coef > 0 and the ref role has no devices of its own
    teacher_dir: str | None = None  # the teacher's folder (on-policy distillation)
    teacher_in_actor: bool = False  # a teacher, and the teacher role has no devices of its own
    save_dtype: str = (
        "float32"  # the final checkpoint's (`stages.lib.model.dtypes.resolve_save_dtype`)
    )
