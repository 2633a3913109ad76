"""Benchmark: a train step's forward+backward at Qwen2's 151,936-token vocabulary, with logits
at every position (before) against logits only where the loss reads (now), side by side.

.venv/bin/python bench/logits.py [--rows 16] [--prompt 48] [--answer 8] [--rounds 5] [--threads 1]

A Qwen2-architecture model built from config (hidden 128, 2 layers, tied embeddings, vocab
151,936; random weights), one micro batch of `rows` SFT examples (a `prompt`-token prompt,
an `answer`-token answer, padded rows as the train stage collates them), and the train
stage's own loss (`stages.train.loss.sft_loss_sum`). "before" projects every position to the
vocabulary and reads the answer positions' log-probabilities; "now" projects only those
positions (`stages.lib.model.logits.scored_only`, as `stages.train.loop` does). The two take turns
round by round, so background load hits both alike; tokens/s counts real tokens (prompt +
answer) per second of forward+backward; the medians and their ratio are printed, and the
losses must agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens a row")
    parser.add_argument("--answer", type=int, default=8, help="answer tokens a row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parser.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.lib.model.logits import scored_only
    from stages.train.batch_plan import Micro
    from stages.train.data import Example
    from stages.train.loss import collate, sft_loss_sum

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    length = args.prompt + args.answer
    examples = [
        Example(tuple(torch.randint(0, args.vocab, (length,), generator=g).tolist()), args.prompt)
        for _ in range(args.rows)
    ]
    micro = Micro(units=tuple(range(args.rows)), rows=tuple((i,) for i in range(args.rows)))
    batch = collate(micro, examples, pad_id=0, packed=False)
    scored = batch.scored("cpu")

    def step(only_scored: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with scored_only(model, scored if only_scored else None):
            logits = model(**batch.model_inputs("cpu")).logits
        loss = sft_loss_sum(logits, batch.at(scored) if only_scored else batch)
        loss.backward()
        return time.perf_counter() - start, float(loss)

    step(False), step(True)  # warm-up: allocations, kernels
    times: dict[str, list[float]] = {"before (every position)": [], "now (answer positions)": []}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for name, only in (("before (every position)", False), ("now (answer positions)", True)):
            seconds, losses[name] = step(only)
            times[name].append(seconds)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    tokens = args.rows * length
    print(
        f"vocab {args.vocab:,}, {args.rows} rows x {length} tokens ({args.answer} answer tokens "
        f"a row), {args.threads} thread(s), median of {args.rounds} rounds:"
    )
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, med in medians.items():
        print(f"  {name:26s} {med:7.3f} s  {tokens / med:9,.0f} tokens/s  loss {losses[name]:.4f}")
    before, now = medians.values()
    print(f"  speed-up now/before: {before / now:.2f}x")
    a, b = losses.values()
    assert abs(a - b) <= 1e-3 * abs(a), f"the losses differ: {a} vs {b}"


if __name__ == "__main__":
    main()
