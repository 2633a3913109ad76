"""BPE tokenizers built offline, as `tokenizers.Tokenizer` objects.

Input: texts to train on and the special tokens (`train_bpe`); a file of tiktoken ranks,
one base64 token and its rank a line, as OpenAI-style releases ship them (`tiktoken_bpe`);
or the pieces of a SentencePiece BPE model with their scores and types (`spm_pieces` reads
a `tokenizer.model`; `spm_bpe` builds from pieces, wherever they were read).
Output: the tokenizer: byte-level BPE, special tokens first (trained) or none added yet
(tiktoken); SentencePiece's BPE with byte fallback, its control pieces special (spm).
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


# SentencePiece's piece types (sentencepiece_model.proto): normal pieces merge; control pieces
# (<s>, <start_of_turn>) are special; user-defined ones are emitted whole, never merged
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_pieces(path: Path) -> list[tuple[str, float, int]]:
    """The (piece, score, type) of each id of a SentencePiece `tokenizer.model`, and the
    model's BPE type and dummy-prefix setting checked (the protobuf schema transformers
    ships; the sentencepiece package is not needed)."""
    import importlib

    convert: Any = importlib.import_module("transformers.convert_slow_tokenizer")
    proto = convert.import_protobuf().ModelProto()
    proto.ParseFromString(path.read_bytes())
    if proto.trainer_spec.model_type != 2:  # BPE
        raise ValueError(f"{path}: not a SentencePiece BPE model")
    return [(p.piece, p.score, p.type) for p in proto.pieces]


def spm_bpe(pieces: Sequence[tuple[str, float, int]], *, dummy_prefix: bool) -> Any:
    """SentencePiece's BPE as transformers converts it (`LlamaConverter`, `GemmaConverter`):
    ids are the pieces', merges every split of a normal piece into two normal pieces ranked
    by the merged piece's score, byte fallback (`<0x0A>`), spaces as `▁`, and with
    `dummy_prefix` a `▁` before each text between added tokens (Llama's and Mistral's
    "legacy" tokenizer.json); control pieces are added as special tokens, user-defined
    ones as plain tokens, both at their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    normal = {p: (score, i) for i, (p, score, kind) in enumerate(pieces) if kind == NORMAL}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    merges = [(left, right) for _, _, left, right in sorted(ranked)]
    unk = next((p for p, _, kind in pieces if kind == UNKNOWN), None)
    user = [p for p, _, kind in pieces if kind == USER_DEFINED]
    bpe = models.BPE(
        vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True, ignore_merges=bool(user)
    )
    tok = Tokenizer(bpe)
    steps = [normalizers.Prepend("▁")] if dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    fused = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(
        [*fused, decoders.Strip(content=" ", left=1, right=0)] if dummy_prefix else fused
    )
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, _, k in pieces if k == CONTROL]
    )
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    return tok
