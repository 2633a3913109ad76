"""Test checkpoints of real families: architecture, template, token ids, generation_config,
dtype, as each release has them; and the `model: {family: ...}` block that builds them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.chat.prompt import format_prompt  # noqa: E402
from stages.lib.chat.template import TEMPLATES  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.families import FAMILIES, real_vocab_missing  # noqa: E402

torch.set_num_threads(1)
os.environ["HF_HUB_OFFLINE"] = "1"

Build = Callable[..., Path]
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
]
RENDERED = {
    "chatml": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    "<|im_start|>assistant\n5<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>",
    "gemma": "<bos><start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n"
    "<start_of_turn>model\n5<end_of_turn>\n",
    "mistral": "<s>[INST] What is 2 + 3? [/INST]5</s>",
}
# what a prompt ends with, ready for the model's answer
ANSWER_STARTS = {
    "chatml": "What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "What is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "What is 2 + 3?<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "What is 2 + 3? [/INST]",
}
TEMPLATE_SHA256 = {
    "chatml": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "gemma": "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
    "llama3": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "mistral": "26a59556925c987317ce5291811ba3b7f32ec4c647c400c6cc7e3a9993007ba7",
}
ARCHITECTURES = {
    "chatml": "Qwen2ForCausalLM",
    "llama3": "LlamaForCausalLM",
    "gemma": "Gemma2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# the tokenizer's bos/eos/pad and whether it puts bos first; config.json's ids as tokens
TOKENS: dict[str, dict[str, Any]] = {
    "chatml": {
        "tokenizer": (None, "<|im_end|>", "<|endoftext|>", False),
        "config": {"bos": "<|endoftext|>", "eos": "<|im_end|>", "pad": None},
    },
    "llama3": {
        "tokenizer": ("<|begin_of_text|>", "<|eot_id|>", None, True),
        "config": {
            "bos": "<|begin_of_text|>",
            "eos": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
            "pad": None,
        },
    },
    "gemma": {
        "tokenizer": ("<bos>", "<eos>", "<pad>", True),
        "config": {"bos": "<bos>", "eos": ["<eos>", "<end_of_turn>"], "pad": "<pad>"},
    },
    "mistral": {
        "tokenizer": ("<s>", "</s>", None, True),
        "config": {"bos": "<s>", "eos": "</s>", "pad": None},
    },
}
# generation_config.json as released: token fields as tokens
GENERATION: dict[str, dict[str, Any]] = {
    "chatml": {
        "bos_token_id": "<|endoftext|>",
        "pad_token_id": "<|endoftext|>",
        "do_sample": True,
        "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
    },
    "llama3": {
        "bos_token_id": "<|begin_of_text|>",
        "do_sample": True,
        "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        "temperature": 0.6,
        "top_p": 0.9,
    },
    "gemma": {
        "bos_token_id": "<bos>",
        "pad_token_id": "<pad>",
        "eos_token_id": ["<eos>", "<end_of_turn>"],
        "cache_implementation": "hybrid",
    },
    "mistral": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
}


def load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def as_ids(tok: Any, value: Any) -> Any:
    """Token strings (alone or in a list) as their ids; anything else as it is."""
    if isinstance(value, list):
        return [as_ids(tok, v) for v in value]
    if isinstance(value, str) and value.startswith("<"):
        return tok.convert_tokens_to_ids(value)
    return value


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_as_its_family_and_renders_the_real_template(
    family_checkpoint: Build, family: str
):
    model, tok = load(family_checkpoint(family))
    assert type(model).__name__ == ARCHITECTURES[family]
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED[family]
    assert format_prompt(tok, "What is 2 + 3?").endswith(ANSWER_STARTS[family])
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert tok.decode(ids) == RENDERED[family]  # every marker is one token, read back whole
    assert tok.chat_template == (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def test_templates_are_the_releases_text_unchanged():
    releases = {f.stem for f in TEMPLATES.glob("*.jinja")} - {"gemma_tools", "mistral_tools"}
    got = {f: hashlib.sha256((TEMPLATES / f"{f}.jinja").read_bytes()).hexdigest() for f in releases}
    assert got == TEMPLATE_SHA256  # the tool variants are ours (families/README.md)


@pytest.mark.parametrize(
    ("family", "rendered"),
    [
        (
            "chatml",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief."
            "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("gemma", "System role not supported"),
        ("mistral", "Conversation roles must alternate user/assistant/user/assistant/..."),
    ],
)
def test_a_system_message_as_each_release_takes_it(
    family_checkpoint: Build, family: str, rendered: str
):
    from jinja2.exceptions import TemplateError

    _, tok = load(family_checkpoint(family))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    if family in ("gemma", "mistral"):
        with pytest.raises(TemplateError) as err:
            format_prompt(tok, messages)
        assert str(err.value) == rendered
    else:
        assert format_prompt(tok, messages) == rendered


@pytest.mark.parametrize("family", FAMILIES)
def test_token_conventions_of_the_release(family_checkpoint: Build, family: str):
    path = family_checkpoint(family)
    model, tok = load(path)
    bos, eos, pad, adds_bos = TOKENS[family]["tokenizer"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (bos, eos, pad)
    ids = tok("12 + 5")["input_ids"]
    assert (ids[0] == tok.bos_token_id) is adds_bos
    assert tok.convert_ids_to_tokens(ids)[int(adds_bos) : int(adds_bos) + 2] == ["1", "2"]
    config = json.loads((path / "config.json").read_text())
    want = {k: as_ids(tok, v) for k, v in TOKENS[family]["config"].items()}
    assert {k: config.get(f"{k}_token_id") for k in want} == want
    assert model.config.pad_token_id == want["pad"]


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_config_is_the_releases(family_checkpoint: Build, family: str):
    path = family_checkpoint(family)
    _, tok = load(path)
    saved = json.loads((path / "generation_config.json").read_text())
    saved.pop("transformers_version")
    assert saved == {k: as_ids(tok, v) for k, v in GENERATION[family].items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_bf16_and_a_forward_pass_gives_logits_over_the_vocabulary(
    family_checkpoint: Build, family: str
):
    from safetensors import safe_open

    path = family_checkpoint(family)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    model, tok = load(path)
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([tok.apply_chat_template(CONVERSATION, return_dict=False)])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size >= len(tok)
    assert torch.isfinite(logits).all()


REAL = {
    # family: (config vocab_size, ids of "Hello world!", end-of-turn token and id)
    "chatml": (151936, [9707, 1879, 0], ("<|im_end|>", 151645)),
    "llama3": (128256, [9906, 1917, 0], ("<|eot_id|>", 128009)),
    "mistral": (32000, [22557, 1526, 28808], ("</s>", 2)),
    "gemma": (262144, [9259, 1902, 236888], ("<end_of_turn>", 106)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(REAL))
def test_real_vocabulary_gives_the_releases_ids(family_checkpoint: Build, family: str):
    if why := real_vocab_missing(family):
        pytest.skip(why)
    path = family_checkpoint(family, vocab="real")
    model, tok = load(path)
    size, hello, (end, end_id) = REAL[family]
    assert model.config.vocab_size == size
    assert tok("Hello world!", add_special_tokens=False)["input_ids"] == hello
    assert tok.convert_tokens_to_ids(end) == end_id
    text = "12345 + 678 = ?\n Ünïcödé 你好"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED[family]
    gen = json.loads((path / "generation_config.json").read_text())
    stops = gen["eos_token_id"]
    assert end_id in (stops if isinstance(stops, list) else [stops])


def test_a_model_block_with_a_family_builds_that_family(tmp_path: Path):
    from stages.lib.builders.recipe import FamilyModel
    from stages.lib.builders.tiny import build_tiny_model

    spec = FamilyModel(family="mistral", hidden_size=32, num_layers=1, num_heads=2, dtype="float32")
    build_tiny_model(spec, ["What is 1 + 1? 2"] * 5, str(tmp_path / "m"), seed=0)
    model, tok = load(tmp_path / "m")
    assert type(model).__name__ == "MistralForCausalLM"
    assert model.dtype == torch.float32
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.config.max_position_embeddings == 32768  # the release's
    assert format_prompt(tok, "Hi") == "<s>[INST] Hi [/INST]"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_a_stage_reads_a_model_block_by_its_keys():
    from pydantic import TypeAdapter

    from stages.lib.builders.recipe import FamilyModel, TinyModel
    from stages.lib.model.declared import ModelRef

    read = TypeAdapter(ModelRef).validate_python
    assert type(read({"hidden_size": 32, "num_heads": 2})) is TinyModel
    family = read({"family": "gemma", "hidden_size": 32, "num_heads": 2})
    assert type(family) is FamilyModel
    assert (family.family, family.vocab, family.dtype) == ("gemma", "small", "bfloat16")
    assert read("some/checkpoint") == "some/checkpoint"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"family": "chatml", "vocab_size": 270},
            "vocab_size 270 is below 278: 256 bytes and the 22 special tokens of family 'chatml'",
        ),
        ({"family": "llama3", "hidden_size": 30}, "num_heads 4 must divide hidden_size 30"),
    ],
)
def test_model_blocks_a_family_cannot_build_are_refused(fields: dict[str, Any], message: str):
    from pydantic import ValidationError

    from stages.lib.builders.recipe import FamilyModel

    with pytest.raises(ValidationError) as err:
        FamilyModel(**fields)
    assert err.value.errors()[0]["msg"] == f"Value error, {message}"


def test_the_families_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, stages.lib.builders.families, stages.lib.config; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
