"""TRL's GRPOTrainer on the same warm-up, prompts and settings as our rl stage (run by
bench/rl.py in .venv-trl, an interpreter with the `trl` package; no vLLM, CPU).

    .venv-trl/bin/python bench/rl_trl.py --model DIR --train F --out DIR --prompts 8 --group 4 \
        --steps 100 --lr 1e-4 --max-tokens 8 --seed 0 [--schedule cosine]

Writes the trained checkpoint to --out and `trl_result.json` there (steps, seconds, seconds
per step of the training loop). Reward: exact match of the answer (the chain_sum scorer's
verdict on integer answers).
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
    args = p.parse_args()

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


if __name__ == "__main__":
    main()
