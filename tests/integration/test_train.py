"""The train stage for real: worker processes, DeepSpeed on the CPU accelerator, resume, DPO.

Each test trains a tiny Llama built by the stage itself (hidden 32, 2 layers)
on two-digit additions, through `run_train` as the engine calls it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.stage import StageContext
from stages.lib.distributed.spawn import TrainingFailed
from stages.train import TrainConfig
from stages.train.run import run_train
from tests.conftest import ROOT

pytestmark = pytest.mark.integration
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "vocab_size": 300}


def additions(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n")
    return path


def context(stage_dir: Path) -> StageContext:
    stage_dir.mkdir(parents=True, exist_ok=True)
    return StageContext(
        name="train",
        kind="train",
        stage_dir=str(stage_dir),
        run_dir=str(stage_dir.parent),
        pipeline_dir=str(stage_dir.parent),
        log=logging.getLogger("pipe.test.train"),
    )


def config(data: Path, stage_dir: Path, **settings: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "input": str(data),
        "output": str(stage_dir / "checkpoint"),
        "target": "answer",
        "model": TINY,
        "train_batch_size": 16,
        "micro_train_batch_size": 16,
        "learning_rate": 3e-3,
        "num_threads": 1,
    }
    base.update(settings)
    return TrainConfig.model_validate(base)


def losses(stage_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (stage_dir / "loss.jsonl").read_text().splitlines()]


def memory_constrained_settings() -> dict[str, Any]:
    """The train settings of the shipped memory_constrained preset."""
    from ruamel.yaml import YAML

    preset = YAML(typ="safe").load(
        (ROOT / "engine/load/presets/memory_constrained.memory.yaml").read_text()
    )
    fields = TrainConfig.model_fields
    return {k: v["value"] for k, v in preset["settings"].items() if k in fields}


@pytest.mark.slow
def test_memory_constrained_trains_through_zero3_on_cpu(tmp_path: Path):
    pytest.importorskip("deepspeed")
    settings = memory_constrained_settings()
    assert settings == {
        "adam_offload": True,
        "gradient_checkpointing": True,
        "zero_stage": 3,
        "packing_samples": True,
        "overlap_comm": False,
        "micro_train_batch_size": 2,
    }
    data = additions(tmp_path / "data.jsonl", 320)
    stage = tmp_path / "train"
    # hidden 160: the MLP matrices (160 x 640) pass DeepSpeed's persistence threshold
    # (1e5 elements), so ZeRO-3 really splits them over the two ranks
    model = {**TINY, "hidden_size": 160, "num_heads": 4}
    cfg = config(
        data, stage, model=model, max_steps=20, train_batch_size=16, num_processes=2, **settings
    )
    metrics = run_train(cfg, context(stage))
    log = (stage / "train_log.txt").read_text()
    assert "[rank 0] INFO zero 3: 6 of 20 weight tensors partitioned, 434000 of 868000 " in log

    ds_config = json.loads((stage / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3
    assert ds_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds_config["gradient_accumulation_steps"] == 4  # 16 / (2 per micro batch x 2 ranks)
    assert (metrics["trainer"], metrics["zero_stage"], metrics["world_size"]) == ("deepspeed", 3, 2)
    assert metrics["steps"] == 20
    curve = [r["loss"] for r in losses(stage)]
    assert [r["step"] for r in losses(stage)] == list(range(1, 21))
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert last < 0.75 * first, curve
    assert (stage / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(stage / "checkpoint")  # gathered, not shards
    weight = trained.get_input_embeddings().weight
    assert tuple(weight.shape) == (trained.config.vocab_size, 160)


def worker_pids() -> list[int]:
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:  # a child that has just exited (a zombie not yet reaped) has no command line
            if "stages.train.worker" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


def kill_after_first_checkpoint(stage: Path, errors: list[BaseException], cfg: TrainConfig) -> int:
    """Run the stage in a thread and SIGKILL its worker once a checkpoint is complete."""

    def target() -> None:
        try:
            run_train(cfg, context(stage))
        except BaseException as e:  # the test inspects it
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 120
    while not (stage / "checkpoints" / "latest").exists():
        assert thread.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.005)
    pids = worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)
    return len(pids)


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(tmp_path: Path):
    data = additions(tmp_path / "data.jsonl", 480)
    settings = {"max_steps": 60, "save_steps": 5, "train_batch_size": 32}

    straight = tmp_path / "straight"
    run_train(config(data, straight, **settings), context(straight))

    stage = tmp_path / "killed"
    errors: list[BaseException] = []
    assert kill_after_first_checkpoint(stage, errors, config(data, stage, **settings)) == 1
    assert len(errors) == 1 and isinstance(errors[0], TrainingFailed)
    assert str(errors[0]).startswith("training rank 0 was killed by SIGKILL; last lines of ")
    assert not (stage / "checkpoint").exists()
    saved_step = int((stage / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 5 <= saved_step < 60 and saved_step % 5 == 0

    metrics = run_train(config(data, stage, **settings), context(stage))
    assert metrics["resumed_from_step"] == saved_step
    assert metrics["steps"] == 60
    assert metrics["total_steps"] == 60
    records = losses(stage)
    assert [r["step"] for r in records] == list(range(1, 61))
    # the resumed run continues exactly where the uninterrupted one went
    expected = [r["loss"] for r in losses(straight)]
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in losses(straight)])


@pytest.mark.slow
def test_dpo_on_two_torch_ranks_with_packing_and_dynamic_batches(tmp_path: Path):
    rng = random.Random(1)
    rows = []
    for idx in range(48):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        for sample, (text, reward) in enumerate(((str(a + b), 1.0), (str(a + b + 1), 0.0))):
            rows.append(
                {
                    "prompt": f"{a} + {b} =",
                    "prompt_idx": idx,
                    "sample_idx": sample,
                    "completion": text,
                    "reward": reward,
                }
            )
    data = tmp_path / "rollouts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = tmp_path / "dpo"
    cfg = config(
        data,
        stage,
        algorithm="dpo",
        target="completion",
        trainer="torch",
        num_processes=2,
        packing_samples=True,
        use_dynamic_batch=True,
        micro_train_batch_size=1,
        max_length=32,
        max_epochs=4,
        beta=0.5,
        learning_rate=1e-2,
    )
    metrics = run_train(cfg, context(stage))
    assert (metrics["trainer"], metrics["world_size"], metrics["zero_stage"]) == ("torch", 2, None)
    assert not (stage / "ds_config.json").exists()
    assert metrics["samples"] == 48 and metrics["steps"] == 12  # 3 steps of 16 pairs, 4 epochs
    records = losses(stage)
    # at step 1 the policy is the reference: every margin is 0 and the loss log(2)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["margin"] == pytest.approx(0.0, abs=1e-6)
    assert records[-1]["loss"] < 0.6
    assert records[-1]["accuracy"] > 0.8


@pytest.mark.slow
def test_a_failing_worker_raises_with_the_tail_of_its_log(tmp_path: Path):
    data = additions(tmp_path / "data.jsonl", 8)
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    stage = tmp_path / "train"
    with pytest.raises(TrainingFailed) as e:
        run_train(config(data, stage, model=str(not_a_model), trainer="torch"), context(stage))
    message = str(e.value)
    assert message.startswith(
        f"training rank 0 exited with status 1; last lines of {stage}/train_log.txt:\n"
    )
    assert "[rank 0] Traceback (most recent call last):" in message


def test_bad_rows_fail_before_any_process_starts(tmp_path: Path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1 ="}\n')
    stage = tmp_path / "train"
    with pytest.raises(ValueError) as e:
        run_train(config(data, stage), context(stage))
    assert str(e.value) == f"{data}: row 1 has no 'answer' (target: answer)"
    assert not (stage / "train_brief.json").exists()


@pytest.mark.slow
def test_ranks_die_with_the_stage_process(tmp_path: Path):
    """A killed stage process (a Dask worker lost) leaves no rank training on in its folder."""
    import subprocess
    import sys

    import psutil

    data = additions(tmp_path / "data.jsonl", 64)
    stage = tmp_path / "train"
    cfg = config(data, stage, max_steps=100_000, train_batch_size=8, micro_train_batch_size=8)
    script = (
        "import logging, sys; from engine.stage import StageContext; "
        "from stages.train import TrainConfig; from stages.train.run import run_train; "
        f"run_train(TrainConfig.model_validate_json(sys.argv[1]), StageContext("
        f"name='train', kind='train', stage_dir={str(stage)!r}, run_dir='.', pipeline_dir='.'))"
    )
    stage.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", script, cfg.model_dump_json()], cwd=ROOT, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not (stage / "loss.jsonl").exists() or not (stage / "loss.jsonl").stat().st_size:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "stages.train.worker" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 1
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == [] and len(gone) == 1


@pytest.mark.timeout(400)
def test_zero3_two_rank_held_out_eval_bf16_finishes(tmp_path: Path):
    """ZeRO-3 over two ranks, bf16, held-out scoring every 3 steps: each rank generates its
    share of the prompts in lockstep (each forward gathers the weights on both ranks; rank 0
    generating alone inside a gather waited for rank 1 forever), the counts summed."""
    data = additions(tmp_path / "train.jsonl", 64)
    held = additions(tmp_path / "held.jsonl", 9, seed=1)  # 5 prompts on rank 0, 4 on rank 1
    stage = tmp_path / "train"
    model = {**TINY, "hidden_size": 160, "num_heads": 4}  # weights big enough to be split
    cfg = config(
        data,
        stage,
        model=model,
        zero_stage=3,
        bf16=True,
        num_processes=2,
        micro_train_batch_size=4,
        max_steps=6,
        eval_input=str(held),
        eval_steps=3,
        eval_max_tokens=4,
        verifier={"kind": "regex", "pattern": "[0-9]"},
    )
    metrics = run_train(cfg, context(stage))
    assert (metrics["zero_stage"], metrics["world_size"]) == (3, 2)
    scored = [r for r in losses(stage) if r.get("eval_accuracy") is not None]
    assert [r["step"] for r in scored] == [3, 6]
    # a share of 9 prompts: a multiple of 1/9
    assert all(round(r["eval_accuracy"] * 9, 6).is_integer() for r in scored)
    # the final checkpoint, gathered module by module onto rank 0 alone: whole tensors, trained
    from safetensors.torch import load_file

    saved = load_file(str(stage / "checkpoint" / "model.safetensors"))
    init = load_file(str(stage / "init_model" / "model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in init.items()}
    assert any(not saved[k].float().equal(init[k].float()) for k in init)


@pytest.mark.slow
def test_two_ranks_splitting_each_row_train_as_one_rank(tmp_path: Path):
    """`ring_attn_size: 2` through the whole train stage on 2 gloo ranks (the torch trainer):
    each rank holds half of every row, and the losses and gradient norms are one rank's on
    the whole rows within fp32 rounding (the sums run in another order; the mechanism's own
    bound is tests/unit/test_seqpar.py's). The step's wiring is what this adds to it: one
    data-parallel group takes every micro batch, the loss is over the step's tokens."""
    data = additions(tmp_path / "data.jsonl", 32)
    runs = {}
    for name, extra in (("one", {}), ("split", {"num_processes": 2, "ring_attn_size": 2})):
        stage = tmp_path / name
        cfg = config(
            data,
            stage,
            trainer="torch",
            packing_samples=False,
            max_steps=3,
            train_batch_size=8,
            micro_train_batch_size=4,
            **extra,
        )
        run_train(cfg, context(stage))
        runs[name] = [(r["loss"], r["grad_norm"]) for r in losses(stage)]
    assert len(runs["one"]) == len(runs["split"]) == 3
    for (loss, norm), (split_loss, split_norm) in zip(runs["one"], runs["split"], strict=True):
        assert split_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert split_norm == pytest.approx(norm, rel=1e-5, abs=1e-6)
