"""The rl stage's reward model at plan time: the `reward` role it brings (in the ratio, or
colocated with the critic), its memory and `--explain` lines, the refusals located in the
file (a checkpoint without a scalar head, a reward role without a reward model, a ratio
that does not divide, settings acting on no reward model), and the reference guide's two
templates placed per node as the guide places them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_cli

POLICY = ROOT / "pipelines/models/sft-7b"  # a causal LM's config.json: no scalar head
TINY = "{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}"
RM = ROOT / "pipelines/models/rm-7b"
PIPELINE = """\
name: p
cluster: {{gpus: {gpus}, gpus_per_node: 8}}
resources: {resources}
stages:
  rl:
    kind: rl
    config:
      input: d.jsonl
      model: {policy}
      algorithm: {algorithm}
      bf16: true
{extra}
"""


def plan(
    tmp_path: Path,
    resources: str,
    extra: str = f"reward_model: {RM}",
    gpus: int = 8,
    algorithm: str = "grpo",
    *args: str,
) -> Any:
    text = PIPELINE.format(
        gpus=gpus,
        resources=resources,
        policy=TINY,
        algorithm=algorithm,
        extra=textwrap.indent(extra, "      "),
    )
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    return run_cli("plan", "p.yaml", "--cluster", "1x8x80GB", *args, cwd=tmp_path)


def placed(result: Any, stage: str = "rl") -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    assert result.exit_code == 0, result.stderr
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for p in json.loads(result.stdout)["placement"][stage]:
        out.setdefault(p["role"], []).append((p["node"], tuple(p["devices"])))
    return out


def test_a_reward_model_brings_a_reward_role_with_its_share_of_the_ratio(tmp_path: Path):
    resources = "{ratio: {vllm: 1, actor: 1, reward: 2}}"
    got = placed(plan(tmp_path, resources, f"reward_model: {RM}", 8, "grpo", "--format", "json"))
    assert got["vllm"] == [("node0", (0, 1))]
    assert got["actor"] == [("node0", (2, 3))]
    assert got["reward"] == [("node0", (4, 5, 6, 7))]


def test_a_ratio_with_reward_that_does_not_divide_is_refused_at_cluster_gpus(tmp_path: Path):
    result = plan(tmp_path, "{ratio: {vllm: 1, actor: 1, reward: 1}}")
    assert result.exit_code == 2
    assert "p.yaml:2:17: cluster.gpus: 8 GPUs do not split vllm:actor:reward = 1:1:1" in (
        result.stderr
    )
    assert "GPU counts that would: 6 or 9" in result.stderr


def test_a_reward_role_without_a_reward_model_is_refused_where_the_ratio_names_it(
    tmp_path: Path,
):
    result = plan(tmp_path, "{ratio: {vllm: 1, actor: 1, reward: 2}}", "verifier: {kind: math}")
    assert result.exit_code == 2
    assert "p.yaml:3:40: resources.ratio.reward: stage 'rl' cannot use role 'reward': " in (
        result.stderr
    )
    assert "set reward_model (a checkpoint with a scalar head, or '@stage')" in result.stderr


def test_a_checkpoint_without_a_scalar_head_is_refused_with_the_fix(tmp_path: Path):
    result = plan(tmp_path, "{colocate: all}", f"reward_model: {POLICY}")
    assert result.exit_code == 2
    line = next(x for x in result.stderr.splitlines() if "config.reward_model" in x)
    assert line.startswith("p.yaml:12:21: stages.rl.config.reward_model: ")
    assert (
        "config.json names no sequence-classification head (architectures ['Qwen2ForCausalLM']"
        in (line)
    )
    assert "as train with algorithm rm writes" in line  # the fix


def test_a_head_of_two_labels_is_refused(tmp_path: Path):
    config = json.loads((RM / "config.json").read_text())
    config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (tmp_path / "rm2").mkdir()
    (tmp_path / "rm2/config.json").write_text(json.dumps(config))
    result = plan(tmp_path, "{colocate: all}", "reward_model: rm2")
    assert result.exit_code == 2
    assert "its head has 2 labels; a reward model scores with one (num_labels 1)" in result.stderr


@pytest.mark.parametrize(
    ("extra", "where", "says"),
    [
        ("normalize_reward: true", "normalize_reward", "acts on a reward model's scores"),
        ("reward_clip: 5.0", "reward_clip", "acts on a reward model's scores"),
        (
            "reward_weights: {verifier: 1.0}",
            "reward_weights.verifier",
            "acts on a reward model's scores",
        ),
        ("verifier: null", "verifier", "nothing scores the samples"),
        (
            f"reward_model: {RM}\nverifier: null\nreward_weights: {{verifier: 0.5}}",
            "reward_weights.verifier",
            "there is no verifier",
        ),
        (
            f"reward_model: {RM}\nverifier: null\neval_input: d.jsonl",
            "eval_input",
            "held-out accuracy is the verifier's",
        ),
    ],
)
def test_scoring_settings_that_would_act_on_nothing_are_refused_where_written(
    tmp_path: Path, extra: str, where: str, says: str
):
    result = plan(tmp_path, "{colocate: all}", extra)
    assert result.exit_code == 2
    line = next(x for x in result.stderr.splitlines() if f"config.{where}:" in x)
    assert line.startswith("p.yaml:1") and says in line  # at the line that sets it


def test_a_reward_role_left_without_gpus_is_refused_at_the_reward_model(tmp_path: Path):
    result = plan(tmp_path, "{ratio: {vllm: 1, actor: 1}}")
    assert result.exit_code == 2
    line = next(x for x in result.stderr.splitlines() if "config.reward_model" in x)
    assert line.startswith("p.yaml:12:21: ")
    assert "the 'reward' role, which has no GPUs" in line and "[[critic, reward]]" in line


def test_colocated_with_the_critic_the_reward_model_shares_its_gpus_and_memory(tmp_path: Path):
    resources = "{ratio: {vllm: 1, actor: 1, critic: 2}, colocate: [[critic, reward]]}"
    result = plan(tmp_path, resources, f"reward_model: {RM}", 8, "ppo", "--format", "json")
    got = placed(result)
    assert got["critic"] == got["reward"] == [("node0", (4, 5, 6, 7))]
    memory = json.loads(result.stdout)["memory"]["rl"]
    # whole on each of its GPUs, in bf16: 2 bytes per parameter of the 7.6B checkpoint
    assert memory["reward"]["parts"]["weights"] == memory["reward"]["gpu_bytes"]
    assert 15.0e9 < memory["reward"]["gpu_bytes"] < 15.5e9
    explained = plan(tmp_path, resources, f"reward_model: {RM}", 8, "ppo", "--explain")
    assert explained.exit_code == 0, explained.stderr
    text = explained.stdout
    assert "  reward   4 GPUs" in text
    assert "    role reward                  devices 4-7\n" in text
    assert "  rl (reward): 15.2 GB (weights 15.2 GB); host 0.0 GB\n" in text


def test_the_guides_hybrid_template_puts_every_role_on_the_one_nodes_eight_gpus():
    result = run_cli(
        "plan",
        "pipelines/openrlhf_hybrid_8gpu.yaml",
        "--cluster",
        "1x8x80GB",
        "--format",
        "json",
        cwd=ROOT,
    )
    got = placed(result, "grpo")
    every = [("node0", tuple(range(8)))]
    assert got == {"vllm": every, "actor": every, "ref": every, "reward": every}
    config = json.loads(result.stdout)["stages"]["grpo"]["config"]
    backend = config["backend"]
    assert (backend["vllm_num_engines"], backend["vllm_tensor_parallel_size"]) == (4, 2)
    assert backend["vllm_gpu_memory_utilization"] == 0.5 and backend["vllm_enable_sleep"]
    assert config["deepspeed_enable_sleep"] and config["packing_samples"]
    assert config["use_dynamic_batch"] and config["vllm_sync_backend"] == "nccl"
    assert config["reward_model"].endswith("models/rm-7b") and config["kl_coef"] > 0


def test_the_guides_distributed_template_gives_each_role_four_gpus_over_two_nodes():
    result = run_cli(
        "plan",
        "pipelines/openrlhf_distributed_16gpu.yaml",
        "--cluster",
        "2x8x80GB",
        "--format",
        "json",
        cwd=ROOT,
    )
    got = placed(result, "ppo")
    assert got == {
        "vllm": [("node0", (0, 1, 2, 3))],
        "actor": [("node0", (4, 5, 6, 7))],
        "ref": [("node0", (4, 5, 6, 7))],  # --colocate_actor_ref: 16 GPUs, not 20
        "critic": [("node1", (0, 1, 2, 3))],
        "reward": [("node1", (4, 5, 6, 7))],
    }
    backend = json.loads(result.stdout)["stages"]["ppo"]["config"]["backend"]
    assert (backend["vllm_num_engines"], backend["vllm_tensor_parallel_size"]) == (2, 2)


def test_the_reward_role_named_on_a_stage_with_a_reward_model_is_its_own(tmp_path: Path):
    """`resources.role: reward` is refused for want of a reward model, not where one is set."""
    text = f"""\
name: p
cluster: {{gpus: 6, gpus_per_node: 8}}
stages:
  rl:
    kind: rl
    resources: {{role: reward}}
    config: {{input: d.jsonl, model: {TINY}, bf16: true, reward_model: {RM}}}
"""
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    result = run_cli("plan", "p.yaml", "--cluster", "1x8x80GB", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "cannot use role" not in result.stderr
    roles = json.loads(result.stdout)["roles"]
    assert {r: a["gpus"] for r, a in roles.items()} == {"vllm": 2, "actor": 2, "reward": 2}
    without = text.replace(f", reward_model: {RM}", "")
    (tmp_path / "p.yaml").write_text(without)
    refused = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert refused.exit_code == 2
    assert "p.yaml:6:23: stages.rl.resources.role: stage 'rl' cannot use role 'reward': it " in (
        refused.stderr
    )
