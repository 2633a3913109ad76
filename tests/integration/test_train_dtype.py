"""The train stage from each family's checkpoint (bfloat16, like the releases) writes its
output in bfloat16 with the input's config (issue 37: it came out fp32, twice the size, with
`use_cache: false`), whatever precision it trained in; `save_dtype: float32` writes fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.train.run import run_train
from tests.families import FAMILIES
from tests.integration.test_train import additions, config, context

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", FAMILIES)
def test_train_does_not_save_a_bf16_release_as_fp32(family_checkpoint, family, tmp_path: Path):
    from safetensors.torch import load_file

    src = family_checkpoint(family)
    data = additions(tmp_path / "data.jsonl", 8)
    stage = tmp_path / "train"
    # fp32 training (the torch trainer's weights) on a bf16 release; gemma: bf16 autocast too
    cfg = config(
        data,
        stage,
        model=str(src),
        max_steps=1,
        train_batch_size=8,
        micro_train_batch_size=8,
        trainer="torch",
        bf16=family == "gemma",
    )
    metrics = run_train(cfg, context(stage))
    assert (metrics["save_dtype"], metrics["save_dtype_from"]) == (
        "bfloat16",
        f"auto: the input checkpoint's dtype ({src})",
    )
    out = stage / "checkpoint"
    saved = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    before = json.loads((src / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == before
    assert before["use_cache"] is True
    gen = "generation_config.json"
    assert (out / gen).read_bytes() == (src / gen).read_bytes()


def test_train_with_save_dtype_float32_writes_fp32(family_checkpoint, tmp_path: Path):
    from safetensors.torch import load_file

    src = family_checkpoint("llama3")
    data = additions(tmp_path / "data.jsonl", 8)
    stage = tmp_path / "train"
    cfg = config(
        data,
        stage,
        model=str(src),
        max_steps=1,
        train_batch_size=8,
        micro_train_batch_size=8,
        trainer="torch",
        save_dtype="float32",
    )
    metrics = run_train(cfg, context(stage))
    assert (metrics["save_dtype"], metrics["save_dtype_from"]) == ("float32", "save_dtype")
    saved = load_file(str(stage / "checkpoint" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    config_out = json.loads((stage / "checkpoint" / "config.json").read_text())
    assert config_out == {**json.loads((src / "config.json").read_text()), "dtype": "float32"}
