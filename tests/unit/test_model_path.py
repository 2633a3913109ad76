"""`model:` is checked at validate: a local folder holding config.json, or an earlier stage's
output; a typo is a located error before anything runs. A hub id (`org/name`) passes validate,
which asks no hub; `pipe plan` pins it (tests/unit/test_hub.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli


def _write(tmp_path: Path, stages: str) -> Path:
    text = "name: p\nstages:\n" + textwrap.indent(textwrap.dedent(stages), "  ")
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "empty").mkdir(exist_ok=True)
    return tmp_path / "p.yaml"


def _validate(tmp_path: Path, stages: str) -> tuple[int, list[str]]:
    _write(tmp_path, stages)
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    return result.exit_code, result.stderr.strip().splitlines()


TRAIN = """\
train:
  kind: train
  config: {{input: prompts.jsonl, model: {model}}}
"""


def test_a_model_folder_that_does_not_exist_is_refused_at_validate_not_nine_seconds_into_run(
    tmp_path: Path,
):
    code, lines = _validate(tmp_path, TRAIN.format(model="ckpts/warmpu/final"))
    assert code == 2
    assert lines == [
        "p.yaml:5:43: stages.train.config.model: no checkpoint folder 'ckpts/warmpu/final' "
        "(relative to the pipeline's folder)"
    ]


def test_a_path_that_reads_as_a_hub_id_is_left_to_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`ckpts/warmpu` may be a repository `warmpu` of an account `ckpts`: validate asks no hub,
    and `pipe plan` says the hub knows no such model, nor is there such a folder."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, lines = _validate(tmp_path, TRAIN.format(model="ckpts/warmpu"))
    assert (code, lines) == (0, [])


def test_an_absolute_path_that_does_not_exist_is_refused_without_the_hub_hint(tmp_path: Path):
    code, lines = _validate(tmp_path, TRAIN.format(model="/nowhere/ckpt"))
    assert code == 2
    assert lines == ["p.yaml:5:43: stages.train.config.model: no checkpoint folder '/nowhere/ckpt'"]


def test_a_folder_without_config_json_is_refused(tmp_path: Path):
    code, lines = _validate(tmp_path, TRAIN.format(model="empty"))
    assert code == 2
    assert lines == [
        f"p.yaml:5:43: stages.train.config.model: '{tmp_path}/empty' holds no config.json: "
        "not a Hugging Face checkpoint folder"
    ]


def test_a_checkpoint_folder_a_tiny_spec_and_an_upstream_output_pass(tmp_path: Path):
    stages = """\
    sft:
      kind: train
      config: {input: prompts.jsonl, model: ckpt}
    tiny:
      kind: train
      config: {input: prompts.jsonl, model: {hidden_size: 32, num_heads: 4}}
    rl:
      kind: rl
      needs: [sft]
      config: {input: prompts.jsonl, model: "@sft"}
    evaluate:
      kind: evaluate
      needs: [sft, tiny]
      config: {input: prompts.jsonl}
    """
    code, lines = _validate(tmp_path, stages)
    assert (code, lines) == (0, [])


@pytest.mark.parametrize(
    "backend",
    [
        "{kind: local, model: Qwen/Qwen2.5-0.5B-Instruct}",
        "{kind: vllm, model: Qwen/Qwen2.5-0.5B-Instruct@main}",
        # an openai backend names the model its server serves, not a folder
        "{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: Qwen/Qwen2.5-0.5B-Instruct}",
    ],
)
def test_a_hub_id_in_a_collect_backend_passes_validate(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    stages = f"""\
    collect:
      kind: collect
      config: {{input: prompts.jsonl, backend: {backend}}}
    """
    assert _validate(tmp_path, stages) == (0, [])


def test_an_evaluate_checkpoint_that_does_not_exist_is_refused(tmp_path: Path):
    stages = """\
    evaluate:
      kind: evaluate
      config: {input: prompts.jsonl, checkpoints: [ckpt, ckpt-old]}
    """
    code, lines = _validate(tmp_path, stages)
    assert code == 2
    assert lines == [
        "p.yaml:5:49: stages.evaluate.config.checkpoints: no checkpoint folder 'ckpt-old' "
        "(relative to the pipeline's folder)"
    ]
