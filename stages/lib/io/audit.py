"""Records to audit a run by: what a stage trained on, as text and as token ids.

Input: token ids, where the prompt ends, the per-token loss mask of what follows, and the
tokenizer that made them. Output: one JSON-ready dict per sequence (`token_record`), the
prompt and the completion each as rendered text and as ids, the mask as long as the
completion ids; appended to a JSONL in the stage's folder (`append_records`): the rl stage's
`samples.jsonl` (a few samples every `log_samples_every` steps), the train stage's
`first_batch.jsonl`. The run's trackers upload both files when the stage ends
(`engine.run.tracking.recorder.ARTIFACTS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

SAMPLES = "samples.jsonl"  # rl
FIRST_BATCH = "first_batch.jsonl"  # train


def token_record(
    tokenizer: Any, ids: Sequence[int], prompt_len: int, mask: Sequence[float] = ()
) -> dict[str, Any]:
    """The prompt and the completion as text (special tokens kept, as the model saw them) and
    as ids, and the completion's loss mask (1 trained, 0 not; empty `mask`: all trained)."""
    prompt, completion = [int(i) for i in ids[:prompt_len]], [int(i) for i in ids[prompt_len:]]
    loss_mask = [int(m) for m in mask] if mask else [1] * len(completion)
    if len(loss_mask) != len(completion):
        raise ValueError(f"{len(loss_mask)} mask values for {len(completion)} completion ids")
    return {
        "prompt": tokenizer.decode(prompt, skip_special_tokens=False),
        "completion": tokenizer.decode(completion, skip_special_tokens=False),
        "prompt_ids": prompt,
        "completion_ids": completion,
        "loss_mask": loss_mask,
    }


def append_records(path: str, records: Iterable[dict[str, Any]]) -> None:
    """One line per record, appended."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
