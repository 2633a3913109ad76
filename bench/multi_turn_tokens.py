"""Benchmark: rl's two multi-turn token modes, `extend` (token-in, token-out) and `rerender`,
on two-turn `retry` episodes of a Llama-3.1-like checkpoint (a template that trims answers).

    .venv/bin/python bench/multi_turn_tokens.py [--steps 10] [--prompts 16] [--seed 0]
        [--model llama3|trim]

Made once in bench/out/multi_turn_tokens/base: pipelines/grpo_retry.yaml's data and warm-up,
with the warm-up's model a `family: llama3` checkpoint (Llama 3.1's special tokens and chat
template, its `| trim` included; a small BPE) and its steps capped at --warmup-steps.
`--model trim`: the quickstart's tiny model (a 512-token BPE, fast enough on a CPU to warm up
to grpo_retry's 40%) with its plain template changed only to `| trim` each answer, as Llama
3's does (written to bench/out/multi_turn_tokens/trim.jinja); its random-weights twin is the
warm-up's folder with fresh weights. Then:

1. Tokens: on the warm-up and on the same model with random weights (an untrained model's
   answers: cut at 8 tokens, whitespace first among them), --prompts test prompts x 8
   episodes played in each mode with the same sampling seed (turn 1 is the same request in
   both), counted: sampled tokens and of them trained (mask 1 in the final sequence), the
   first turn's, first answers trained whole, answers beginning with whitespace.
2. Learning: the yaml's grpo stage, in the base run, for --steps steps in each mode (same
   seed, data and steps), --prompts prompts x 8 episodes a step; printed: each step's mean
   reward, and the held-out accuracy within two turns (100 test prompts, greedy, asked as
   evaluate asks in both modes) where the stage scores it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out" / "multi_turn_tokens"
PIPE = [sys.executable, "-m", "engine.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
MODEL = "{family: llama3, dtype: float32, hidden_size: 128, num_layers: 2, num_heads: 16}"
MODES = ("extend", "rerender")
TINY = "{hidden_size: 128, num_layers: 2, num_heads: 16, vocab_size: 512}"
TRIM = (  # the tiny models' template (stages.lib.chat.prompt), each answer trimmed
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] | trim }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def base(warmup_steps: int, model: str = "llama3") -> Path:
    """The data and the warm-up (Llama-3.1-like, or the tiny model trimming), made once."""
    run = OUT / ("base" if model == "llama3" else f"base-{model}")
    if not (run / "warmup" / "checkpoint" / "config.json").exists():
        sets = {
            "stages.warmup.config.model": MODEL,
            "stages.warmup.config.max_steps": warmup_steps,
            "stages.data.config.size": 4000,
        }
        if model == "trim":
            (OUT / "trim.jinja").parent.mkdir(parents=True, exist_ok=True)
            (OUT / "trim.jinja").write_text(TRIM)
            sets["stages.warmup.config.model"] = TINY
            sets["stages.warmup.config.chat_template"] = str(OUT / "trim.jinja")
        args = [*PIPE, "run", "pipelines/grpo_retry.yaml", "--run-dir", str(run)]
        args += ["--only", "data", "--only", "warmup"]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        subprocess.run(args, cwd=ROOT, env=ENV, check=True)
    return run


def fresh_weights(model: Path) -> Path:
    """`model`'s folder (its tokenizer and template) with freshly initialised weights."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = OUT / f"random-{model.parent.parent.name}" / "checkpoint"
    if not (folder / "config.json").exists():
        shutil.copytree(model, folder, dirs_exist_ok=True)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(folder)
    return folder


def random_checkpoint() -> Path:
    """The warm-up's model with random weights (its BPE trained on the builder's arithmetic
    corpus): answers of any tokens, whitespace first among them, as an untrained model's."""
    from stages.lib.builders.families import build_family_checkpoint

    folder = OUT / "random" / "checkpoint"
    if not (folder / "config.json").exists():
        build_family_checkpoint(
            "llama3", folder, hidden_size=128, num_layers=2, num_heads=16, dtype="float32"
        )
    return folder


def tokens(b: Path, model: Path, prompts: int, seed: int) -> dict[str, dict[str, int]]:
    """Part 1: the tokens each mode trains of those sampled, on the same episodes' turn 1."""
    import torch

    from stages.lib.config import Verifier
    from stages.lib.env.contract import environment_factory
    from stages.lib.env.field import EnvironmentConfig
    from stages.rl.rollout.local import LocalEngine
    from stages.rl.rollout.token_play import PlaySettings, play

    rows = [json.loads(x) for x in (b / "data/test.jsonl").read_text().splitlines()][:prompts]
    env = EnvironmentConfig(
        kind="retry", max_turns=2, config={"penalty": 0.5, "feedback": "wrong, try again"}
    )
    make_env = environment_factory(env, Verifier())
    out = {}
    for mode in MODES:
        torch.manual_seed(seed)
        engine = LocalEngine(str(model))
        s = PlaySettings(8, 1.0, 8, 1024, seed, 256, 2, 60.0, 64, mode)
        groups = play(engine, engine.tokenizer, make_env, rows, s)
        out[mode] = count([t for g in groups for t in g], engine.tokenizer)
    return out


def count(traces: list[Any], tok: Any) -> dict[str, int]:
    c = dict.fromkeys(
        ("episodes", "two_turn", "sampled", "trained", "first_sampled", "first_trained"), 0
    )
    c |= {"first_whole": 0, "space_first": 0, "space_sampled": 0, "space_trained": 0}
    for t in traces:
        c["episodes"] += 1
        c["sampled"] += sum(len(a) for a, _ in t.answers)
        c["trained"] += sum(t.mask)
        if len(t.answers) < 2:
            continue
        first, last = t.answers[0][0], t.answers[-1][0]
        kept = sum(t.mask) - len(last)  # the last answer is trained whole in both modes
        c["two_turn"] += 1
        c["first_sampled"] += len(first)
        c["first_trained"] += kept
        c["first_whole"] += kept == len(first)
        if first and tok.decode(first[:1])[:1].isspace():
            c["space_first"] += 1
            c["space_sampled"] += len(first)
            c["space_trained"] += kept
    return c


def learning(
    b: Path, mode: str, steps: int, prompts: int, seed: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Part 2: the grpo stage for `steps` steps in `mode`, in the base run (its data and
    warm-up); its metrics rows (kept as grpo-<mode>.jsonl) and rl_result.json."""
    sets = {
        "eval_limit": 100,
        "rollout_batch_size": prompts,
        "train_batch_size": prompts * 8,
        "micro_train_batch_size": prompts * 8,
        "max_steps": steps,
        "eval_every": steps,
        "save_steps": steps,
        "seed": seed,
        "multi_turn_tokens": mode,
    }
    args = [*PIPE, "run", "pipelines/grpo_retry.yaml", "--only", "grpo", "--force"]
    args += ["--run-dir", str(b)]
    for k, v in sets.items():
        args += ["--set", f"stages.grpo.config.{k}={v}"]
    subprocess.run(args, cwd=ROOT, env=ENV, check=True, capture_output=True)
    text = (b / "grpo/metrics.jsonl").read_text()
    (OUT / f"grpo-{b.name}-{mode}.jsonl").write_text(text)
    result = json.loads((b / "grpo/rl_result.json").read_text())
    return [json.loads(x) for x in text.splitlines()], result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--no-learning", action="store_true", help="part 1 only")
    p.add_argument("--model", choices=("llama3", "trim"), default="llama3")
    a = p.parse_args()
    b = base(a.warmup_steps, a.model)
    warm = b / "warmup/checkpoint"
    random = random_checkpoint() if a.model == "llama3" else fresh_weights(warm)
    for name, model in (("warm-up", warm), ("random", random)):
        print(f"{name} checkpoint ({model}):")
        table(tokens(b, model, a.prompts, a.seed))
    if a.no_learning:
        return
    for mode in MODES:
        rows, result = learning(b, mode, a.steps, a.prompts, a.seed)
        rewards = " ".join(f"{r['reward_mean']:.3f}" for r in rows)
        print(f"{mode}: mean reward by step {rewards}")
        print(
            f"{mode}: held-out within 2 turns {result['eval_accuracy_start']} -> "
            f"{result['eval_accuracy_end']}, first turn {result['eval_first_turn_start']} -> "
            f"{result['eval_first_turn_end']}; {result['seconds_per_step']} s/step"
        )


def table(counted: dict[str, dict[str, int]]) -> None:
    print(
        "| mode | sampled tokens trained | first-turn tokens trained | first answers "
        "trained whole | whitespace-first answers: tokens trained |"
    )
    print("|---|---|---|---|---|")
    for mode, c in counted.items():
        print(
            f"| {mode} | {c['trained']} of {c['sampled']} | {c['first_trained']} of "
            f"{c['first_sampled']} | {c['first_whole']} of {c['two_turn']} | "
            f"{c['space_trained']} of {c['space_sampled']} ({c['space_first']} answers) |"
        )


if __name__ == "__main__":
    main()
