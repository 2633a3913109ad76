"""The NeMo Gym rows pipelines/nemo_gym_grpo.yaml reads (scripts/gym_chain_sum.py makes them):
the form NeMo Gym's reasoning_gym resources server verifies, right answers, and no held-out
question among the training rows. Reading the committed files only (the script's `--check`
regenerates them from the dataset stage: 20,700 rows, too slow for the default run)."""

from __future__ import annotations

import importlib.util
import json
import operator
from pathlib import Path
from typing import Any

from tests.conftest import ROOT

DATA = ROOT / "pipelines" / "data"
OPS = {"+": operator.add, "-": operator.sub}


def read(name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (DATA / name).read_text().splitlines()]


def value(expression: str) -> int:
    """chain_sum's `a op b op c ...`, read left to right."""
    words = expression.split()
    total = int(words[0])
    for op, term in zip(words[1::2], words[2::2], strict=True):
        total = OPS[op](total, int(term))
    return total


def test_rows_are_nemo_gym_rows_with_right_answers():
    train, test = read("chain_sum_gym_train.jsonl"), read("chain_sum_gym_test.jsonl")
    assert (len(train), len(test)) == (2048, 500)
    for row in train + test:
        assert set(row) == {"responses_create_params", "question", "answer", "metadata"}
        message = {"role": "user", "content": row["question"]}
        assert row["responses_create_params"] == {"input": [message]}
        assert row["metadata"]["source_dataset"] == "chain_sum"  # what /verify scores with
        assert row["answer"] == str(value(row["metadata"]["expression"]))
    assert len({r["question"] for r in test}) == 500
    assert not {r["question"] for r in test} & {r["question"] for r in train}


def test_the_script_writes_a_dataset_row_as_nemo_gyms_create_dataset_does():
    spec = importlib.util.spec_from_file_location(
        "gym_chain_sum", Path(ROOT, "scripts", "gym_chain_sum.py")
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    row = {"prompt": "1 + 2 =", "answer": "3", "task": "chain_sum", "metadata": {"a": 1}}
    assert script.gym_row(row) == {
        "responses_create_params": {"input": [{"role": "user", "content": "1 + 2 ="}]},
        "question": "1 + 2 =",
        "answer": "3",
        "metadata": {"a": 1},
    }
