"""The dataset stage: reasoning-gym rows, a disjoint held-out split, local files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.dataset import DatasetConfig
from stages.dataset.run import jsonable, read_jsonl, run_dataset
from tests.conftest import ROOT

ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TWO_DIGITS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}


def _run(tmp_path: Path, **fields: Any) -> tuple[dict[str, Any], list[Any], list[Any]]:
    ctx = StageContext("data", "dataset", str(tmp_path), str(tmp_path.parent), str(tmp_path))
    cfg = DatasetConfig(
        output=ctx.path("train.jsonl"),
        test_output=ctx.path("test.jsonl"),
        val_output=ctx.path("val.jsonl"),
        **fields,
    )
    metrics = run_dataset(cfg, ctx)
    return metrics, list(read_jsonl(cfg.output)), list(read_jsonl(cfg.test_output))


def _chain_sum_row(question: str, answer: str, index: int, expression: str) -> dict[str, Any]:
    return {
        "prompt": f"State the final answer to the following arithmetic problem: {question}",
        "answer": answer,
        "task": "chain_sum",
        "metadata": {
            "source_dataset": "chain_sum",
            "source_index": index,
            "num_terms": 2,
            "num_digits": 2,
            "expression": expression,
            "difficulty": {"num_terms": [2, 2], "num_digits": [2, 2]},
        },
    }


def test_reasoning_gym_rows_have_the_prompt_file_format(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    metrics, train, test = _run(
        tmp_path, source="reasoning_gym", task="chain_sum", task_config=TWO_DIGITS, size=3
    )
    assert train == [
        _chain_sum_row("15 - 43 =", "-28", 0, "15 - 43"),
        _chain_sum_row("42 - 25 =", "17", 1, "42 - 25"),
        _chain_sum_row("20 + 56 =", "76", 2, "20 + 56"),
    ]
    assert test == []
    assert metrics == {"train_rows": 3, "test_rows": 0, "val_rows": 0, "unique_train_prompts": 3}
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_held_out_prompts_are_unique_and_never_in_training(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    # one-digit sums have only 200 distinct problems, so a naive split would overlap
    metrics, train, test = _run(
        tmp_path,
        source="reasoning_gym",
        task="chain_sum",
        task_config=ONE_DIGIT,
        size=300,
        test_size=50,
        seed=7,
    )
    test_prompts = [r["prompt"] for r in test]
    assert len(train) == 300
    assert len(test_prompts) == len(set(test_prompts)) == 50
    assert not {r["prompt"] for r in train} & set(test_prompts)
    assert metrics["train_rows"] == 300
    assert metrics["test_rows"] == 50
    assert metrics["unique_train_prompts"] == len({r["prompt"] for r in train}) <= 150


def test_the_split_is_reproducible_and_follows_the_seed(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    fields = {"source": "reasoning_gym", "task": "chain_sum", "task_config": TWO_DIGITS}
    _, train_a, test_a = _run(tmp_path / "a", size=20, test_size=5, seed=1, **fields)
    _, train_b, test_b = _run(tmp_path / "b", size=20, test_size=5, seed=1, **fields)
    _, train_c, _ = _run(tmp_path / "c", size=20, test_size=5, seed=2, **fields)
    assert (train_a, test_a) == (train_b, test_b)
    assert train_a != train_c


def test_a_test_split_larger_than_the_task_is_an_error(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    with pytest.raises(
        ValueError, match="the task has too few distinct problems for test_size 201"
    ):
        _run(
            tmp_path,
            source="reasoning_gym",
            task="chain_sum",
            task_config=ONE_DIGIT,
            size=10,
            test_size=201,
        )


def test_a_system_prompt_turns_rows_into_messages(tmp_path: Path):
    pytest.importorskip("reasoning_gym")
    _, train, _ = _run(
        tmp_path,
        source="reasoning_gym",
        task="chain_sum",
        task_config=TWO_DIGITS,
        size=1,
        system_prompt="Answer with a number.",
    )
    question = "State the final answer to the following arithmetic problem: 15 - 43 ="
    assert train[0]["messages"] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": question},
    ]
    assert "prompt" not in train[0]
    assert (train[0]["answer"], train[0]["task"]) == ("-28", "chain_sum")


def test_nemo_gym_rows_carry_the_prompt_for_gyms_agent_and_the_question_for_its_verify(
    tmp_path: Path,
):
    """`nemo_gym_rows`: the same rows, plus NeMo Gym's `responses_create_params` (the prompt as
    the one user message, or the system prompt's messages) and reasoning_gym's `question`,
    as NeMo Gym's reasoning_gym `create_dataset.py` writes its rows."""
    pytest.importorskip("reasoning_gym")
    _, train, _ = _run(
        tmp_path,
        source="reasoning_gym",
        task="chain_sum",
        task_config=TWO_DIGITS,
        size=1,
        nemo_gym_rows=True,
    )
    row = _chain_sum_row("15 - 43 =", "-28", 0, "15 - 43")
    user = {"role": "user", "content": row["prompt"]}
    assert train == [
        {**row, "responses_create_params": {"input": [user]}, "question": row["prompt"]}
    ]
    system = tmp_path / "system"
    system.mkdir()
    _, (with_system,), _ = _run(
        system,
        source="reasoning_gym",
        task="chain_sum",
        task_config=TWO_DIGITS,
        size=1,
        system_prompt="Answer in <answer> tags.",
        nemo_gym_rows=True,
    )
    assert with_system["responses_create_params"]["input"] == with_system["messages"]
    assert with_system["question"] == row["prompt"]


def test_nemo_gym_rows_read_from_a_file_keep_the_fields_their_verify_reads(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    gym = {"responses_create_params": {"input": [{"role": "user", "content": "1 + 1 ="}]}}
    src.write_text(json.dumps({**gym, "question": "1 + 1 =", "solution": "2"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    _, (row,), _ = _run(out, source="jsonl", path=str(src), size=1)
    assert (row["question"], row["prompt"]) == ("1 + 1 =", "1 + 1 =")
    assert (row["solution"], row["answer"]) == ("2", "2")


def test_jsonl_source_maps_fields_and_holds_out_whole_prompts(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    rows = [{"question": f"q{i % 6}", "solution": str(i), "id": i} for i in range(10)]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out"
    out.mkdir()
    metrics, train, test = _run(out, source="jsonl", path=str(src), size=100, test_size=2, seed=0)
    held = {r["prompt"] for r in test}
    assert len(test) == 2 and len(held) == 2
    assert all(set(r) == {"prompt", "answer", "id"} for r in train + test)
    assert [r["id"] for r in train] == [
        r["id"] for r in rows if r["question"] not in held
    ]  # file order kept, every copy of a held-out prompt removed
    assert all(r["answer"] == str(r["id"]) for r in train + test)
    assert metrics == {
        "train_rows": len(train),
        "test_rows": 2,
        "val_rows": 0,
        "unique_train_prompts": 4,
    }


def test_jsonl_source_caps_training_rows_at_size(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    out.mkdir()
    _, train, test = _run(out, source="jsonl", path=str(src), size=3)
    assert train == [{"prompt": f"p{i}", "answer": i} for i in range(3)]
    assert test == []


def test_bad_local_rows_name_the_file_and_line(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"src\.jsonl:2: not valid JSON"):
        _run(tmp_path, source="jsonl", path=str(src))
    src.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"src\.jsonl row 1: no prompt field"):
        _run(tmp_path, source="jsonl", path=str(src))


def test_parquet_source(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "src.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), src)
    out = tmp_path / "out"
    out.mkdir()
    _, train, test = _run(out, source="parquet", path=str(src), size=10, test_size=1, seed=0)
    assert sorted(r["prompt"] for r in train + test) == ["a", "b", "c"]
    assert len(test) == 1


def test_huggingface_without_the_datasets_package_says_what_to_install(tmp_path: Path):
    try:
        import datasets  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("datasets is installed")
    with pytest.raises(
        RuntimeError, match=r"needs the 'datasets' package \(pip install datasets\)"
    ):
        _run(tmp_path, source="huggingface", path="gsm8k")


def test_jsonable_keeps_json_and_converts_the_rest():
    assert jsonable({"a": (1, 2), 3: {"b": {2, 1}}, "c": None, "d": 1.5}) == {
        "a": [1, 2],
        "3": {"b": [1, 2]},
        "c": None,
        "d": 1.5,
    }
    assert jsonable(Path("/x")) == "/x"


def test_stage_modules_stay_light_at_import():
    code = (
        "import sys, stages.dataset, stages.evaluate\n"
        "heavy = {'torch', 'transformers', 'reasoning_gym', 'matplotlib'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
