"""What the stage process hands each training rank: one typed, validated brief file.

Input: written by `stages.train.run` as `<stage_dir>/train_brief.json`.
Output: read once per rank by `stages.train.worker` (`WorkerBrief.read`), validated
there, so the rank trains on exactly the resolved `TrainConfig` the engine made.
"""

from __future__ import annotations

from stages.lib.distributed.brief import RankBrief
from stages.train import TrainConfig


class WorkerBrief(RankBrief):
    """The resolved config and what the stage process decided before launching the ranks
    (where the model, the folder, the device, the trainer: `RankBrief`'s fields)."""

    config: TrainConfig
    tune_threads: bool
    resume_key: str
    save_dtype: str  # the final checkpoint's dtype (`stages.lib.model.dtypes.resolve_save_dtype`)
