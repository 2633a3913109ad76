"""train with algorithm rm for real: rank processes, the saved reward model loaded back by
transformers, its scores equal to training's, and evaluate scoring answers with it."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.train.run import run_train
from tests.integration.test_train import TINY, config, context, losses

pytestmark = pytest.mark.integration


def easy_pairs(path: Path, n: int, seed: int) -> Path:
    """Additions whose chosen answer says 'yes' and whose rejected one says 'no'."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            row = {
                "prompt": f"{a} + {b} =",
                "chosen": f"{a + b} yes",
                "rejected": f"{a + b + rng.randint(1, 9)} no",
            }
            f.write(json.dumps(row) + "\n")
    return path


def rm_config(tmp_path: Path, stage: Path, **settings: Any) -> Any:
    data = easy_pairs(tmp_path / "pairs.jsonl", 256, seed=0)
    held = easy_pairs(tmp_path / "held.jsonl", 40, seed=1)
    base: dict[str, Any] = {
        "algorithm": "rm",
        "target": "completion",
        "eval_input": str(held),
        "eval_steps": 10,
        "max_steps": 25,
    }
    return config(data, stage, **{**base, **settings})


def test_rm_learns_easy_pairs_and_saves_a_reward_model_transformers_loads(tmp_path: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from stages.lib.model.reward_model import RewardScorer

    stage = tmp_path / "rm"
    metrics = run_train(rm_config(tmp_path, stage, trainer="torch"), context(stage))
    records = losses(stage)
    first, last = records[:3], records[-3:]
    assert sum(r["loss"] for r in last) < 0.3 * sum(r["loss"] for r in first), records
    assert sum(r["accuracy"] for r in first) / 3 < 0.9 <= min(r["accuracy"] for r in last)
    # held-out pairwise accuracy at every evaluation and at the end
    assert [r["step"] for r in records if "eval_accuracy" in r] == [10, 20, 25]
    assert metrics["eval_accuracy"] == records[-1]["eval_accuracy"] >= 0.9
    assert metrics["algorithm"] == "rm" and metrics["reward_gap"] > 0

    saved = stage / "checkpoint"
    fields = json.loads((saved / "config.json").read_text())
    assert fields["architectures"] == ["LlamaForSequenceClassification"]
    assert (fields["id2label"], fields["pad_token_id"]) == ({"0": "LABEL_0"}, 0)
    model = AutoModelForSequenceClassification.from_pretrained(str(saved))
    assert (type(model).__name__, model.config.num_labels) == ("LlamaForSequenceClassification", 1)
    # the loaded model scores every held-out pair exactly as training last did
    trained = [
        json.loads(line)
        for line in (stage / "heldout_scores.jsonl").read_text().split("\n")
        if line
    ]
    held = [json.loads(line) for line in (tmp_path / "held.jsonl").read_text().splitlines()]
    # normalize_reward's statistics: the held-out pairs' final scores (OpenRLHF's last eval)
    every = [x for t in trained for x in (t["chosen"], t["rejected"])]
    stats = (statistics.fmean(every), statistics.stdev(every))
    assert (fields["mean"], fields["std"]) == pytest.approx(stats, rel=1e-6)
    # the tokenizer saved pads with the config's pad id
    assert AutoTokenizer.from_pretrained(str(saved)).pad_token_id == fields["pad_token_id"]
    scorer = RewardScorer(str(saved))
    chosen = scorer([(r["prompt"], r["chosen"]) for r in held], max_length=256)
    rejected = scorer([(r["prompt"], r["rejected"]) for r in held], max_length=256)
    assert [t["pair"] for t in trained] == list(range(40))
    assert chosen == pytest.approx([t["chosen"] for t in trained], abs=1e-5)
    assert rejected == pytest.approx([t["rejected"] for t in trained], abs=1e-5)

    # evaluate scores each answer with it: the mean beside the verifier's accuracy
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import evaluate_checkpoints

    prompts = [{"prompt": r["prompt"], "answer": r["chosen"].split()[0]} for r in held[:8]]
    cfg = EvaluateConfig.model_validate(
        {
            "input": "unused",
            "output": str(tmp_path / "eval" / "report.json"),
            "checkpoints": [str(stage / "init_model")],
            "reward_model": str(saved),
            "max_output_tokens": 4,
        }
    )
    report = evaluate_checkpoints(
        cfg, cfg.checkpoints, None, prompts, lambda row, text: 0.0, str(tmp_path)
    )
    samples = [
        json.loads(line) for line in (tmp_path / "eval/generations.jsonl").read_text().splitlines()
    ]
    again = scorer([(prompts[s["prompt_idx"]]["prompt"], s["completion"]) for s in samples])
    assert [s["reward_model_score"] for s in samples] == pytest.approx(again, abs=1e-5)
    (result,) = report["results"]
    assert result["reward_model_score"] == pytest.approx(sum(again) / len(again), abs=1e-5)
    assert "reward-model score" in (tmp_path / "eval/report.md").read_text()


@pytest.mark.slow
def test_rm_through_zero3_on_two_ranks_packed_in_bf16(tmp_path: Path):
    """ZeRO-3 builds the model partitioned and initialises the new head itself; packed rows
    score each sequence at its own last token."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    stage = tmp_path / "rm"
    model = {**TINY, "hidden_size": 160, "num_heads": 4}  # weights big enough to be split
    cfg = rm_config(
        tmp_path,
        stage,
        model=model,
        zero_stage=3,
        bf16=True,
        packing_samples=True,
        num_processes=2,
        micro_train_batch_size=4,
        max_steps=12,
        eval_steps=6,
    )
    metrics = run_train(cfg, context(stage))
    assert (metrics["trainer"], metrics["zero_stage"], metrics["world_size"]) == ("deepspeed", 3, 2)
    records = losses(stage)
    assert records[0]["loss"] == pytest.approx(0.693, abs=0.05)  # a new head: scores near 0
    assert records[-1]["loss"] < 0.1 and metrics["eval_accuracy"] == 1.0
    head = load_file(str(stage / "checkpoint" / "model.safetensors"))["score.weight"]
    assert tuple(head.shape) == (1, 160) and float(head.abs().sum()) > 0
