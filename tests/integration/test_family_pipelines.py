"""The quickstart's shape on each real family (pipelines/family_*.yaml): every stage runs, and
every checkpoint a stage writes keeps the family's tokenizer, chat template, eos and dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = ("chatml", "llama3", "gemma", "mistral")
# what a checkpoint must carry through every stage unchanged
KEPT_CONFIG = ("architectures", "model_type", "eos_token_id", "bos_token_id", "pad_token_id")
KEPT_TOKENIZER = ("eos_token", "bos_token", "pad_token", "chat_template", "added_tokens_decoder")


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _dtype(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype"))


def _tokenizer(folder: Path) -> dict:
    data = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    if "chat_template" not in data and template.exists():
        data["chat_template"] = template.read_text()
    return {k: data.get(k) for k in KEPT_TOKENIZER}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_runs_and_keeps_the_familys_tokenizer_template_eos_and_dtype(
    tmp_path: Path, family: str
):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    pipeline = f"pipelines/family_{family}.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", pipeline, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert {n: s["status"] for n, s in report["stages"].items()} == dict.fromkeys(
        ("data", "sft", "collect", "filter", "rft", "grpo", "evaluate"), "succeeded"
    )
    built = run_dir / "sft" / "init_model"  # the family's checkpoint, as a release brings it
    release, tokenizer = _config(built), _tokenizer(built)
    assert _dtype(release) == "bfloat16"
    assert release["architectures"] == [
        {
            "chatml": "Qwen2ForCausalLM",
            "llama3": "LlamaForCausalLM",
            "gemma": "Gemma2ForCausalLM",
            "mistral": "MistralForCausalLM",
        }[family]
    ]
    generation = json.loads((built / "generation_config.json").read_text())
    for stage in ("sft", "rft", "grpo"):
        out = run_dir / stage / "checkpoint"
        config = _config(out)
        assert {k: config.get(k) for k in KEPT_CONFIG} == {
            k: release.get(k) for k in KEPT_CONFIG
        }, stage
        assert _dtype(config) == "bfloat16", stage
        assert config.get("use_cache", True) == release.get("use_cache", True), stage
        assert _tokenizer(out) == tokenizer, stage
        assert json.loads((out / "generation_config.json").read_text()) == generation, stage
    results = json.loads((run_dir / "evaluate" / "report.json").read_text())["results"]
    assert [r["n"] for r in results] == [16, 16]
