"""`lora.target_modules` that match no module: peft adapts the names that match and says nothing
of the others (`[q_proj, v_prj]` trains q_proj alone). `pipe plan` refuses such a name where
it is written, reading a checkpoint's modules from its `.safetensors` headers (no torch); what
it cannot read (a model built from config, an earlier stage's output) the run refuses before
the first step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.lib.model.lora import LoraBlock
from stages.lib.model.lora.targets import from_weights, unmatched
from tests.conftest import run_cli, stub_checkpoint, stub_weights

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
PIPELINE = """\
name: p
stages:
  t: {{kind: train, config: {{input: x.jsonl, model: {model}, lora: {{target_modules: {targets}}}}}}}
"""


def _llama_weights(folder: Path, shards: int = 1) -> Path:
    """A two-layer Llama checkpoint's tensor names and dimensions (tied: no lm_head.weight),
    over `shards` files."""
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [2, 2], "model.norm.weight": [2]}
    for i in range(2):
        for name in LINEAR:
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            shapes[f"model.layers.{i}.{part}.{name}.weight"] = [2, 2]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"model.layers.{i}.{norm}.weight"] = [2]
    stub_checkpoint(folder)
    if shards == 1:
        stub_weights(folder / "model.safetensors", shapes)
        return folder
    names, weight_map = list(shapes), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        stub_weights(folder / file, {n: shapes[n] for n in names[s::shards]})
        weight_map.update(dict.fromkeys(names[s::shards], file))
    index = {"weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _plan(tmp_path: Path, targets: str, model: str = "base", command: str = "plan") -> list[str]:
    (tmp_path / "x.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(PIPELINE.format(model=model, targets=targets))
    result = run_cli(command, "p.yaml", cwd=tmp_path)
    return [str(result.exit_code), *result.stderr.splitlines()]


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_a_target_no_module_has_is_refused_where_it_is_written_with_the_closest(
    tmp_path: Path, command: str
):
    _llama_weights(tmp_path / "base", shards=2)
    assert _plan(tmp_path, "[q_proj, v_prj, mlp.gate]", command=command) == [
        "2",
        "p.yaml:3:90: stages.t.config.lora.target_modules[1]: 'v_prj' matches no module of the "
        "model: did you mean 'v_proj'? (peft adapts a module named it, or whose name ends in "
        f"'.v_prj'); its linear and embedding layers: {LAYERS}",
        "p.yaml:3:97: stages.t.config.lora.target_modules[2]: 'mlp.gate' matches no module of "
        "the model: did you mean 'gate_proj'? (peft adapts a module named it, or whose name "
        f"ends in '.mlp.gate'); its linear and embedding layers: {LAYERS}",
    ]


def test_a_list_every_entry_of_which_matches_still_plans(tmp_path: Path):
    _llama_weights(tmp_path / "base")
    assert _plan(tmp_path, "[q_proj, mlp.down_proj, self_attn.v_proj]") == ["0"]
    assert _plan(tmp_path, "all-linear") == ["0"]


def test_a_hub_model_the_cache_holds_is_checked_at_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # pinned from the cache: no hub asked
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (_llama_weights(repo / "snapshots" / ("a" * 40)) / "tokenizer.json").write_text("{}")
    lines = _plan(tmp_path, "[q_proj, v_prj]", model="org/tiny")
    assert lines[0] == "2" and len(lines) == 2
    assert lines[1].startswith(
        "p.yaml:3:94: stages.t.config.lora.target_modules[1]: 'v_prj' matches no module of the "
        "model: did you mean 'v_proj'?"
    )


def test_a_model_whose_modules_are_known_only_when_it_loads_is_checked_by_the_run(
    tmp_path: Path,
):
    """A model built from config: the plan cannot read its modules; the run refuses the typo
    before the first step (`with_lora`), naming the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.lib.model.lora.wrap import with_lora

    assert _plan(tmp_path, "[q_proj, v_prj]", model="{hidden_size: 32}")[0] == "0"
    config = LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=16,
    )  # fmt: skip
    with pytest.raises(ValueError) as err:
        with_lora(LlamaForCausalLM(config), LoraBlock(target_modules=["q_proj", "v_prj"]))
    assert str(err.value) == (
        "lora.target_modules: 'v_prj' matches no module of the model: did you mean 'v_proj'? "
        "(peft adapts a module named it, or whose name ends in '.v_prj'); its linear and "
        f"embedding layers: {LAYERS}"
    )


def test_targets_match_as_peft_matches_them():
    """A name, or a dotted suffix, of a module; a string is a regular expression the whole name
    must match; `all-linear` matches."""
    names = from_weights([("model.layers.0.self_attn.q_proj.weight", 2)]).names
    assert unmatched(["q_proj", "self_attn.q_proj", "proj", "attn.q_proj"], names) == [
        "proj",
        "attn.q_proj",
    ]
    assert unmatched(r".*\.(q|v)_proj", names) == []
    assert unmatched(r"q_proj", names) == ["q_proj"]  # fullmatch: not the whole name
    assert unmatched("all-linear", names) == []
