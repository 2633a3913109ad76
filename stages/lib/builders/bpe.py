"""Byte-level BPE tokenizers built offline, as `tokenizers.Tokenizer` objects.

Input: texts to train on and the special tokens (`train_bpe`), or a file of tiktoken ranks,
one base64 token and its rank a line, as OpenAI-style releases ship them (`tiktoken_bpe`).
Output: the tokenizer, special tokens first (trained) or none added yet (read).
SentencePiece vocabularies: `stages.lib.builders.spm`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BYTE_ALPHABET = 256


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE trained on `texts`, digits split one per
    token, `special_tokens` first (ids 0, 1, ... in their order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = BYTE_ALPHABET + len(special_tokens)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The ranks of a tiktoken file: each token's bytes and its id."""
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_bpe(path: Path, pattern: str, *, ignore_merges: bool) -> Any:
    """The BPE of tiktoken ranks: ids are the ranks; merges recovered from them as
    transformers' TikTokenConverter does (every split of a token into two ranked pieces, in
    the merged token's rank order); `pattern` splits text before the byte-level mapping."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = tiktoken_ranks(path)
    byte_map = dict(enumerate(_bytes_to_unicode()))

    def text(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for b, r in ranks.items():
        for i in range(1, len(b)):
            left, right = b[:i], b[i:]
            if left in ranks and right in ranks:
                merges.append((r, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    bpe = models.BPE(vocab, [(m[3], m[4]) for m in merges], ignore_merges=ignore_merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-to-character table (the ByteLevel alphabet), by byte value."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]
