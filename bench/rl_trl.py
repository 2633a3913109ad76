"""TRL's GRPOTrainer on the same warm-up, prompts and settings as our rl stage (run by
bench/rl.py in .venv-trl, an interpreter with the `trl` package; no vLLM, CPU).

    .venv-trl/bin/python bench/rl_trl.py --model DIR --train F --out DIR --prompts 8 --group 4 \
        --steps 100 --lr 1e-4 --max-tokens 8 --seed 0 [--schedule cosine]

    .venv-trl/bin/python bench/rl_trl.py --gemma3 --model SFT_DIR --train F --eval TEST --out DIR \
        [--minutes 60] [--threads 2]

Writes the trained checkpoint to --out and `trl_result.json` there (steps, seconds, seconds
per step of the training loop). Reward: exact match of the answer (the chain_sum scorer's
verdict on integer answers).

`--gemma3`: the settings of pipelines/gemma3_grpo.yaml's grpo stage on its SFT checkpoint
(Gemma 3 270M): LoRA (rank 16, alpha 32, all-linear: peft, as `lora: {rank: 16}`), bf16,
prompts rendered as "Question: {prompt}\nAnswer:" (its `chat_template: plain`; TRL gets the
text, not messages), 16 prompts x 8 samples a step (`--shape`), 8 answer tokens, lr 5e-5, the torch
threads of `--threads`; every `--mark-min` minutes of training wall time (10) it stops the
clock and scores greedy answers to the first `--eval-limit` (200) prompts of `--eval`,
and writes each mark (minutes, step, accuracy) to `marks` in `trl_result.json`; it stops
after `--minutes`. bench/rl.py --gemma3 runs it beside the rl stage.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--train", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument(
        "--schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="after the warm-up: constant, or cosine down to a tenth of the peak (as ours)",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gemma3", action="store_true", help="gemma3_grpo.yaml's grpo settings")
    p.add_argument("--eval", help="--gemma3: held-out prompt JSONL scored at each mark")
    p.add_argument("--eval-limit", type=int, default=200)
    p.add_argument("--mark-min", type=float, default=10.0, help="--gemma3: minutes between marks")
    p.add_argument("--minutes", type=float, default=60.0, help="--gemma3: training wall time")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shape", default="16x8", help="--gemma3: prompts x samples a step")
    args = p.parse_args()
    if args.gemma3:
        gemma3(args)
        return

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    with open(args.train, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
            for r in rows
        ]
    )

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip() == a.strip() else 0.0 for t, a in zip(texts, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        warmup_steps=max(1, round(args.warmup_ratio * args.steps)),
        lr_scheduler_type=(
            "constant_with_warmup" if args.schedule == "constant" else "cosine_with_min_lr"
        ),
        lr_scheduler_kwargs={} if args.schedule == "constant" else {"min_lr_rate": 0.1},
        max_steps=args.steps,
        beta=0.0,
        temperature=1.0,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    result = {"steps": args.steps, "seconds": seconds, "seconds_per_step": seconds / args.steps}
    with open(os.path.join(args.out, "trl_result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(json.dumps(result))


TEMPLATE = "Question: {prompt}\nAnswer:"  # gemma3_grpo.yaml's prompt_template (plain)


def held_out(model: object, tokenizer: object, rows: list[dict], max_tokens: int) -> float:
    """Greedy accuracy on `rows` (exact match of the stripped answer), 16 prompts a batch."""
    import torch

    right = 0
    model.eval()  # type: ignore[attr-defined]
    with torch.inference_mode():
        for lo in range(0, len(rows), 16):
            batch = rows[lo : lo + 16]
            enc = tokenizer(  # type: ignore[operator]
                [TEMPLATE.format(prompt=r["prompt"]) for r in batch],
                return_tensors="pt",
                padding=True,
            )
            out = model.generate(  # type: ignore[attr-defined]
                **enc, max_new_tokens=max_tokens, do_sample=False, use_cache=True
            )
            texts = tokenizer.batch_decode(  # type: ignore[attr-defined]
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            right += sum(
                t.strip() == str(r["answer"]).strip() for t, r in zip(texts, batch, strict=True)
            )
    model.train()  # type: ignore[attr-defined]
    return right / max(len(rows), 1)


def gemma3(args: argparse.Namespace) -> None:
    """The --gemma3 mode (module docstring): accuracy against wall time, LoRA, bf16."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    with open(args.train, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(args.eval, encoding="utf-8") as f:
        test = [json.loads(line) for line in f if line.strip()][: args.eval_limit]
    data = Dataset.from_list(
        [{"prompt": TEMPLATE.format(prompt=r["prompt"]), "answer": str(r["answer"])} for r in rows]
    )

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [
            1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer, strict=True)
        ]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    prompts, group = (int(x) for x in args.shape.split("x"))
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        max_completion_length=8,
        learning_rate=5e-5,
        warmup_steps=10,
        lr_scheduler_type="constant_with_warmup",
        max_steps=100000,  # the clock stops it
        beta=0.0,
        temperature=1.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        bf16=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear")
    marks: list[dict[str, float]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Training wall time (the marks' own evaluation excluded); a mark every mark-min."""

        def __init__(self) -> None:
            self.spent, self.since = 0.0, time.perf_counter()

        def on_step_end(self, _args: object, state: object, control: object, **kw: object) -> None:
            now = time.perf_counter()
            self.spent += now - self.since
            if self.spent >= len(marks) * args.mark_min * 60:  # marks[0]: the start
                acc = held_out(kw["model"], tokenizer, test, 8)
                step = state.global_step  # type: ignore[attr-defined]
                marks.append({"minutes": self.spent / 60, "step": step, "accuracy": acc})
                print(json.dumps(marks[-1]), flush=True)
            if self.spent >= args.minutes * 60:
                control.should_training_stop = True  # type: ignore[attr-defined]
            self.since = time.perf_counter()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    base = held_out(trainer.model, tokenizer, test, 8)
    print(json.dumps({"minutes": 0, "step": 0, "accuracy": base}), flush=True)
    marks.append({"minutes": 0.0, "step": 0, "accuracy": base})
    trainer.train()
    os.makedirs(args.out, exist_ok=True)
    result = {"marks": marks, "wall_s": time.perf_counter() - start}
    with open(os.path.join(args.out, "trl_result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
