"""LoRA in the train stage for real: adapters alone train (DeepSpeed and plain torch), the
output is an ordinary merged checkpoint, or peft's adapter files with `lora.save: adapter`;
DPO scores its reference with the adapters off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")

from stages.train.run import run_train
from tests.integration.test_train import additions, config, context

pytestmark = pytest.mark.integration


def weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def train(tmp_path: Path, steps: int = 4, **settings: Any) -> tuple[Path, dict[str, Any]]:
    data = additions(tmp_path / "data.jsonl", 64)
    stage = tmp_path / "train"
    lora = {"rank": 4, **settings.pop("lora", {})}
    cfg = config(data, stage, max_steps=steps, lora=lora, **settings)
    return stage, run_train(cfg, context(stage))


@pytest.mark.parametrize("trainer", ["deepspeed", "torch"])
def test_lora_trains_the_adapters_only_and_writes_a_merged_checkpoint(tmp_path: Path, trainer: str):
    import torch
    from transformers import AutoModelForCausalLM

    if trainer == "deepspeed":
        pytest.importorskip("deepspeed")
    stage, metrics = train(tmp_path, trainer=trainer, learning_rate=1e-2)
    assert metrics["steps"] == 4
    base, merged = weights(stage / "init_model"), weights(stage / "checkpoint")
    assert sorted(base) == sorted(merged)  # an ordinary checkpoint: no adapter names
    changed = sorted(k for k in base if not torch.equal(base[k], merged[k]))
    # all-linear: every projection of both layers took its adapter in; the embedding
    # (tied output head) and the norms did not train
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed == sorted(
        f"model.layers.{i}.{part}.{p}.weight"
        for i in range(2)
        for p in projections
        for part in (["self_attn"] if p in projections[:4] else ["mlp"])
    )
    model = AutoModelForCausalLM.from_pretrained(stage / "checkpoint")  # loads as it is
    assert model.config.vocab_size == 300
    # the resumable checkpoint holds the adapters, not the frozen base
    saved = next((stage / "checkpoints").glob("step_*"))
    if trainer == "deepspeed":
        module = torch.load(saved / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    else:
        module = torch.load(saved / "torch_state.pt", weights_only=False)["model"]
    adapters = [k for k in module if ".lora_" in k]
    assert len(adapters) == 28  # A and B of 14 modules; of the rest only buffers (inv_freq)
    assert not [k for k in module if k not in adapters and k.endswith(".weight")]


def test_lora_save_adapter_writes_peft_files_that_load_onto_the_base(tmp_path: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stage, _ = train(tmp_path, trainer="torch", learning_rate=1e-2, lora={"save": "adapter"})
    out = stage / "checkpoint"
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert config["base_model_name_or_path"] == str(stage / "init_model")
    base = AutoModelForCausalLM.from_pretrained(stage / "init_model")
    ids = torch.tensor([[1, 2, 3, 4]])
    before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, str(out))
    assert not torch.allclose(tuned(ids).logits, before)


def test_lora_dpo_scores_its_reference_with_the_adapters_off(tmp_path: Path):
    rows = []
    for i in range(16):
        prompt = f"{10 + i} + {20 + i} ="
        rows += [
            {"prompt": prompt, "completion": str(30 + 2 * i), "reward": 1.0},
            {"prompt": prompt, "completion": "0", "reward": 0.0},
        ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = tmp_path / "train"
    cfg = config(
        data,
        stage,
        algorithm="dpo",
        target="completion",
        max_steps=3,
        train_batch_size=8,
        micro_train_batch_size=8,
        lora={"rank": 4},
        trainer="torch",
    )
    run_train(cfg, context(stage))
    log = [json.loads(line) for line in (stage / "loss.jsonl").read_text().splitlines()]
    # the first step's policy is the reference (B = 0): loss log(2), margin 0
    assert abs(log[0]["loss"] - 0.6931) < 1e-3 and abs(log[0]["margin"]) < 1e-6
    assert log[-1]["margin"] > 0
