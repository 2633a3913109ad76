"""Resolve: presets, conflicts, provenance, GPU roles and the arithmetic checks."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.errors import PipeError
from engine.load.load import load_pipeline
from engine.plan.dag import Plan, plan
from engine.resolve.resolve import resolve
from tests.conftest import stub_checkpoint


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for folder in ("m", "m1", "models/m1"):
        stub_checkpoint(tmp_path / folder)


def build(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> Plan:
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    return plan(resolve(load_pipeline("p.yaml", overrides), run_dir="runs/p"))


def errors(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(PipeError) as info:
        build(tmp_path, text)
    return [d.render() for d in info.value.diagnostics]


TRAIN_VLLM = """\
    name: p
    profile: {profile}
    memory: {memory}
    cluster: {{scheduler: local, gpus: {gpus}, gpus_per_node: 8}}
    resources:
      ratio: {{vllm: 1, actor: 1, critic: 1}}
    stages:
      collect:
        kind: collect
        resources: {{role: vllm}}
        config:
          input: prompts.jsonl
          num_repeats: 4
          backend: {{kind: vllm, model: models/m1, vllm_tensor_parallel_size: 2}}
      train:
        kind: train
        needs: [collect]
        resources: {{role: actor}}
        config: {{model: models/m1, micro_train_batch_size: 2, train_batch_size: 64}}
      value:
        kind: train
        needs: [collect]
        resources: {{role: critic}}
        config: {{model: models/m1, micro_train_batch_size: 2}}
"""


def cfg(p: Plan, stage: str) -> dict[str, Any]:
    return p.as_dict()["stages"][stage]["config"]


def test_48_gpus_at_1_1_1_split_16_each(tmp_path: Path):
    p = build(tmp_path, TRAIN_VLLM.format(profile="default", memory="default", gpus=48))
    assert p.as_dict()["roles"] == {
        "vllm": {"gpus": 16, "colocated_with": []},
        "actor": {"gpus": 16, "colocated_with": []},
        "critic": {"gpus": 16, "colocated_with": []},
    }
    assert p.as_dict()["stages"]["collect"]["resources"] == {"role": "vllm", "gpus": 16}
    assert cfg(p, "collect")["backend"]["vllm_num_engines"] == 8  # 16 GPUs / tensor-parallel 2


def test_high_performance_on_8_gpus_colocates_everything(tmp_path: Path):
    p = build(tmp_path, TRAIN_VLLM.format(profile="high-performance", memory="default", gpus=8))
    roles = p.as_dict()["roles"]
    assert roles["vllm"] == {"gpus": 8, "colocated_with": ["actor", "critic"]}
    assert roles["actor"] == {"gpus": 8, "colocated_with": ["vllm", "critic"]}
    assert roles["critic"] == {"gpus": 8, "colocated_with": ["vllm", "actor"]}
    backend = cfg(p, "collect")["backend"]
    assert backend["vllm_gpu_memory_utilization"] == 0.5
    assert backend["vllm_enable_sleep"] is True
    assert backend["vllm_num_engines"] == 4
    train = cfg(p, "train")
    assert train["deepspeed_enable_sleep"] is True
    assert train["overlap_comm"] is True
    assert train["packing_samples"] is True


def test_memory_constrained_settings_and_no_colocation(tmp_path: Path):
    p = build(
        tmp_path,
        TRAIN_VLLM.format(profile="high-performance", memory="memory_constrained", gpus=48),
    )
    train = cfg(p, "train")
    assert (
        train["zero_stage"],
        train["adam_offload"],
        train["gradient_checkpointing"],
        train["packing_samples"],
    ) == (
        3,
        True,
        True,
        True,
    )
    assert train["overlap_comm"] is False
    assert p.resolved.colocate == "none"
    assert all(r["colocated_with"] == [] for r in p.as_dict()["roles"].values())
    notes = [d.render() for d in p.resolved.notes]
    assert notes == [
        "p.yaml:3:9: warning: resources.colocate: memory preset 'memory_constrained' sets 'none' "
        "over profile "
        "'high-performance''s 'all' (when hitting OOM: disable all --colocate_* options)",
        "p.yaml:3:9: warning: stages.train.config.overlap_comm: memory preset "
        "'memory_constrained' sets false over "
        "profile 'high-performance''s true (when hitting OOM: disable --overlap_comm (its buckets "
        "take memory))",
        "p.yaml:3:9: warning: stages.value.config.overlap_comm: memory preset "
        "'memory_constrained' sets false over "
        "profile 'high-performance''s true (when hitting OOM: disable --overlap_comm (its buckets "
        "take memory))",
    ]


def test_max_throughput_settings_with_caution(tmp_path: Path):
    p = build(tmp_path, TRAIN_VLLM.format(profile="max-throughput", memory="default", gpus=48))
    train = cfg(p, "train")
    assert (train["async_train"], train["use_dynamic_batch"], train["packing_samples"]) == (
        True,
        True,
        True,
    )
    assert [d.render() for d in p.resolved.notes] == [
        "p.yaml:2:10: warning: profile: async_train and use_dynamic_batch may affect training "
        "stability; "
        "validate convergence first"
    ]


def test_prefix_caching_when_repeats_above_one(tmp_path: Path):
    p = build(tmp_path, TRAIN_VLLM.format(profile="default", memory="default", gpus=48))
    assert cfg(p, "collect")["backend"]["enable_prefix_caching"] is True
    one = build(
        tmp_path,
        TRAIN_VLLM.format(profile="default", memory="default", gpus=48),
        ("stages.collect.config.num_repeats=1",),
    )
    assert cfg(one, "collect")["backend"]["enable_prefix_caching"] is False


def test_user_zero_stage_wins_over_memory_preset_with_a_note(tmp_path: Path):
    text = TRAIN_VLLM.format(profile="default", memory="memory_constrained", gpus=48).replace(
        "train_batch_size: 64}", "train_batch_size: 64, zero_stage: 2}"
    )
    p = build(tmp_path, text)
    assert cfg(p, "train")["zero_stage"] == 2
    assert p.stages["train"].resolved.source("zero_stage").render() == "p.yaml:19:93"
    assert [d.render() for d in p.resolved.notes] == [
        "p.yaml:19:93: note: stages.train.config.zero_stage: 2 overrides memory preset "
        "'memory_constrained''s 3 "
        "(when hitting OOM: increase --zero_stage (2 -> 3) to shard parameters too)"
    ]


def test_provenance_of_preset_values(tmp_path: Path):
    p = build(tmp_path, TRAIN_VLLM.format(profile="high-performance", memory="default", gpus=8))
    src = p.stages["collect"].resolved.source("backend.vllm_enable_sleep")
    assert src.label == "profile high-performance"
    assert src.reason == "hybrid engine: vLLM frees its memory while training runs"
    assert p.stages["train"].resolved.source("micro_train_batch_size").render() == "p.yaml:19:56"
    assert p.stages["train"].resolved.source("learning_rate").render() == "kind default"


def test_10_gpus_at_1_1_1_is_a_located_error_with_suggestions(tmp_path: Path):
    assert errors(tmp_path, TRAIN_VLLM.format(profile="default", memory="default", gpus=10)) == [
        "p.yaml:4:35: cluster.gpus: 10 GPUs do not split vllm:actor:critic = 1:1:1 into whole "
        "GPUs per role; "
        "GPU counts that would: 9 or 12 (a multiple of 3)"
    ]


def test_tensor_parallel_4_on_2_gpu_nodes_is_a_located_error(tmp_path: Path):
    text = (
        TRAIN_VLLM.format(profile="default", memory="default", gpus=6)
        .replace("gpus_per_node: 8", "gpus_per_node: 2")
        .replace("vllm_tensor_parallel_size: 2", "vllm_tensor_parallel_size: 4")
    )
    assert errors(tmp_path, text) == [
        "p.yaml:14:74: stages.collect.config.backend.vllm_tensor_parallel_size: tensor-parallel "
        "size 4 does not "
        "fit on a node of 2 GPUs (cluster.gpus_per_node); a tensor-parallel group never spans "
        "nodes: use 1, 2"
    ]


def test_engines_times_tp_must_equal_role_gpus(tmp_path: Path):
    text = TRAIN_VLLM.format(profile="default", memory="default", gpus=48).replace(
        "vllm_tensor_parallel_size: 2}", "vllm_tensor_parallel_size: 2, vllm_num_engines: 4}"
    )
    assert errors(tmp_path, text) == [
        "p.yaml:14:95: stages.collect.config.backend.vllm_num_engines: 4 engines x "
        "tensor-parallel size 2 = 8 GPUs, "
        "but role 'vllm' has 16; use vllm_num_engines 8"
    ]


def test_batch_must_divide_by_micro_times_data_parallel(tmp_path: Path):
    text = TRAIN_VLLM.format(profile="default", memory="default", gpus=48).replace(
        "micro_train_batch_size: 2, train_batch_size: 64",
        "micro_train_batch_size: 3, train_batch_size: 64",
    )
    assert errors(tmp_path, text) == [
        "p.yaml:19:77: stages.train.config.train_batch_size: 64 is not divisible by "
        "micro_train_batch_size 3 x "
        "16 data-parallel rank(s) = 48; use 48 or 96"
    ]


def test_stage_gpus_beyond_cluster(tmp_path: Path):
    text = """\
        name: p
        cluster: {gpus: 4}
        resources: {ratio: {actor: 1}}
        stages:
          t: {kind: train, resources: {gpus: 8}, config: {input: x.jsonl, micro_train_batch_size: 1, train_batch_size: 8}}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:5:31: stages.t.resources: asks for 8 GPUs; the cluster has 4 (cluster.gpus)"
    ]


def test_colocation_groups_split_as_units(tmp_path: Path):
    text = """\
        name: p
        cluster: {gpus: 24}
        resources:
          ratio: {vllm: 1, actor: 1, critic: 1, ref: 1, reward: 1}
          colocate: [[actor, ref], [critic, reward]]
        stages:
          a: {kind: filter, resources: {role: vllm}, config: {input: x.jsonl}}
          b: {kind: filter, resources: {role: actor}, config: {input: x.jsonl}}
          c: {kind: filter, resources: {role: ref}, config: {input: x.jsonl}}
          d: {kind: filter, resources: {role: critic}, config: {input: x.jsonl}}
          e: {kind: filter, resources: {role: reward}, config: {input: x.jsonl}}
    """
    roles = build(tmp_path, text).as_dict()["roles"]
    assert roles == {
        "vllm": {"gpus": 8, "colocated_with": []},
        "actor": {"gpus": 8, "colocated_with": ["ref"]},
        "ref": {"gpus": 8, "colocated_with": ["actor"]},
        "critic": {"gpus": 8, "colocated_with": ["reward"]},
        "reward": {"gpus": 8, "colocated_with": ["critic"]},
    }


def test_one_actor_stage_on_8_gpus_gets_all_8(tmp_path: Path):
    text = """\
        name: p
        cluster: {gpus: 8}
        stages:
          t: {kind: train, resources: {role: actor}, config: {input: d.jsonl, model: m1, micro_train_batch_size: 8}}
    """
    p = build(tmp_path, text)
    assert p.as_dict()["roles"] == {"actor": {"gpus": 8, "colocated_with": []}}
    assert p.as_dict()["stages"]["t"]["resources"] == {"role": "actor", "gpus": 8}
    assert p.resolved.notes == []


def test_a_ratio_role_no_stage_uses_gets_no_gpus_and_a_warning(tmp_path: Path):
    text = """\
        name: p
        cluster: {gpus: 8}
        resources:
          ratio: {vllm: 1, actor: 1, critic: 1}
        stages:
          t: {kind: train, resources: {role: actor}, config: {input: d.jsonl, model: m1, micro_train_batch_size: 8}}
    """
    p = build(tmp_path, text)
    assert p.as_dict()["roles"] == {"actor": {"gpus": 8, "colocated_with": []}}
    assert [d.render() for d in p.resolved.notes] == [
        "p.yaml:4:11: warning: resources.ratio.vllm: no stage uses role 'vllm'; it gets no GPUs",
        "p.yaml:4:30: warning: resources.ratio.critic: no stage uses role 'critic'; it gets no "
        "GPUs",
    ]


def test_references_and_paths(tmp_path: Path):
    text = """\
        name: p
        stages:
          data: {kind: dataset, config: {task: chain_sum}}
          t: {kind: train, needs: [data], config: {model: {hidden_size: 32}}}
          e: {kind: evaluate, needs: [data, t], config: {input: "@data.test_output"}}
    """
    p = build(tmp_path, text)
    assert cfg(p, "t")["input"] == "runs/p/data/train.jsonl"
    assert cfg(p, "e")["input"] == "runs/p/data/test.jsonl"
    assert cfg(p, "e")["checkpoints"] == ["runs/p/t/checkpoint"]
    assert cfg(p, "e")["output"] == "runs/p/e/report.json"


def test_bad_references(tmp_path: Path):
    text = """\
        name: p
        stages:
          data: {kind: dataset, config: {task: chain_sum}}
          t: {kind: train, needs: [data], config: {input: "@dat"}}
          u: {kind: train, config: {input: "@data"}}
          e: {kind: evaluate, needs: [data], config: {input: "@data.test", checkpoints: [m]}}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:4:51: stages.t.config.input: '@dat' refers to no stage named 'dat'; did you mean "
        "'data'?",
        "p.yaml:5:36: stages.u.config.input: '@data' refers to stage 'data', which stage 'u' does "
        "not need; add it to needs",
        "p.yaml:6:54: stages.e.config.input: stage 'data' (dataset) has no output 'test'; its "
        "outputs: 'output', 'test_output' or 'val_output'",
    ]


def test_adam_offload_needs_zero(tmp_path: Path):
    text = """\
        name: p
        stages:
          t: {kind: train, config: {input: x.jsonl, adam_offload: true}}
    """
    assert errors(tmp_path, text) == [
        "p.yaml:3:59: stages.t.config.adam_offload: optimizer offload needs ZeRO: set zero_stage "
        "1, 2 or 3"
    ]


def test_user_preset_folder_beside_pipeline(tmp_path: Path):
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny.memory.yaml").write_text(
        "kind: memory\nname: tiny\nsettings:\n  micro_train_batch_size: {value: 1, reason: "
        "laptop}\n"
    )
    text = """\
        name: p
        memory: tiny
        stages:
          t: {kind: train, config: {input: x.jsonl}}
    """
    p = build(tmp_path, text)
    assert cfg(p, "t")["micro_train_batch_size"] == 1
    assert p.stages["t"].resolved.source("micro_train_batch_size").render() == "memory tiny: laptop"


def test_invalid_user_preset_is_a_located_error(tmp_path: Path):
    (tmp_path / "presets").mkdir()
    bad = tmp_path / "presets" / "bad.memory.yaml"
    bad.write_text("kind: memory\nname: bad\nsettings:\n  zero_stage: {value: 3}\n")
    with pytest.raises(PipeError) as info:
        build(
            tmp_path,
            "name: p\nmemory: bad\nstages:\n  t: {kind: train, config: {input: x.jsonl}}\n",
        )
    assert info.value.render().endswith(
        "bad.memory.yaml:4:3: settings.zero_stage: missing required field 'reason'"
    )


def test_preset_value_of_wrong_type_points_at_the_preset(tmp_path: Path):
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "odd.profile.yaml").write_text(
        "kind: profile\nname: odd\nsettings:\n  zero_stage: {value: nine, reason: oops}\n"
    )
    with pytest.raises(PipeError) as info:
        build(
            tmp_path,
            "name: p\nprofile: odd\nstages:\n  t: {kind: train, config: {input: x.jsonl}}\n",
        )
    assert info.value.render().endswith(
        "odd.profile.yaml:4:23: zero_stage: expected an integer, found 'nine'"
    )
