"""TRL's GRPOTrainer on the same warm-up, prompts and settings as our rl stage (run by
bench/rl.py in .venv-trl, an interpreter with the `trl` package; no vLLM, CPU).

    .venv-trl/bin/python bench/rl_trl.py --model DIR --train F --out DIR --prompts 8 --group 4 \
        --steps 100 --lr 1e-4 --max-tokens 8 --seed 0 [--schedule cosine]

    .venv-trl/bin/python bench/rl_trl.py --gemma3 --model SFT_DIR --train F --eval TEST --out DIR \
        [--steps 100] [--minutes 60] [--threads 2] [--shape 16x8] [--mark-min 10]

Writes the trained checkpoint to --out and `trl_result.json` there (steps, seconds, seconds
per step of the training loop). Reward: exact match of the answer (the chain_sum scorer's
verdict on integer answers).

`--gemma3`: the settings of pipelines/gemma3_grpo.yaml's grpo stage on its SFT checkpoint (Gemma
3 270M): LoRA (rank 16, alpha 32, dropout 0, all-linear: peft, as `lora: {rank: 16}`), bf16,
prompts rendered as "Question: {prompt}\nAnswer:" (its `chat_template: plain`; TRL gets the
text, not messages, and Gemma's tokenizer puts the BOS first, as plain does), 16 prompts x 8
samples a step (`--shape`) in micro batches of 32 (TRL's gradient accumulation, one optimizer
step a batch), 8 answer tokens, temperature 1, lr `--lr` (bench/rl.py passes the stage's) with
10% warm-up then cosine to a tenth over `--steps` (the grpo stage's max_steps), AdamW betas
0.9/0.95, no weight decay, gradients clipped at norm 1, no gradient checkpointing (TRL's
GRPOConfig turns it on); the stage's grpo defaults: one update per batch (`num_iterations=1`,
on-policy), no KL (`kl_coef: 0` as `beta=0`, no reference model), group-std advantages
(`scale_rewards="group"`, `advantage: grpo`), each token of the step weighing the same
(`loss_type="dapo"`, our `loss_agg: token_mean`), ratio clip 0.2; the torch threads of
`--threads`. Every `--mark-min` minutes of training wall time (10) it stops the clock and scores
greedy answers to the first `--eval-limit` (200) prompts of `--eval`, and writes each mark
(minutes, step, accuracy) to `marks` in `trl_result.json`, with a last mark where training ends
(after `--minutes`, or at `--steps`), and the steps and training seconds per step. bench/rl.py
--gemma3 runs it beside the rl stage.

Run it in a virtual environment (`make bench-rl-setup`), not on packages installed with `pip
install --target` or put on PYTHONPATH: datasets fingerprints a Dataset with dill, which
pickles a module by value unless its file lies under the interpreter's prefix or in a
`site-packages` folder, and pyarrow by value fails (`PicklingError: Can't pickle <class
'MonthDayNano'>`); the script refuses such an install up front.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# --gemma3: GRPOConfig's values for the rl stage's defaults, set whatever TRL's own defaults are
OURS = {
    "adam_beta1": 0.9,  # stages/lib/distributed/trainer.py's BETAS
    "adam_beta2": 0.95,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "gradient_checkpointing": False,  # GRPOConfig's default is True (TRL 1.x); the stage's off
    # the grpo defaults of stages/rl/algo/options.py
    "beta": 0.0,  # kl_coef 0: no reference model
    "num_iterations": 1,  # ppo_epochs 1: one update per batch, on-policy
    "epsilon": 0.2,  # eps_clip
    "scale_rewards": "group",  # advantage grpo: (r - mean) / std in the group
    "loss_type": "dapo",  # loss_agg token_mean: every loss token of the step weighs the same
}


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--model", "--train", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument(
        "--steps", type=int, default=100, help="steps (--gemma3: the schedule's, and at most)"
    )
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
MICRO = 32  # gemma3_grpo.yaml's micro_train_batch_size


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


def installed_by_reference() -> None:
    """Refuse packages that dill would pickle by value (module docstring): datasets'
    fingerprint of any Dataset would fail on pyarrow, after minutes of imports."""
    import dill._dill
    import pyarrow

    if not dill._dill._is_builtin_module(pyarrow):
        raise SystemExit(
            f"pyarrow is imported from {pyarrow.__file__}, outside this interpreter's prefix "
            f"({sys.prefix}) and any site-packages folder: datasets' fingerprint (dill) would "
            "fail with \"Can't pickle <class 'MonthDayNano'>\". Install trl in a virtual "
            "environment (make bench-rl-setup), not with pip --target or PYTHONPATH."
        )


def gemma3(args: argparse.Namespace) -> None:
    """The --gemma3 mode (module docstring): accuracy against wall time, LoRA, bf16."""
    installed_by_reference()
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
    batch = prompts * group  # the grpo stage's train_batch_size: one optimizer step a batch
    micro = min(MICRO, batch)
    if batch % micro:
        raise SystemExit(f"--shape {args.shape}: {batch} samples are not micro batches of {micro}")
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # one generation of `batch` a step
        num_generations=group,
        max_completion_length=8,
        temperature=1.0,
        learning_rate=args.lr,  # bench/rl.py passes the stage's
        warmup_steps=math.ceil(0.1 * args.steps),  # warmup_ratio 0.1, as ours rounds
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        max_steps=args.steps,  # and the clock (--minutes), whichever comes first
        **OURS,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        bf16=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
    )
    marks: list[dict[str, float]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Training wall time (the marks' own evaluation excluded); a mark every mark-min."""

        def __init__(self) -> None:
            self.spent, self.since, self.steps = 0.0, time.perf_counter(), 0

        def on_step_end(self, _args: object, state: object, control: object, **kw: object) -> None:
            now = time.perf_counter()
            self.spent += now - self.since
            self.steps = state.global_step  # type: ignore[attr-defined]
            if self.spent >= len(marks) * args.mark_min * 60:  # marks[0]: the start
                self.mark(kw["model"])
            if self.spent >= args.minutes * 60:
                control.should_training_stop = True  # type: ignore[attr-defined]
            self.since = time.perf_counter()

        def mark(self, model: object) -> None:
            acc = held_out(model, tokenizer, test, 8)
            marks.append({"minutes": self.spent / 60, "step": self.steps, "accuracy": acc})
            print(json.dumps(marks[-1]), flush=True)

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[clock],
    )
    start = time.perf_counter()
    clock.mark(trainer.model)
    clock.since = time.perf_counter()
    trainer.train()
    if marks[-1]["step"] != clock.steps:  # where training ended
        clock.mark(trainer.model)
    os.makedirs(args.out, exist_ok=True)
    result = {
        "marks": marks,
        "steps": clock.steps,
        "train_s": clock.spent,
        "seconds_per_step": clock.spent / max(clock.steps, 1),
        "wall_s": time.perf_counter() - start,
    }
    with open(os.path.join(args.out, "trl_result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
