"""The rl kind's rules: roles it holds, what it refuses (full messages), presets it takes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from engine.errors import PipeError
from engine.load.load import load_pipeline
from engine.plan.dag import plan
from engine.resolve.resolve import resolve
from stages.rl import RLConfig
from tests.conftest import stub_checkpoint


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    stub_checkpoint(tmp_path / "m")


def build(tmp_path: Path, text: str, *overrides: str):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    return plan(resolve(load_pipeline("p.yaml", overrides), run_dir="runs/p"))


def errors(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(PipeError) as info:
        build(tmp_path, text)
    return [d.render() for d in info.value.diagnostics]


def test_roles_are_the_engines_and_the_actor_and_the_reference_with_kl():
    assert RLConfig.roles_used({}) == ("vllm", "actor")
    assert RLConfig.roles_used({"kl_coef": 0.01}) == ("vllm", "actor", "ref")


def test_async_with_sleeping_engines_is_refused_naming_both_settings_and_sources(tmp_path: Path):
    text = """\
        name: p
        profile: high-performance
        stages:
          rl:
            kind: rl
            config:
              input: prompts.jsonl
              async_train: true
              backend: {kind: vllm}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:8:20: stages.rl.config.async_train: async_train (p.yaml:8:20) cannot run with "
        "vllm_enable_sleep (profile high-performance: hybrid engine: vLLM frees its memory while "
        "training runs): the engines must stay awake to generate while the actor trains; turn "
        "one of them off",
    ]


def test_an_engine_that_cannot_take_weights_or_serves_its_own_model_is_refused(tmp_path: Path):
    text = """\
        name: p
        stages:
          a: {kind: rl, config: {input: p.jsonl, backend: {kind: openai, model: m, base_url: "http://h:1/v1"}}}
          b: {kind: rl, config: {input: p.jsonl, backend: {kind: vllm, model: other}}}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:3:58: stages.a.config.backend.kind: an rl engine takes the actor's weights after "
        "every update, which 'openai' cannot; use 'local' or 'vllm'",
        "p.yaml:4:71: stages.b.config.backend.model: the engine generates with the actor's "
        "weights; leave backend.model empty",
    ]


def test_ppo_holds_a_critic_and_offload_without_zero_is_refused(tmp_path: Path):
    assert RLConfig.roles_used({"algorithm": "ppo"}) == ("vllm", "actor", "critic")
    text = """\
        name: p
        stages:
          rl: {kind: rl, config: {input: prompts.jsonl, algorithm: ppo, adam_offload: true}}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:3:79: stages.rl.config.adam_offload: optimizer offload needs ZeRO: set "
        "zero_stage 1, 2 or 3",
    ]


def test_presets_reach_the_rl_stage(tmp_path: Path):
    text = """\
        name: p
        profile: max-throughput
        memory: memory_constrained
        stages:
          rl: {kind: rl, config: {input: prompts.jsonl}}
    """
    cfg = build(tmp_path, text).as_dict()["stages"]["rl"]["config"]
    assert (
        cfg["async_train"],
        cfg["zero_stage"],
        cfg["adam_offload"],
        cfg["vllm_sync_backend"],
    ) == (
        True,
        3,
        True,
        "nccl",
    )
    assert cfg["micro_train_batch_size"] == 2


def test_a_reward_role_without_a_reward_model_is_refused_where_it_is_named(tmp_path: Path):
    why = (
        "stage 'rl' cannot use role 'reward': it has no reward_model; its rewards come from "
        "'verifier' (reasoning_gym, exact_match, regex, math, or your own 'module:function'): "
        "set reward_model (a checkpoint with a scalar head, or '@stage') to bring the reward "
        "role, or leave 'reward' out"
    )
    in_ratio = """\
        name: p
        cluster: {gpus: 8}
        resources: {ratio: {vllm: 1, actor: 1, reward: 2}}
        stages:
          rl: {kind: rl, config: {input: prompts.jsonl}}
    """
    assert errors(tmp_path, in_ratio) == [f"p.yaml:3:40: resources.ratio.reward: {why}"]
    as_role = """\
        name: p
        cluster: {gpus: auto}
        stages:
          rl: {kind: rl, resources: {role: reward}, config: {input: prompts.jsonl}}
    """
    assert errors(tmp_path, as_role) == [f"p.yaml:4:36: stages.rl.resources.role: {why}"]


def test_a_reward_role_another_stage_uses_is_not_the_rl_stages_concern(tmp_path: Path):
    text = """\
        name: p
        cluster: {gpus: 6}
        resources: {ratio: {vllm: 1, actor: 1, reward: 1}}
        stages:
          rl: {kind: rl, config: {input: prompts.jsonl}}
          score: {kind: evaluate, resources: {role: reward}, config: {input: prompts.jsonl, checkpoints: [m]}}
    """
    roles = build(tmp_path, text).resolved.roles
    assert {r: a.gpus for r, a in roles.items()} == {"vllm": 2, "actor": 2, "reward": 2}


def test_async_with_a_sleeping_trainer_on_gpus_is_refused_and_on_the_cpu_skipped(tmp_path: Path):
    text = """\
        name: p
        profile: high-performance
        cluster: {{gpus: {gpus}, gpus_per_node: 8}}
        stages:
          rl:
            kind: rl
            resources: {{gpus: {gpus}}}
            config:
              input: prompts.jsonl
              async_train: true
    """
    assert errors(tmp_path, text.format(gpus=2)) == [
        "p.yaml:10:20: stages.rl.config.async_train: async_train (p.yaml:10:20) cannot run with "
        "deepspeed_enable_sleep (profile high-performance: hybrid engine: DeepSpeed frees its "
        "memory while generation runs) on GPUs: the actor trains while the engines generate, so "
        "its optimizer states cannot leave the GPU for them (the memory plan would count them "
        "gone); turn one of them off",
    ]
    text = text.replace("resources: {{gpus: {gpus}}}", "resources: {{}}")
    assert build(tmp_path, text.format(gpus=0)).as_dict()["stages"]["rl"]["config"]["async_train"]
