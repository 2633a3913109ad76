"""Benchmark: training tokens/s with sample packing vs padding, side by side in one run.

.venv/bin/python bench/train.py [--samples 512] [--threads 1] [--micro 8]

Part 1 trains the tiny Llama (hidden 128, 2 layers) on one variable-length
set (16-256 tokens a sequence) with padding, with packing, and with packing
plus dynamic batching: one model per mode, the same initial weights, the same
data order, and the train stage's own step (`stages.train.loop.Loop.run_step`
through DeepSpeed ZeRO-0 on the CPU accelerator, or plain torch without
deepspeed). The modes take turns step by step, so background load on the
machine hits them alike. tokens/s counts real tokens only (prompt + response,
no padding); "positions/token" is how many input positions the model computed
per real token (1.0: no padding at all). The loss is the same computation in
every mode (the mean over each global batch's response tokens), so the
modes' final losses agree: a check that packing changes speed, not training.

Part 2 is the quickstart's warm-up shape (batch 64 of ~20-token sequences):
steps/s through plain torch and DeepSpeed ZeRO-0, with and without packing
and gradient checkpointing (the default profile turns both on), again turn
by turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {
    "padding": {"packing_samples": False, "use_dynamic_batch": False},
    "packing": {"packing_samples": True, "use_dynamic_batch": False},
    "packing+dynamic": {"packing_samples": True, "use_dynamic_batch": True},
}


def sort_rows(n: int, seed: int, lo: int, hi: int) -> list[dict[str, str]]:
    """Sorting tasks of about lo-hi tokens each (a two-digit number is ~3 tokens)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        count = max(1, (rng.randint(lo, hi) - 12) // 6)
        nums = [str(rng.randint(10, 99)) for _ in range(count)]
        rows.append({"prompt": "sort: " + " ".join(nums), "answer": " ".join(sorted(nums))})
    return rows


def sum_rows(n: int, seed: int) -> list[dict[str, str]]:
    """The quickstart's task shape: two 2-digit terms, ~20 tokens with the template."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def init_distributed() -> str:
    """One-rank process group (DeepSpeed needs one); the trainer kind the stage would pick."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "torch"
    from stages.lib.net import free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        DS_ACCELERATOR="cpu",
    )
    from stages.train.worker import init_distributed as start

    start("deepspeed", "cpu", 1)
    return "deepspeed"


def make_loop(model_dir: str, data_path: str, trainer: str, settings: dict[str, Any]) -> Any:
    """A one-rank training loop exactly as a stage's worker builds it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.lib.distributed.ds_config import build_ds_config
    from stages.train import TrainConfig
    from stages.train.data import read_rows, training_set
    from stages.train.loop import Loop
    from stages.train.worker import make_trainer, plan_for

    cfg = TrainConfig.model_validate({"input": data_path, "model": model_dir, **settings})
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = training_set(
        read_rows(data_path), tok, algorithm="sft", target="answer", max_length=cfg.max_length
    )
    plan = plan_for(cfg, data, 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.use_cache = False
    ds_config = build_ds_config(cfg, 1)
    return Loop(
        cfg=cfg,
        trainer=make_trainer(trainer, ds_config, cfg, model, plan.total_steps, "cpu"),
        plan=plan,
        data=data,
        device="cpu",
        pad_id=tok.pad_token_id,
        stage_dir="",
    )


def positions(loop: Any, step: Any) -> tuple[int, int]:
    """(input positions computed, real tokens) of one step."""
    lengths = [len(e.input_ids) for e in loop.data.examples]
    computed = real = 0
    for micro in step.micro[0]:
        width = max(sum(lengths[s] for s in row) for row in micro.rows)
        computed += width * len(micro.rows)
        real += sum(lengths[s] for row in micro.rows for s in row)
    return computed, real


def race(loops: dict[str, Any], steps: int) -> dict[str, dict[str, float]]:
    """Run the loops turn by turn for `steps` steps; time, tokens and last loss of each."""
    out = {name: {"time": 0.0, "tokens": 0, "positions": 0, "loss": 0.0} for name in loops}
    for k in range(steps):
        for name, loop in loops.items():
            step = loop.plan.step(k)
            t = time.perf_counter()
            record = loop.run_step(step)
            out[name]["time"] += time.perf_counter() - t
            computed, real = positions(loop, step)
            out[name]["tokens"] += real
            out[name]["positions"] += computed
            out[name]["loss"] = record["loss"]
    return out


def write_set(tmp: Path, name: str, rows: list[dict[str, str]], hidden: int) -> tuple[str, str]:
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model

    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TinyModel(hidden_size=hidden, num_layers=2, num_heads=4, vocab_size=512)
    texts = [t for r in rows for t in (r["prompt"], r["answer"])]
    build_tiny_model(spec, texts, str(tmp / f"{name}-model"), seed=0)
    return str(tmp / f"{name}-model"), str(data)


def packing_vs_padding(tmp: Path, trainer: str, args: argparse.Namespace) -> None:
    model, data = write_set(tmp, "varlen", sort_rows(args.samples, 0, 16, 256), 128)
    base = {
        "target": "answer",
        "max_length": 256,
        "train_batch_size": 4 * args.micro,
        "micro_train_batch_size": args.micro,
        "learning_rate": 1e-3,
    }
    loops = {name: make_loop(model, data, trainer, {**base, **m}) for name, m in MODES.items()}
    steps = loops["padding"].plan.total_steps
    res = race(loops, steps)
    tokens = res["padding"]["tokens"]
    print(
        f"packing vs padding: hidden 128, 2 layers; {args.samples} samples of 16-256 tokens "
        f"({tokens:.0f} real tokens), {steps} steps of {base['train_batch_size']}, micro "
        f"{args.micro}, max_length 256; {trainer}{' zero 0' if trainer == 'deepspeed' else ''}, "
        f"{args.threads} thread(s)"
    )
    print(
        f"{'mode':<17}{'tokens/s':>10}{'positions/token':>17}{'final loss':>12}{'vs padding':>12}"
    )
    pad_rate = tokens / res["padding"]["time"]
    for name, r in res.items():
        rate = r["tokens"] / r["time"]
        print(
            f"{name:<17}{rate:>10.0f}{r['positions'] / r['tokens']:>17.2f}{r['loss']:>12.4f}"
            f"{rate / pad_rate:>11.2f}x"
        )


def warmup_shape(tmp: Path, trainer: str, args: argparse.Namespace) -> None:
    model, data = write_set(tmp, "warmup", sum_rows(64 * args.warmup_steps, 1), 128)
    base = {"target": "answer", "train_batch_size": 64, "micro_train_batch_size": 64}
    variants = {
        "torch": ("torch", {}),
        "torch+packing": ("torch", {"packing_samples": True}),
        "deepspeed zero 0": ("deepspeed", {}),
        "deepspeed+packing": ("deepspeed", {"packing_samples": True}),
        "deepspeed+pack+gc": (
            "deepspeed",
            {"packing_samples": True, "gradient_checkpointing": True},
        ),
    }
    if trainer != "deepspeed":
        variants = {k: v for k, v in variants.items() if v[0] == "torch"}
    loops = {
        name: make_loop(model, data, kind, {**base, **extra, "learning_rate": 3e-3})
        for name, (kind, extra) in variants.items()
    }
    res = race(loops, args.warmup_steps)
    mean_len = res["torch"]["tokens"] / (64 * args.warmup_steps)
    print(
        f"\nwarm-up shape: batch 64 of ~{mean_len:.0f} tokens, {args.warmup_steps} steps, "
        f"{args.threads} thread(s)"
    )
    print(f"{'trainer':<20}{'steps/s':>10}{'tokens/s':>10}{'final loss':>12}{'vs torch':>10}")
    torch_rate = args.warmup_steps / res["torch"]["time"]
    for name, r in res.items():
        rate = args.warmup_steps / r["time"]
        print(
            f"{name:<20}{rate:>10.2f}{r['tokens'] / r['time']:>10.0f}{r['loss']:>12.4f}"
            f"{rate / torch_rate:>9.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512, help="variable-length samples")
    parser.add_argument("--micro", type=int, default=8, help="micro batch (global: 4x)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--warmup-steps", type=int, default=60, help="steps of part 2 (0: skip)")
    args = parser.parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    trainer = init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        packing_vs_padding(Path(tmp), trainer, args)
        if args.warmup_steps:
            warmup_shape(Path(tmp), trainer, args)
    print(f"({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()
