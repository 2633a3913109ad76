"""What a trainer's checkpoint must match to be resumed (train's and rl's).

Input: a stage's resolved config (with `input` and `model` fields), the fields that may
change between a run and its resume, and what the stage decided that shapes its checkpoints
(world size, trainer, ...). Output: a 16-hex-digit key, saved with every checkpoint; a
checkpoint whose key differs is not resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from typing import Any


def resume_key(cfg: Any, unhashed: Collection[str], *decided: Any) -> str:
    """The config (less `unhashed`), the inputs' versions (size and modification time of
    `input` and of `model` when it is a path), and `decided`, hashed."""
    config = cfg.model_dump(mode="json", exclude=set(unhashed))
    stamps = {}
    for path in (cfg.input, cfg.model if isinstance(cfg.model, str) else None):
        if path and os.path.exists(path):
            st = os.stat(path)
            stamps[path] = (st.st_size, st.st_mtime_ns)
    blob = json.dumps([config, stamps, *decided], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
