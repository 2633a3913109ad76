"""algorithm: rm: preference pairs in, a Bradley-Terry reward model's loss and held-out
pairwise accuracy out.

Input: training rows (preference pair rows, `stages.lib.io.preference`'s shapes, or rollouts
with a `reward`, paired as DPO pairs them: `stages.train.data.dpo_pairs`), the tokenizer, and
on the ranks the model being trained: a `...ForSequenceClassification` with one label (a
scalar head on the causal LM, `stages.lib.distributed.rank.load_model`).
Output: a `TrainingSet` (`reward_set`: each pair's chosen and rejected sequence as a reward
model scores them, `stages.lib.model.reward_model.score_ids`, and its margin), a micro batch's
summed loss and its right-order count and summed gap (`reward_loss`), and the held-out
pairwise accuracy (`HeldOutPairs`, with the final scores of every held-out pair in
`<stage_dir>/heldout_scores.jsonl`), and the statistics `normalize_reward` divides by, from
the final scores (`final_stats`).

The score of a sequence is the head's output at its last token (its closing token), read
from the head's per-position output, so packed rows (several sequences per row) score each
sequence; a padded row gives what transformers' pooling (the last non-pad token) gives, which
is how `AutoModelForSequenceClassification` scores the saved checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from stages.train.data import (
    DataError,
    Example,
    Row,
    TrainingSet,
    dpo_pairs,
    is_conversation,
    prompt_of,
    read_rows,
    target_of,
)

if TYPE_CHECKING:
    import torch

    from stages.train import TrainConfig
    from stages.train.batch_plan import Micro
    from stages.train.loss import Batch

Pair = tuple[Any, Any, Any, float]  # prompt (None: each response whole), chosen, rejected, margin


def _rollout_response(row: Row) -> tuple[Any, Any]:
    """(prompt, response) of a rollout as a reward model scores it: a conversation whole."""
    if is_conversation(row):
        return None, [
            {"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]
        ]
    return prompt_of(row), target_of(row, "completion")


def preference_pairs(
    rows: Sequence[Row], margin: float | str = 0.0, path: str = "input"
) -> list[Pair]:
    """The pairs of `rows`: preference pair rows as they are (judged by the first row), or
    rollouts paired by reward (`dpo_pairs`). `margin` is a number for every pair or the name
    of a pair row's field holding its own; a row that is no pair, or lacks that field, is a
    `DataError` naming its row."""
    from stages.lib.io.preference import PairError, check_pair_rows, is_pair_row, pair_parts

    if rows and is_pair_row(rows[0]):
        try:
            check_pair_rows(rows, path)
        except PairError as e:
            raise DataError(str(e)) from None
        out = []
        for n, row in enumerate(rows, start=1):
            m: Any = row.get(margin) if isinstance(margin, str) else margin
            if not isinstance(m, int | float) or isinstance(m, bool):
                raise DataError(f"{path}: row {n} has no numeric '{margin}' (margin: {margin})")
            out.append((*pair_parts(row), float(m)))
        return out
    if isinstance(margin, str):
        raise DataError(
            f"{path}: margin '{margin}' names a field of preference pair rows, and these rows "
            "are rollouts (paired here by reward): give a number"
        )
    try:
        pairs = dpo_pairs(rows, "rm")
    except DataError as e:
        raise DataError(f"{path}: {e}") from None
    out = []
    for c, r in pairs:
        (prompt, chosen), (_, rejected) = _rollout_response(rows[c]), _rollout_response(rows[r])
        out.append((prompt, chosen, rejected, float(margin)))
    return out


def pair_texts(pairs: Sequence[Pair]) -> list[str]:
    """Every text in the pairs (to train a fresh tokenizer on)."""
    out: list[str] = []
    for pair in pairs:
        for part in pair[:3]:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, list):
                out += [str(m["content"]) for m in part]
    return out


def reward_set(pairs: Sequence[Pair], tokenizer: Any, max_length: int) -> TrainingSet:
    """Chosen and rejected sequences as a reward model scores them, each an `Example` whose
    one trained token is its last (where the score is read); a pair whose two sequences come
    out the same (cut to `max_length` before they differ) is dropped."""
    from stages.lib.model.reward_model import score_ids

    examples: list[Example] = []
    margins: list[float] = []
    for prompt, chosen, rejected, margin in pairs:
        c = score_ids(tokenizer, prompt, chosen, max_length)
        r = score_ids(tokenizer, prompt, rejected, max_length)
        if c == r:
            continue
        examples += [Example(tuple(c), len(c) - 1), Example(tuple(r), len(r) - 1)]
        margins.append(margin)
    units: list[tuple[int, ...]] = [(2 * j, 2 * j + 1) for j in range(len(margins))]
    return TrainingSet(examples, units, len(pairs) - len(margins), tuple(margins))


def check_reward_data(cfg: TrainConfig, rows: Sequence[Row]) -> list[Pair]:
    """The pairs of the training `rows` (and of `eval_input`), once every row is known to be
    usable (else `DataError`): the stage process checks them before any rank starts."""
    pairs = preference_pairs(rows, cfg.margin, str(cfg.input))
    if not pairs:
        raise DataError(f"{cfg.input}: no pairs: no prompt has rollouts whose rewards differ")
    if cfg.eval_input:
        preference_pairs(read_rows(cfg.eval_input), 0.0, cfg.eval_input)
    return pairs


@contextmanager
def head_outputs(module: Any) -> Iterator[list[torch.Tensor]]:
    """While open, the reward head's per-position output `[rows, width, 1]` of each forward
    of `module` is appended to the yielded list (transformers' pooled `logits` read one
    position per row: a packed row holds several sequences)."""
    head = getattr(module, "score", None)
    if head is None:
        raise TypeError(f"{type(module).__name__} has no reward head ('score')")
    got: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _a, out: got.append(out))
    try:
        yield got
    finally:
        handle.remove()


def end_positions(micro: Micro, examples: Sequence[Example]) -> tuple[list[int], list[int]]:
    """(row, column) of each sequence's last token in the micro batch's layout
    (`stages.train.loss.collate`: sequences side by side in each row), in slot order."""
    rows, cols = [], []
    for r, row in enumerate(micro.rows):
        at = 0
        for s in row:
            at += len(examples[s].input_ids)
            rows.append(r)
            cols.append(at - 1)
    return rows, cols


def reward_loss(
    trainer: Any, micro: Micro, batch: Batch, data: TrainingSet, device: str
) -> tuple[torch.Tensor, list[float]]:
    """The micro batch's summed Bradley-Terry loss (`stages.train.loss.reward_terms`), and
    its pairs in the right order and summed gap r_chosen - r_rejected."""
    import torch

    from stages.train.loss import reward_terms

    with head_outputs(trainer.module) as got:
        trainer(**batch.model_inputs(device))
    per_position = got[-1][..., 0]
    if micro.dummy:
        return per_position.sum() * 0.0, [0.0, 0.0]
    rows, cols = end_positions(micro, data.examples)
    at = per_position.device
    scores = per_position[torch.tensor(rows, device=at), torch.tensor(cols, device=at)]
    slot = {s: i for i, s in enumerate(batch.seqs)}
    order = torch.tensor([slot[s] for u in micro.units for s in data.units[u]], device=device)
    scores = scores[order]
    margin = torch.tensor([data.margins[u] for u in micro.units], device=device)
    losses, gaps = reward_terms(scores[0::2], scores[1::2], margin)
    return losses.sum(), [float((gaps > 0).sum()), float(gaps.sum())]


class HeldOutPairs:
    """Held-out pairs (`eval_input`, at most `eval_limit`) and the pairwise accuracy of the
    model as it trains: the share of pairs whose chosen response scores above the rejected
    one. The same interface as `stages.train.heldout.HeldOut`."""

    def __init__(
        self, seqs: Sequence[tuple[Sequence[int], Sequence[int]]], pad: int, device: str
    ) -> None:
        self.seqs = list(seqs)  # each pair's (chosen, rejected) token ids
        self.pad, self.device = pad, device
        self.last: list[tuple[int, float, float]] = []  # this rank's (pair, chosen, rejected)

    @classmethod
    def held_out(cls, cfg: TrainConfig, tokenizer: Any, pad: int, device: str) -> HeldOutPairs:
        """The pairs of `eval_input`, at most `eval_limit`."""
        from stages.lib.model.reward_model import score_ids

        assert cfg.eval_input is not None
        pairs = preference_pairs(read_rows(cfg.eval_input), 0.0, cfg.eval_input)[: cfg.eval_limit]
        seqs = [
            (
                score_ids(tokenizer, p, c, cfg.max_length),
                score_ids(tokenizer, p, r, cfg.max_length),
            )
            for p, c, r, _ in pairs
        ]
        return cls(seqs, pad, device)

    @classmethod
    def training(cls, data: TrainingSet, pad: int, device: str) -> HeldOutPairs:
        """The training pairs (`reward_set`), to score once training is done."""
        ex = data.examples
        seqs = [(ex[c].input_ids, ex[r].input_ids) for c, r in data.units]
        return cls(seqs, pad, device)

    def accuracy(self, module: Any, rank: int = 0, world: int = 1) -> tuple[int, int]:
        """Pairs in the right order and pairs scored by this rank of `world`: every world-th
        pair from `rank` on, as many on every rank (a short share repeats its first,
        unscored) and in as many forward passes, so ZeRO-3's ranks gather together."""
        from stages.lib.model.reward_model import score_batches

        mine = list(range(rank, len(self.seqs), world))
        share = -(-len(self.seqs) // world)
        padded = mine + [mine[0] if mine else 0] * (share - len(mine))
        flat = [seq for i in padded for seq in self.seqs[i]] if self.seqs else []
        module.eval()
        try:
            scores = score_batches(module, flat, self.pad, self.device) if flat else []
        finally:
            module.train()
        self.last = [(i, scores[2 * k], scores[2 * k + 1]) for k, i in enumerate(mine)]
        return sum(c > r for _, c, r in self.last), len(mine)

    def gathered(self, world: int) -> list[tuple[int, float, float]]:
        """Every pair's last (pair, chosen, rejected) scores, in order, from every rank (each
        rank calls it)."""
        import torch.distributed as dist

        parts: list[Any] = [self.last]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, self.last)
        return sorted(t for part in parts for t in part)

    def write_scores(self, path: str, rank: int, world: int) -> None:
        """Rank 0 writes every held-out pair's last scores (`{"pair", "chosen", "rejected"}`,
        in file order), gathered from the ranks."""
        from stages.lib.io.jsonl import atomic_write

        rows = self.gathered(world)
        if rank == 0:
            lines = [json.dumps({"pair": i, "chosen": c, "rejected": r}) for i, c, r in rows]
            atomic_write(path, "".join(line + "\n" for line in lines))


def final_stats(loop: Any, rank: int, world: int) -> dict[str, float]:
    """The statistics `normalize_reward` divides by, once training is done
    (`stages.lib.model.reward_model.reward_stats`): over the chosen and rejected scores of
    every held-out pair as last scored (OpenRLHF's last evaluation), else of every training
    pair, scored now. Every rank calls it."""
    from stages.lib.model.reward_model import reward_stats

    pairs = loop.held_out
    if not (isinstance(pairs, HeldOutPairs) and pairs.last):
        pairs = HeldOutPairs.training(loop.data, loop.pad_id, loop.device)
        pairs.accuracy(loop.trainer.module, rank, world)
    return reward_stats([x for _, c, r in pairs.gathered(world) for x in (c, r)])
