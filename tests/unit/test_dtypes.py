"""A checkpoint leaves a stage in the dtype it came in (issue 37), and one evaluate compares
its checkpoints at one precision; on every family's test checkpoint (saved in bfloat16, like
the releases). The train stage end to end: tests/integration/test_train_dtype.py."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.families import FAMILIES

torch = pytest.importorskip("torch")


def tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def save_trained(src: Path, out: Path, setting: str) -> str:
    """What a train or rl rank does: load for training (fp32, use_cache off), save."""
    from stages.lib.distributed.rank import load_model
    from stages.lib.model.dtypes import resolve_save_dtype
    from stages.lib.model.save import write_checkpoint

    model = load_model(str(src), None)
    assert model.config.use_cache is False and next(model.parameters()).dtype == torch.float32
    dtype, _ = resolve_save_dtype(setting, str(src))
    write_checkpoint(model, None, str(src), str(out), dtype)
    return dtype


def assert_files_kept(src: Path, out: Path) -> None:
    """Every file but the weights and config.json is the input's, byte for byte."""
    kept = {n for n in os.listdir(src) if n not in ("model.safetensors", "config.json")}
    assert kept == {n for n in os.listdir(out) if n not in ("model.safetensors", "config.json")}
    assert "generation_config.json" in kept
    for name in kept:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_release_is_not_saved_as_fp32_with_use_cache_off(family_checkpoint, family, tmp_path):
    src = family_checkpoint(family)
    assert save_trained(src, tmp_path / "out", "auto") == "bfloat16"
    out = tmp_path / "out"
    saved, given = tensors(out), tensors(src)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert saved.keys() == given.keys()  # tied weights written once, as they came
    size = (out / "model.safetensors").stat().st_size
    assert abs(size - (src / "model.safetensors").stat().st_size) < 4096
    config, before = (json.loads((d / "config.json").read_text()) for d in (out, src))
    assert config == before  # dtype bfloat16 and use_cache true, as the input had them
    assert (config["dtype"], config["use_cache"]) == ("bfloat16", True)
    assert_files_kept(src, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_dtype_float32_writes_fp32(family_checkpoint, family, tmp_path):
    src = family_checkpoint(family)
    assert save_trained(src, tmp_path / "out", "float32") == "float32"
    saved = tensors(tmp_path / "out")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert saved.keys() == tensors(src).keys()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    before = json.loads((src / "config.json").read_text())
    assert config == {**before, "dtype": "float32"}
    assert_files_kept(src, tmp_path / "out")


@pytest.mark.parametrize("family", FAMILIES)
def test_rl_run_without_an_update_does_not_turn_bf16_into_fp32(family_checkpoint, family, tmp_path):
    """The actor's `final` (the rl stage's last request) on the weights it loaded."""
    from stages.lib.distributed.rank import load_model
    from stages.lib.model.dtypes import resolve_save_dtype
    from stages.rl import RLConfig
    from stages.rl.roles.actor import Actor

    src = family_checkpoint(family)
    actor = Actor.__new__(Actor)
    actor.rank = 0
    actor.cfg = RLConfig.model_validate({"output": str(tmp_path / "out"), "model": str(src)})
    save_dtype, why = resolve_save_dtype(actor.cfg.save_dtype, str(src))
    assert (save_dtype, why) == ("bfloat16", f"auto: the input checkpoint's dtype ({src})")
    actor.brief = SimpleNamespace(model_dir=str(src), save_dtype=save_dtype)
    module = load_model(str(src), None)
    actor.trainer = SimpleNamespace(module=module, full_state_dict=lambda: None)
    assert actor.final({}) == str(tmp_path / "out")
    saved = tensors(tmp_path / "out")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    given = tensors(src)
    assert all(saved[k].equal(given[k]) for k in given)  # no update: the very same weights
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())
    assert_files_kept(src, tmp_path / "out")


def test_rl_settings_account_for_save_dtype():
    from stages.rl import RLConfig
    from stages.rl.controller.applied import account
    from stages.rl.sync.choice import choose_sync

    cfg = RLConfig.model_validate({"bf16": True})
    sync = choose_sync("gloo", actor_gpu=False, engine_gpu=False, shared_gpu=False)
    how = account(cfg, "torch", "cpu", 1, sync, saved=("bfloat16", "auto: the input's"))
    assert how["save_dtype"] == ("applied", "the final checkpoint in bfloat16 (auto: the input's)")
    assert how["bf16"] == (
        "applied",
        "torch autocast to bfloat16; the local engine loads the policy in bfloat16",
    )
    assert set(how) == set(RLConfig.model_fields)


def test_rl_local_engine_loads_in_the_actors_compute_dtype(family_checkpoint):
    from stages.rl.rollout.local import LocalEngine

    src = str(family_checkpoint("chatml"))
    assert next(LocalEngine(src).model.parameters()).dtype == torch.float32
    assert next(LocalEngine(src, bf16=True).model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluate_does_not_compare_a_bf16_base_with_an_fp32_finetune(
    family_checkpoint, family, tmp_path, monkeypatch
):
    from engine.stage import StageContext
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import Generator, evaluate_checkpoints
    from stages.lib.model import generate as gen

    base = family_checkpoint(family)
    tuned = tmp_path / "tuned"
    save_trained(base, tuned, "float32")
    loaded: dict[str, Any] = {}
    real_load = gen.load

    def spy(path: str, device: str = "cpu", dtype: str | None = None) -> Any:
        model, tok = real_load(path, device, dtype)
        loaded[os.path.realpath(path)] = next(model.parameters()).dtype
        return model, tok

    monkeypatch.setattr(gen, "load", spy)
    stage = tmp_path / "evaluate"
    stage.mkdir()
    ctx = StageContext(
        name="evaluate",
        kind="evaluate",
        stage_dir=str(stage),
        run_dir=str(tmp_path),
        pipeline_dir=str(tmp_path),
        log=logging.getLogger("pipe.test.dtypes"),
    )
    cfg = EvaluateConfig.model_validate(
        {"output": str(stage / "report.json"), "max_output_tokens": 2, "checkpoints": ["x"]}
    )
    rows = [{"prompt": "1 + 1 =", "answer": "2"}]
    paths = [str(base), str(tuned)]
    report = evaluate_checkpoints(
        cfg, paths, None, rows, lambda r, t: 0.0, str(tmp_path), Generator(cfg, ctx)
    )
    assert loaded == {os.path.realpath(p): torch.float32 for p in paths}
    why = "auto: the checkpoints declare bfloat16, float32, compared at one precision"
    assert report["precision"] == {"dtype": "float32", "why": why}
    settings = json.loads((stage / "settings.json").read_text())
    assert settings == {"backend.precision": {"dtype": "float32", "why": why}}
    # both in bfloat16 (a train stage's output from the release): loaded as they are
    save_trained(base, tuned, "auto")
    loaded.clear()
    report = evaluate_checkpoints(
        cfg, paths, None, rows, lambda r, t: 0.0, str(tmp_path), Generator(cfg, ctx)
    )
    assert set(loaded.values()) == {torch.bfloat16}
    assert report["precision"]["dtype"] == "bfloat16"
