"""SentencePiece BPE vocabularies built offline, as `tokenizers.Tokenizer` objects.

Input: a SentencePiece `tokenizer.model` (`spm_pieces`), or the start of a GGUF file, whose
`tokenizer.ggml.*` metadata holds a SentencePiece vocabulary (`gguf_pieces`: only the
header is read, so the first part of a split file is enough).
Output: each id's (piece, score, type), and `spm_bpe`: the tokenizer transformers converts
such a vocabulary to (BPE with byte fallback, merges ranked by score, control pieces
special, user-defined ones whole).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

# SentencePiece's piece types (sentencepiece_model.proto; GGUF's token_type uses the same
# numbers): normal pieces merge; control pieces (<s>, <start_of_turn>) are special;
# user-defined ones (Gemma's "\n\n", runs of spaces) are emitted whole, never merged
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
Pieces = list[tuple[str, float, int]]


def spm_pieces(path: Path) -> Pieces:
    """The (piece, score, type) of each id of a SentencePiece BPE `tokenizer.model` (read
    with the protobuf schema transformers ships; the sentencepiece package is not needed)."""
    import importlib

    convert: Any = importlib.import_module("transformers.convert_slow_tokenizer")
    proto = convert.import_protobuf().ModelProto()
    proto.ParseFromString(path.read_bytes())
    if proto.trainer_spec.model_type != 2:  # BPE
        raise ValueError(f"{path}: not a SentencePiece BPE model")
    return [(p.piece, p.score, p.type) for p in proto.pieces]


# GGUF metadata value types: scalars by struct format, then string (8) and array (9)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def _take(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack("<" + fmt, data)[0]


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return f.read(_take(f, "Q")).decode("utf-8")
    if kind == _ARRAY:
        sub, n = _take(f, "I"), _take(f, "Q")
        if sub in _SCALARS:
            fmt = _SCALARS[sub]
            return list(struct.unpack(f"<{n}{fmt}", f.read(n * struct.calcsize(fmt))))
        return [_value(f, sub) for _ in range(n)]
    return _take(f, _SCALARS[kind])


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (version 2 or 3), read from its start."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        if _take(f, "I") not in (2, 3):
            raise ValueError(f"{path}: an unknown GGUF version")
        _take(f, "Q")  # tensors
        meta = {}
        for _ in range(_take(f, "Q")):
            key = _value(f, _STRING)
            meta[key] = _value(f, _take(f, "I"))
        return meta


def gguf_pieces(path: Path) -> tuple[Pieces, bool]:
    """The SentencePiece vocabulary of a GGUF file's metadata (`tokenizer.ggml.model`
    "llama"), and whether it puts a `▁` before a text (`add_space_prefix`)."""
    meta = gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") != "llama":
        raise ValueError(f"{path}: not a SentencePiece vocabulary")
    columns = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    pieces = [(str(p), float(s), int(k)) for p, s, k in zip(*columns, strict=True)]
    return pieces, bool(meta.get("tokenizer.ggml.add_space_prefix", True))


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
    bpe = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
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
    user = [p for p, _, kind in pieces if kind == USER_DEFINED]
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    return tok
