"""Held-out scoring during training: greedy answers to prompts no training row holds.

Input: the train config (`eval_input`, `eval_limit`, `eval_max_tokens`, `verifier`), the
tokenizer, and the model as it trains. Output: the share of prompts whose greedy answer
earns the full reward. A warm-up with `target_accuracy` stops at the first check that
reaches it, so it ends where the model is rather than at a step count (when the model's
sudden jump in accuracy happens depends on the seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stages.lib.jsonl import read_jsonl

if TYPE_CHECKING:
    from stages.train import TrainConfig


class HeldOut:
    """The held-out prompts and how their answers are scored."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any) -> None:
        from stages.lib.verify import make_verifier

        assert cfg.eval_input is not None
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rows = list(read_jsonl(cfg.eval_input))[: cfg.eval_limit]
        self.prompts = [r["messages"] if "messages" in r else r["prompt"] for r in self.rows]
        self.verify = make_verifier(cfg.verifier)

    def accuracy(self, module: Any) -> float:
        """Greedy accuracy of `module` (put in eval mode for the moment, then back)."""
        from stages.lib.generate import generate_with

        module.eval()
        try:
            gens = generate_with(
                module,
                self.tokenizer,
                self.prompts,
                num_samples=1,
                temperature=0.0,
                top_p=1.0,
                max_new_tokens=self.cfg.eval_max_tokens,
                seed=0,
                batch_size=256,
            )
        finally:
            module.train()
        scores = [float(self.verify(r, g[0].text)) for r, g in zip(self.rows, gens, strict=True)]
        return sum(s >= 1.0 for s in scores) / max(len(scores), 1)
