"""What the stage process hands each training rank: one typed, validated spec file.

Input: written by `stages.train.run` as `<stage_dir>/train_spec.json`.
Output: read once per rank by `stages.train.worker` (`WorkerSpec.read`), validated
there, so the rank trains on exactly the resolved `TrainConfig` the engine made.
"""

from __future__ import annotations

from stages.lib.distributed.spec import RankSpec
from stages.train import TrainConfig


class WorkerSpec(RankSpec):
    """The resolved config and what the stage process decided before launching the ranks
    (where the model, the folder, the device, the trainer: `RankSpec`'s fields)."""

    config: TrainConfig
    tune_threads: bool
    resume_key: str
    save_dtype: str  # the final checkpoint's dtype (`stages.lib.model.dtypes.resolve_save_dtype`)
