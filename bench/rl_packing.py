"""Benchmark: the rl actor's update on packed micro batches beside padded ones, in one run.

    .venv/bin/python bench/rl.py --packing [--samples 512] [--micro 128] [--rounds 5]

The quickstart's tiny Llama (hidden 128, 2 layers, 16 heads, vocabulary 512, built from
config), one torch thread, and one step's samples with varied lengths: prompts of 10-200
tokens and answers of 1-64, drawn from a fixed seed. Each round runs one optimizer step of
the actor's loss (the same code as the rl actor: `plan_micros`, `completion_logprobs`,
`masked_policy_terms`, backward, AdamW) padded, then packed, alternating; printed per round
and as medians: training tokens/s (every token of every sample, prompt included, over the
step's wall time) of each and the ratio packed / padded, and the largest difference between
the two layouts' per-token log-probabilities on the first micro batch (the same weights).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUICKSTART: dict[str, Any] = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 16,
    "vocab_size": 512,
}


def make_samples(n: int, seed: int) -> list[Any]:
    from stages.rl.algo.logprobs import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(10, 200), rng.randint(1, 64)
        ids = tuple(rng.randint(8, 511) for _ in range(prompt + answer))
        old = tuple(-rng.random() for _ in range(answer))
        out.append(Sample(ids, prompt, old, rng.gauss(0.0, 1.0)))
    return out


def step(model: Any, opt: Any, samples: list[Any], micro: int, packed: bool) -> float:
    """One optimizer step over `samples` as the rl actor takes it; its wall seconds."""
    import torch

    from stages.rl.algo.logprobs import completion_logprobs
    from stages.rl.algo.loss import masked_policy_terms
    from stages.rl.algo.micro import plan_micros

    began = time.perf_counter()
    norm = sum(s.trained_len for s in samples)
    for batch in plan_micros(samples, 1, micro, False, packed)[0]:
        new, _ = completion_logprobs(model, batch, "cpu", 1.0, 0, True, packed=packed)
        flat = torch.cat(new)
        old = torch.tensor([x for s in batch for x in s.old_logprobs])
        adv = torch.tensor([s.advantage for s in batch for _ in range(s.completion_len)])
        mask = torch.tensor([m for s in batch for m in s.loss_mask()])
        loss, _, _ = masked_policy_terms(flat, old, adv, mask, 0.2)
        (loss / norm).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def main(n_samples: int, micro: int, rounds: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from stages.rl.algo.logprobs import completion_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="pipe-bench-packing-")
    build_tiny_model(
        TinyModel(**QUICKSTART), [f"{a} + {a} = {2 * a}" for a in range(200)], folder, 0
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    samples = make_samples(n_samples, 0)
    tokens = sum(len(s.ids) for s in samples)
    with torch.no_grad():
        first = samples[:micro]
        a = torch.cat(completion_logprobs(model, first, "cpu", 1.0, 0, packed=False)[0])
        b = torch.cat(completion_logprobs(model, first, "cpu", 1.0, 0, packed=True)[0])
    print(
        f"{n_samples} samples ({tokens} tokens; prompts 10-200, answers 1-64), micro batches "
        f"of {micro}, tiny Llama {QUICKSTART}; max |log-prob packed - padded| "
        f"{float((a - b).abs().max()):.2e}"
    )
    print(f"{'round':>6} {'padded tok/s':>13} {'packed tok/s':>13} {'packed/padded':>14}")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for packed in (False, True):
            rates[packed].append(tokens / step(model, opt, samples, micro, packed))
        pad, pk = rates[False][-1], rates[True][-1]
        print(f"{r + 1:>6} {pad:>13.0f} {pk:>13.0f} {pk / pad:>14.2f}", flush=True)
    pad, pk = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{'median':>6} {pad:>13.0f} {pk:>13.0f} {pk / pad:>14.2f}")
