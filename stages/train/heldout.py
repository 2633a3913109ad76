"""Held-out scoring during training: greedy answers to prompts no training row holds.

Input: the train config (`eval_input`, `eval_limit`, `eval_max_tokens`, `verifier`), the
tokenizer, and the model as it trains. Output: the share of prompts whose greedy answer
earns the full reward. A warm-up with `target_accuracy` stops at the first check that
reaches it, so it ends where the model is rather than at a step count (when the model's
sudden jump in accuracy happens depends on the seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stages.lib.io.jsonl import read_jsonl

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

    def accuracy(self, module: Any, rank: int = 0, world: int = 1) -> tuple[int, int]:
        """Right greedy answers and prompts scored by this rank of `world` (`module` in eval
        mode for the moment): every world-th prompt from `rank` on, as many prompts on every
        rank (a short share repeats its first, unscored) and generated in lockstep, so the
        ranks of a ZeRO-3 model run the same forward passes (each gathers the weights
        together; rank 0 generating alone waited for the others forever)."""
        from stages.lib.model.generate import generate_with

        mine = list(range(rank, len(self.prompts), world))
        share = -(-len(self.prompts) // world)
        padded = mine + [mine[0] if mine else 0] * (share - len(mine))
        module.eval()
        try:
            gens = generate_with(
                module,
                self.tokenizer,
                [self.prompts[i] for i in padded],
                num_samples=1,
                temperature=0.0,
                top_p=1.0,
                max_new_tokens=self.cfg.eval_max_tokens,
                seed=0,
                batch_size=256,
                lockstep=world > 1,
            )
        finally:
            module.train()
        scored = zip(mine, gens[: len(mine)], strict=True)  # the padding is not scored
        right = sum(float(self.verify(self.rows[i], g[0].text)) >= 1.0 for i, g in scored)
        return right, len(mine)
