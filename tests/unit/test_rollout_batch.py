"""`micro_rollout_batch_size` (rl and collect): the batch a rollout engine generates at once.
It acts on the local engine's batch and on a vLLM server's `--max-num-seqs`; the memory preset
lowers it, with its provenance; a server someone else runs gets no preset value, and a value
set there is said."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from engine.load.load import load_pipeline
from engine.plan.dag import Plan, plan
from engine.resolve.resolve import resolve
from stages.lib.backends.local import LocalBackend
from stages.lib.backends.openai import OpenAIBackend
from stages.lib.backends.rollout_batch import with_rollout_batch
from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.server import server_command
from tests.conftest import stub_checkpoint

PIPELINE = """\
name: p
memory: {memory}
stages:
  local:
    kind: collect
    config:
      input: prompts.jsonl
      backend: {{kind: local, model: m}}
  served:
    kind: collect
    config:
      input: prompts.jsonl
      backend: {{kind: openai, base_url: "http://127.0.0.1:9/v1", model: x}}
  grpo:
    kind: rl
    config: {{model: m, input: prompts.jsonl{rl}}}
"""


def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: str, rl: str = "") -> Plan:
    monkeypatch.chdir(tmp_path)
    stub_checkpoint(tmp_path / "m")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(PIPELINE.format(memory=memory, rl=rl))
    return plan(resolve(load_pipeline("p.yaml"), run_dir="runs/p"))


def test_the_memory_preset_lowers_it_where_pipe_runs_the_engine(tmp_path, monkeypatch):
    p = build(tmp_path, monkeypatch, "memory_constrained")
    stages = p.as_dict()["stages"]
    assert stages["local"]["config"]["micro_rollout_batch_size"] == 16
    assert stages["grpo"]["config"]["micro_rollout_batch_size"] == 16
    assert stages["served"]["config"]["micro_rollout_batch_size"] is None  # its server batches
    src = p.stages["grpo"].resolved.source("micro_rollout_batch_size")
    assert src.label == "memory memory_constrained"
    assert src.reason.startswith("when hitting OOM: reduce --micro_rollout_batch_size")
    # the plan derives the engine's batch from it: what --explain shows is what the run reads
    for name in ("local", "grpo"):
        assert stages[name]["config"]["backend"]["batch_size"] == 16
        batch = p.stages[name].resolved.source("backend.batch_size")
        assert (
            batch.reason == "micro_rollout_batch_size 16: the samples the engine generates at once"
        )
    assert stages["served"]["config"]["backend"].get("batch_size") is None
    assert (
        build(tmp_path, monkeypatch, "default").as_dict()["stages"]["local"]["config"][
            "micro_rollout_batch_size"
        ]
        is None
    )  # the block's own batch


def test_it_becomes_the_local_engines_batch_and_vllms_max_num_seqs():
    from stages.collect import CollectConfig
    from stages.rl import RLConfig

    local = CollectConfig(backend=LocalBackend(kind="local", model="m"), micro_rollout_batch_size=8)
    assert with_rollout_batch(local).backend.batch_size == 8
    rl = RLConfig(model="m", micro_rollout_batch_size=24)
    assert with_rollout_batch(rl).backend.batch_size == 24  # over the rl default of 256
    unset = RLConfig(model="m")
    assert with_rollout_batch(unset) is unset and unset.backend.batch_size == 256
    vllm = CollectConfig(backend=VLLMBackend(kind="vllm", model="m"), micro_rollout_batch_size=32)
    block = with_rollout_batch(vllm).backend
    cmd = server_command(block, python="python", port=1, gpus=1)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32"
    assert "--max-num-seqs" not in server_command(vllm.backend, python="python", port=1, gpus=1)
    served = OpenAIBackend(kind="openai", base_url="http://h/v1", model="x")
    same = CollectConfig(backend=served, micro_rollout_batch_size=8)
    assert with_rollout_batch(same) is same


def test_set_where_a_server_batches_on_its_own_it_is_said(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              served:
                kind: collect
                config:
                  input: prompts.jsonl
                  micro_rollout_batch_size: 8
                  backend: {kind: openai, base_url: "http://127.0.0.1:9/v1", model: x}
            """
        )
    )
    notes = [d.render() for d in resolve(load_pipeline("p.yaml"), run_dir="runs/p").notes]
    assert notes == [
        "p.yaml:7:33: warning: stages.served.config.micro_rollout_batch_size: the 'openai' "
        "backend's server batches what it is sent: this setting acts on the engines pipe runs "
        "(local, vllm); drop it, or tune num_samples_in_parallel"
    ]


def test_rl_settings_json_says_how_it_acted():
    from stages.rl import RLConfig
    from stages.rl.controller.applied import account
    from stages.rl.sync.choice import choose_sync

    sync = choose_sync("gloo", actor_gpu=False, engine_gpu=False, shared_gpu=False)
    saved = ("float32", "auto")
    cfg = with_rollout_batch(RLConfig(model="m", micro_rollout_batch_size=24))
    how = account(cfg, "torch", "cpu", 1, sync, saved=saved)
    assert how["micro_rollout_batch_size"] == (
        "applied",
        "24 samples generated at once (the local engine's batch)",
    )
    unset = account(RLConfig(model="m"), "torch", "cpu", 1, sync, saved=saved)
    assert unset["micro_rollout_batch_size"] == (
        "skipped",
        "empty: the local block's batch_size batches the engine's generation",
    )


def test_set_beside_the_blocks_own_batch_at_another_value_it_is_refused(tmp_path, monkeypatch):
    from tests.conftest import run_cli

    monkeypatch.chdir(tmp_path)
    stub_checkpoint(tmp_path / "m")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n  c:\n    kind: collect\n    config: {input: prompts.jsonl, "
        "micro_rollout_batch_size: 8, backend: {kind: local, model: m, batch_size: 32}}\n"
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:5:62: stages.c.config.micro_rollout_batch_size: the engine generates 8 samples "
        "at once by this setting and 32 by backend.batch_size (p.yaml:5:110): set one of them"
    ]
