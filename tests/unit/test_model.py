"""The tiny model builder: digit-splitting BPE, chat template, Hugging Face round trip.

Also holds the helpers the generate and evaluate tests build their checkpoints with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model, train_tokenizer  # noqa: E402
from stages.lib.chat.prompt import format_prompt  # noqa: E402

torch.set_num_threads(1)

TEXTS = [f"What is {a} + {b}? {a + b}" for a in range(0, 100, 7) for b in range(3, 60, 11)]
SPEC = TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300)


def tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A freshly built (untrained) tiny checkpoint in `folder/checkpoint`."""
    out = folder / "checkpoint"
    build_tiny_model(SPEC, TEXTS, str(out), seed=seed)
    return out


def rigged_checkpoint(src: Path, dst: Path, favourite: str) -> Path:
    """A copy of `src` that always generates the token `favourite` (greedy).

    The blocks' output projections are zeroed, so the last hidden state is the
    input token's embedding v; every embedding row is set to v except the
    favourite's, 2v. Tied embeddings then give the favourite the top logit
    whatever the input. With favourite '<|eos|>' every answer stops at once.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        v = torch.linspace(0.5, 1.5, emb.shape[1])
        emb.copy_(v.expand_as(emb))
        emb[tok.convert_tokens_to_ids(favourite)] = 2 * v
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


def test_tokenizer_splits_numbers_into_single_digits():
    tok = train_tokenizer(TEXTS * 5, 300)
    ids = tok("1234", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4"]
    assert tok.decode(tok("x = -28 ok", add_special_tokens=False)["input_ids"]) == "x = -28 ok"


def test_tokenizer_learns_merges_for_words():
    tok = train_tokenizer(TEXTS * 5, 300)
    assert tok.convert_ids_to_tokens(tok("What", add_special_tokens=False)["input_ids"]) == ["What"]


def test_chat_template_renders_prompts_and_messages(checkpoint: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert format_prompt(tok, "2 + 3 =") == "<|bos|><|user|>2 + 3 =<|assistant|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 ="}]
    assert format_prompt(tok, messages) == "<|bos|><|system|>Be brief.<|user|>2 + 3 =<|assistant|>"
    full = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "5"}], tokenize=False
    )
    assert full == "<|bos|><|system|>Be brief.<|user|>2 + 3 =<|assistant|>5<|eos|>"


def test_special_tokens_are_single_tokens(checkpoint: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok(format_prompt(tok, "7"), add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<|bos|>", "<|user|>", "7", "<|assistant|>"]
    assert tok.padding_side == "left"


def test_checkpoint_round_trips_through_auto_classes(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert type(model).__name__ == "LlamaForCausalLM"
    config = json.loads((checkpoint / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    } == {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert 262 < len(tok) <= 300  # the corpus is small: fewer merges than the spec allows
    ids = torch.tensor([tok("12 + 5", add_special_tokens=False)["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 300)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path, checkpoint: Path):
    from safetensors.torch import load_file

    again = tiny_checkpoint(tmp_path / "again", seed=0)
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    a = load_file(checkpoint / "model.safetensors")
    b = load_file(again / "model.safetensors")
    c = load_file(other / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert not list(tmp_path.glob("**/*.tmp-*"))


def test_bad_specs_are_refused_by_the_config(tmp_path: Path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="greater than or equal to 262"):
        TinyModel(vocab_size=100)
    with pytest.raises(ValidationError, match="num_heads 3 must divide hidden_size 32"):
        TinyModel(hidden_size=32, num_heads=3, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size must be at least 262 for a byte-level BPE"):
        train_tokenizer(TEXTS, 100)
