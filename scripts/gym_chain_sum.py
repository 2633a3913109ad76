"""NeMo Gym's rows of chain_sum for pipelines/nemo_gym_grpo.yaml, made by pipe's dataset stage.

    .venv/bin/python scripts/gym_chain_sum.py          # writes the two files below
    .venv/bin/python scripts/gym_chain_sum.py --check  # exit 1 if they differ from a fresh make

Input: the `data` stage of pipelines/nemo_gym_grpo.yaml (its reasoning_gym config and the
pipeline's seed), read from the file, so the rows here are the rows that stage writes.
Output: `pipelines/data/chain_sum_gym_test.jsonl` (the stage's test split, every row) and
`pipelines/data/chain_sum_gym_train.jsonl` (the first `TRAIN_ROWS` rows of its train split),
each row as NeMo Gym's reasoning_gym `create_dataset.py` writes one: `responses_create_params`
(the question as the one user message) and what its resources server's `/verify` reads
(`question`, `answer`, `metadata` with `source_dataset`).

Why a script: pipe's dataset stage writes `prompt` rows, and no stage writes NeMo Gym's form
(`responses_create_params`, and `question` kept beside it). The warm-up in the pipeline trains
on the stage's own train split, which excludes its test prompts, so the held-out rows here are
held out from the warm-up too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PIPELINE = ROOT / "pipelines" / "nemo_gym_grpo.yaml"
TRAIN = ROOT / "pipelines" / "data" / "chain_sum_gym_train.jsonl"
TEST = ROOT / "pipelines" / "data" / "chain_sum_gym_test.jsonl"
TRAIN_ROWS = 2048  # GRPO's prompts: 32 steps of 64 prompts an epoch


def gym_row(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row (`prompt`, `answer`, `metadata`) as NeMo Gym's reasoning_gym row."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": row["prompt"]}]},
        "question": row["prompt"],
        "answer": row["answer"],
        "metadata": row["metadata"],
    }


def made() -> dict[Path, str]:
    """The two files' text, from the pipeline's `data` stage run here."""
    from engine.load.source import load_document
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset
    from stages.lib.io.jsonl import read_jsonl

    data = load_document(PIPELINE).data
    seed = data.get("defaults", {}).get("seed", 0)
    stage = dict(data["stages"]["data"]["config"])
    with tempfile.TemporaryDirectory() as tmp:
        out = {k: f"{tmp}/{k}.jsonl" for k in ("output", "test_output", "val_output")}
        cfg = DatasetConfig.model_validate({"seed": seed, **stage, **out}, strict=False)
        run_dataset(cfg, StageContext("data", "data", tmp, tmp, tmp))
        train = list(read_jsonl(out["output"]))[:TRAIN_ROWS]
        test = list(read_jsonl(out["test_output"]))

    def text(rows: list[dict[str, Any]]) -> str:
        return "".join(json.dumps(gym_row(r), ensure_ascii=False) + "\n" for r in rows)

    return {TRAIN: text(train), TEST: text(test)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    files = made()
    if args.check:
        stale = [p for p, t in files.items() if not p.exists() or p.read_text() != t]
        for p in stale:
            print(f"{p.relative_to(ROOT)}: differs from what the script makes", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"{path.relative_to(ROOT)}: {text.count(chr(10))} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
