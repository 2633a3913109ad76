"""The rl stage's reference policy: where it loads (its own ranks, or inside the actor's),
what the memory model counts for it there, and that it loads in the compute dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.plan.memory import read_shape
from engine.stage import Slot
from stages.rl.roles.frozen import in_actor
from tests.conftest import run_cli
from tests.unit.test_memory import LLAMA

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300}
PIPELINE = """\
name: p
cluster: {{gpus: 6, gpus_per_node: 2}}
resources: {resources}
stages:
  rl:
    kind: rl
    config: {{input: d.jsonl, model: {model}, kl_coef: 0.05, bf16: {bf16}, zero_stage: {zero}}}
"""


def planned(tmp_path: Path, resources: str, bf16: bool = True, zero: int = 0) -> dict[str, Any]:
    text = PIPELINE.format(
        resources=resources, model=json.dumps(TINY), bf16=str(bf16).lower(), zero=zero
    )
    (tmp_path / "p.yaml").write_text(text)
    out = run_cli("plan", "p.yaml", "--cluster", "3x2x80GB", "--format", "json", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    return dict(json.loads(out.stdout))


def devices(plan: dict[str, Any], role: str) -> list[tuple[str, int]]:
    return [
        (p["node"], d) for p in plan["placement"]["rl"] if p["role"] == role for d in p["devices"]
    ]


def test_the_reference_on_its_own_devices_holds_its_weights_in_bf16_there(tmp_path: Path):
    params = read_shape(TINY).params  # type: ignore[union-attr]
    plan = planned(tmp_path, "{ratio: {vllm: 1, actor: 1, ref: 1}}")
    assert devices(plan, "ref") == [("node2", 0), ("node2", 1)]
    assert set(devices(plan, "ref")).isdisjoint(devices(plan, "actor"))
    ref = plan["memory"]["rl"]["ref"]
    assert "inside" not in ref
    assert ref["gpu_bytes"] == ref["parts"]["weights"] == 2 * params
    fp32 = planned(tmp_path, "{ratio: {vllm: 1, actor: 1, ref: 1}}", bf16=False)
    assert fp32["memory"]["rl"]["ref"]["gpu_bytes"] == 4 * params


def test_under_zero3_the_reference_is_split_over_its_ranks(tmp_path: Path):
    shape = read_shape(TINY)
    assert shape is not None
    plan = planned(tmp_path, "{ratio: {vllm: 1, actor: 1, ref: 1}}", zero=3)
    split = 2 * shape.params // 2 + 4 * shape.largest_layer_params  # 2 ranks, gather buffer
    assert plan["memory"]["rl"]["ref"]["gpu_bytes"] == split


def test_a_reference_left_out_of_the_ratio_is_counted_inside_the_actors_ranks(tmp_path: Path):
    plan = planned(tmp_path, "{ratio: {vllm: 1, actor: 2}}")
    assert devices(plan, "ref") == []
    ref, actor = plan["memory"]["rl"]["ref"], plan["memory"]["rl"]["actor"]
    assert ref["inside"] == "actor"
    assert ref["gpu_bytes"] == 2 * read_shape(TINY).params  # type: ignore[union-attr]
    assert actor["gpu_bytes"] + ref["gpu_bytes"] > actor["gpu_bytes"]


def test_the_explain_output_names_where_the_reference_loads_and_its_bytes(tmp_path: Path):
    (tmp_path / "llama70b").mkdir()
    (tmp_path / "llama70b" / "config.json").write_text(json.dumps(LLAMA["70B"]))
    text = """\
name: p
cluster: {gpus: 48, gpus_per_node: 8}
resources: {ratio: {vllm: 1, actor: 1, ref: 1}}
stages:
  rl:
    kind: rl
    config: {input: d.jsonl, model: llama70b, kl_coef: 0.05, bf16: true, zero_stage: 3,
             adam_offload: true, micro_train_batch_size: 1, train_batch_size: 16,
             max_length: 1024, gradient_checkpointing: true, backend: {kind: vllm}}
"""
    (tmp_path / "p.yaml").write_text(text)
    out = run_cli("plan", "p.yaml", "--cluster", "6x8x80GB", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    placed = [line.strip() for line in out.stdout.splitlines() if line.startswith("    rl (ref)")]
    assert placed == ["rl (ref)                     devices 0-7"] * 2  # nodes 4 and 5
    shape = read_shape(str(tmp_path / "llama70b"))
    assert shape is not None
    ref = 2 * shape.params // 16 + 4 * shape.largest_layer_params
    line = f"  rl (ref): {ref / 1e9:.1f} GB (weights {ref / 1e9:.1f} GB); host 0.0 GB"
    assert line in out.stdout.splitlines()
    colocated = text.replace("ref: 1}}", "ref: 1}, colocate: [[actor, ref]]}")
    (tmp_path / "p.yaml").write_text(
        colocated.replace("ratio: {vllm: 1, actor: 1, ", "ratio: {vllm: 1, actor: 2, ")
    )
    out = run_cli("plan", "p.yaml", "--cluster", "6x8x80GB", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    assert "  actor    32 GPUs (shared with ref)" in out.stdout.splitlines()


def slots(**roles: tuple[str, tuple[int, ...]]) -> tuple[Slot, ...]:
    return tuple(Slot(worker, worker, devs, role) for role, (worker, devs) in roles.items())


def test_the_reference_loads_in_the_actor_unless_its_role_holds_devices_of_its_own():
    assert in_actor(())  # a CPU stage
    assert in_actor(slots(vllm=("w0", (0,)), actor=("w1", (0,))))  # ref left out of the ratio
    assert in_actor(slots(actor=("w1", (0, 1)), ref=("w1", (0, 1))))  # colocated
    assert not in_actor(slots(actor=("w1", (0,)), ref=("w2", (0,))))  # its own worker
    assert not in_actor(slots(actor=("w1", (0,)), ref=("w1", (1,))))  # its own device
    assert not in_actor(slots(vllm=("w0", (0,)), actor=("w1", (0,)), ref=("w0", (0,))))


@pytest.mark.parametrize("bf16", [True, False])
def test_the_reference_loads_frozen_in_the_compute_dtype(tmp_path: Path, bf16: bool):
    import torch

    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from stages.rl.roles.frozen import load_reference

    build_tiny_model(TinyModel(**TINY), ["1 + 2 = 3"] * 20, str(tmp_path / "m"), seed=0)
    module, engine = load_reference(str(tmp_path / "m"), bf16, None, "cpu")
    dtypes = {p.dtype for p in module.parameters()}
    assert dtypes == {torch.bfloat16 if bf16 else torch.float32}
    assert engine is None and not module.training
    assert not any(p.requires_grad for p in module.parameters())


@pytest.mark.gpu
def test_on_a_gpu_the_reference_loads_there_in_bf16(tmp_path: Path):
    import torch

    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from stages.rl.roles.frozen import load_reference

    build_tiny_model(TinyModel(**TINY), ["1 + 2 = 3"] * 20, str(tmp_path / "m"), seed=0)
    module, _ = load_reference(str(tmp_path / "m"), True, None, "cuda:0")
    assert {(p.dtype, p.device.type) for p in module.parameters()} == {(torch.bfloat16, "cuda")}
