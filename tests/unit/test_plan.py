"""`pipe plan`: --explain full text, the JSON shape, plan.lock YAML, and DeepSpeed configs."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from tests.conftest import DATA, ROOT, run_cli
from tests.fetched import planned_from

PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))
GOLDEN = DATA / "explain"


@pytest.fixture(autouse=True)
def _no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as on a machine without GPUs (`cluster.gpus: auto` reads this machine's)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_explain_full_text(path: Path, tmp_path: Path):
    cwd = planned_from(path, tmp_path)  # a fetched model file: its stand-in
    result = run_cli("plan", f"pipelines/{path.name}", "--explain", cwd=cwd)
    assert result.exit_code == 0, result.stderr
    golden = GOLDEN / f"{path.stem}.txt"
    if os.environ.get("PIPE_REGEN_GOLDEN"):
        golden.write_text(result.stdout + ("---\n" + result.stderr if result.stderr else ""))
    assert result.stdout + ("---\n" + result.stderr if result.stderr else "") == golden.read_text()


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_json_shape_every_value_resolved(path: Path, tmp_path: Path):
    cwd = planned_from(path, tmp_path)
    result = run_cli("plan", f"pipelines/{path.name}", "--format", "json", cwd=cwd)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"name", "profile", "memory", "date", "stages", "roles"}
    for stage in data["stages"].values():
        # a stage that reads a GGUF file names its sha256 (`stages.lib.model.gguf`)
        assert set(stage) - {"sha256"} == {"kind", "needs", "resources", "config"}
        assert set(stage["resources"]) == {"role", "gpus"}
        assert isinstance(stage["resources"]["gpus"], int)
        cfg = stage["config"]
        for field in ("input", "output", "checkpoints", "model"):
            if field in cfg:
                assert cfg[field] not in (None, []), field
                assert "@" not in json.dumps(cfg[field]), field
    for alloc in data["roles"].values():
        assert set(alloc) == {"gpus", "colocated_with"}
        assert isinstance(alloc["gpus"], int)


def test_yaml_is_the_lock_and_round_trips_to_json(tmp_path: Path):
    from ruamel.yaml import YAML

    yaml_out = run_cli("plan", "pipelines/quickstart.yaml", "--format", "yaml", cwd=ROOT).stdout
    json_out = run_cli("plan", "pipelines/quickstart.yaml", "--format", "json", cwd=ROOT).stdout
    assert yaml_out.startswith("# plan of pipelines/quickstart.yaml: every value resolved\n")
    assert YAML(typ="safe", pure=True).load(yaml_out) == json.loads(json_out)


def test_plan_set_override():
    out = run_cli(
        "plan",
        "pipelines/quickstart.yaml",
        "--format",
        "json",
        "--set",
        "memory=memory_constrained",
        cwd=ROOT,
    )
    cfg = json.loads(out.stdout)["stages"]["warmup"]["config"]
    assert (cfg["zero_stage"], cfg["adam_offload"], cfg["micro_train_batch_size"]) == (3, True, 64)


PROFILES = ("default", "high-performance", "max-throughput")
MEMORY = ("default", "memory_constrained")


@pytest.mark.parametrize(("profile", "memory"), list(itertools.product(PROFILES, MEMORY)))
def test_ds_config_passes_deepspeed_for_every_preset_pair(
    profile: str, memory: str, tmp_path: Path
):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve
    from stages.lib.distributed.ds_config import build_ds_config

    overrides = [f"profile={profile}", f"memory={memory}"]
    p = plan(resolve(load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides)))
    for name in ("warmup", "rft"):
        cfg = p.stages[name].resolved.config
        ds = build_ds_config(cfg, world_size=1)  # type: ignore[arg-type]
        parsed = DeepSpeedConfig(ds)
        assert parsed.zero_optimization_stage == cfg.zero_stage  # type: ignore[attr-defined]
        assert parsed.train_batch_size == cfg.train_batch_size  # type: ignore[attr-defined]
        expected_stage = 3 if memory == "memory_constrained" else 0
        assert ds["zero_optimization"]["stage"] == expected_stage
        assert ("offload_optimizer" in ds["zero_optimization"]) == (memory == "memory_constrained")


def test_presets_command_lists_reasons():
    out = run_cli("presets").stdout
    assert (
        "profile high-performance: Colocate every model on the same GPUs (hybrid engine) and "
        "overlap communication." in out
    )
    assert (
        "  vllm_gpu_memory_utilization = 0.5: hybrid engine: leave half of each GPU for the "
        "colocated trainer" in out
    )
    assert (
        "  zero_stage = 3: when hitting OOM: increase --zero_stage (2 -> 3) to shard parameters too"
        in out
    )
