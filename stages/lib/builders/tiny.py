"""Tiny models built from config, with a tokenizer trained locally.

Input: a `TinyModel` spec and the texts to train a tokenizer on (a `FamilyModel` spec: a
real family's test checkpoint, built by `stages.lib.builders.families`).
Output: an ordinary Hugging Face checkpoint directory (config, weights,
tokenizer with the shared chat template of `stages.lib.chat.prompt`) that
`AutoModelForCausalLM` and `AutoTokenizer` load like any other.

The tokenizer is a byte-level BPE trained with the `tokenizers` library;
digits are split one per token so that arithmetic is learnable by a small model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from stages.lib.builders.bpe import train_bpe
from stages.lib.builders.families import Sizes, build_family
from stages.lib.chat.prompt import BOS, CHAT_TEMPLATE, EOS, PAD, ROLE_TOKENS, SPECIAL_TOKENS

if TYPE_CHECKING:
    from stages.lib.builders.recipe import FamilyModel, TinyModel

log = logging.getLogger("pipe.stages.lib.builders.tiny")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A fast byte-level BPE tokenizer trained on `texts`, digits split one per token."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(texts, vocab_size, SPECIAL_TOKENS)
    wrap: Any = PreTrainedTokenizerFast  # untyped constructor
    fast = wrap(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama_config(spec: TinyModel, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    if spec.hidden_size % spec.num_heads:
        raise ValueError(
            f"num_heads ({spec.num_heads}) must divide hidden_size ({spec.hidden_size})"
        )
    return LlamaConfig(
        vocab_size=max(spec.vocab_size, len(tokenizer)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def build_tiny_model(
    spec: TinyModel | FamilyModel, texts: Iterable[str], out_dir: str, seed: int
) -> None:
    """Build a fresh Llama from `spec`, train its tokenizer on `texts`, save both to `out_dir`
    (a `FamilyModel` spec: that family's checkpoint, by `stages.lib.builders.families`).

    The directory appears complete or not at all: everything is written to a
    temporary sibling first, then renamed into place.
    """
    from stages.lib.builders.recipe import FamilyModel

    if isinstance(spec, FamilyModel):
        _build_family(spec, texts, out_dir, seed)
        return
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    tokenizer = train_tokenizer(texts, spec.vocab_size)
    config = _llama_config(spec, tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "built tiny llama: %d parameters, vocabulary %d, in %s", n_params, len(tokenizer), out_dir
    )


def _build_family(spec: FamilyModel, texts: Iterable[str], out_dir: str, seed: int) -> None:
    """A `model:` block with a `family`: that family's checkpoint
    (`stages.lib.builders.families`)."""
    sizes = Sizes(
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
    )
    build_family(
        spec.family,
        out_dir,
        sizes,
        vocab=spec.vocab,
        vocab_size=spec.vocab_size,
        dtype=spec.dtype,
        seed=seed,
        texts=texts,
    )
