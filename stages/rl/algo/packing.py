"""A micro batch of samples laid out as model inputs: padded rows, or packed rows.

Input: samples (token ids, where the completion starts), the pad id, and whether to pack.
Output: a `Layout`: the forward's keyword arguments (ids with an attention mask, or ids with
position ids), which positions' logits to compute, and how to pick, in sample order, the
state before each completion token.

- Padded: one sample per row, right-padded to the longest; a 2-D attention mask; logits
  for the last positions from the batch's first completion token on (`logits_to_keep`
  as a count).
- Packed (`packing_samples`): samples placed first-fit, longest first, into rows as wide as
  the longest sample; position ids restart at 0 for every sample and no attention mask is
  passed, so transformers confines attention to each sample (a block-diagonal causal mask
  from the position ids, as the train stage packs); logits only at the scored positions
  (`keep_mask`, a boolean mask over the rows: the hidden states it selects, flattened
  row-major, are all the vocabulary projection sees, and are put back in sample order
  here). The padding at the end of a row forms a sequence of its own whose positions are
  never scored.

Both give the same per-token numbers (tests/unit/test_rl_packing.py, to 1e-5 in fp32); a
packed micro batch computes `rows x width` positions where a padded one computes
`samples x width`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Scored(Protocol):
    @property
    def ids(self) -> tuple[int, ...]: ...
    @property
    def prompt_len(self) -> int: ...


@dataclass(frozen=True)
class Layout:
    ids: torch.Tensor  # [rows, width]
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    rows: torch.Tensor  # per scored position, in sample order: its row
    cols: torch.Tensor  # and the position of the state before the token
    keep: int  # padded: logits_to_keep, the last positions; packed: 0 (all, then keep_mask)
    keep_mask: torch.Tensor | None  # packed: [rows, width], True where a position is scored
    order: torch.Tensor | None  # packed: sample order -> index in the flattened logits

    def inputs(self) -> dict[str, Any]:
        """The forward's inputs (without logits_to_keep, which the critic does not take)."""
        if self.position_ids is not None:  # transformers finds the samples only without a
            # KV cache: a cache (on by default in the model config) hides the packing
            return {"input_ids": self.ids, "position_ids": self.position_ids, "use_cache": False}
        return {"input_ids": self.ids, "attention_mask": self.attention_mask}

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits at each scored position, in sample order."""
        if self.order is not None:
            return logits.reshape(-1, logits.shape[-1])[self.order]
        return logits[self.rows, self.cols - (self.ids.shape[1] - self.keep)]

    def targets(self) -> torch.Tensor:
        """The token after each scored position (the one whose probability is scored)."""
        return self.ids[self.rows, self.cols + 1]


def layout(samples: Sequence[Scored], device: str, pad_id: int, packed: bool) -> Layout:
    """`samples` as model inputs (module docstring)."""
    return _packed(samples, device, pad_id) if packed else _padded(samples, device, pad_id)


def _padded(samples: Sequence[Scored], device: str, pad_id: int) -> Layout:
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        rows += [b] * (len(s.ids) - s.prompt_len)
        cols += range(s.prompt_len - 1, len(s.ids) - 1)
    c = torch.tensor(cols, dtype=torch.long)
    start = int(c.min()) if len(c) else width - 1  # the first position scored
    return Layout(
        ids.to(device),
        mask.to(device),
        None,
        torch.tensor(rows, dtype=torch.long, device=device),
        c.to(device),
        width - start,
        None,
        None,
    )


def pack(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """Each length's (row, offset): first-fit, longest first, into rows of `width`."""
    free: list[int] = []
    place = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            row = len(free)
            free.append(width)
        place[i] = (row, width - free[row])
        free[row] -= lengths[i]
    return place


def _packed(samples: Sequence[Scored], device: str, pad_id: int) -> Layout:
    lengths = [len(s.ids) for s in samples]
    width = max(lengths)
    place = pack(lengths, width)
    n_rows = 1 + max(r for r, _ in place)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    used = [0] * n_rows
    rows: list[int] = []
    cols: list[int] = []
    for s, (r, at) in zip(samples, place, strict=True):
        n = len(s.ids)
        ids[r, at : at + n] = torch.tensor(s.ids)
        pos[r, at : at + n] = torch.arange(n)
        used[r] = max(used[r], at + n)
        rows += [r] * (n - s.prompt_len)
        cols += range(at + s.prompt_len - 1, at + n - 1)
    for r, end in enumerate(used):  # a row's tail: a sequence of its own, never scored
        pos[r, end:] = torch.arange(width - end)
    r_t = torch.tensor(rows, dtype=torch.long)
    c_t = torch.tensor(cols, dtype=torch.long)
    keep = torch.zeros((n_rows, width), dtype=torch.bool)
    keep[r_t, c_t] = True
    flat = r_t * width + c_t  # the flattened logits come row-major: rank each position
    order = torch.empty_like(flat)
    order[torch.argsort(flat)] = torch.arange(len(flat))
    return Layout(
        ids.to(device),
        None,
        pos.to(device),
        r_t.to(device),
        c_t.to(device),
        0,
        keep.to(device),
        order.to(device),
    )
