"""The rl stage for real: a tiny GRPO run through the CLI (DeepSpeed actor over gloo, the
local engine synced after every update), a sync that moves no weights, a SIGKILL and a
resume, and every setting accounted for under every profile and memory preset."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
PIPELINE = """\
    name: rl
    profile: {profile}
    memory: {memory}
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
          model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          num_repeats: 4
          rollout_batch_size: 8
          train_batch_size: 32
          micro_train_batch_size: 8
          learning_rate: 0.001
          max_steps: {steps}
          max_output_tokens: 4
          eval_every: 2
          save_steps: 2
"""


def write(
    tmp_path: Path, steps: int = 4, profile: str = "default", memory: str = "default"
) -> None:
    text = PIPELINE.format(steps=steps, profile=profile, memory=memory)
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))


def pipe(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "runs/rl/rl/metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_grpo_runs_and_the_engine_scores_like_the_actor_after_every_update(tmp_path: Path):
    write(tmp_path)
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    updated = [r for r in rows if r["updates"]]
    assert updated, "no step had a group with a signal"
    # after every update the engine's probe log-probabilities equal the actor's (fp32)
    assert all(r["probe_diff"] <= 1e-4 for r in updated)
    # the gradient norm is recorded (DeepSpeed keeps none at ZeRO 0 in fp32: measured)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in updated)
    # and the weights did move: the engine scores the probe differently step by step
    assert len({round(r["probe_logprob"], 6) for r in updated}) == len(updated)
    stage = tmp_path / "runs/rl/rl"
    assert (stage / "checkpoint" / "config.json").exists()
    assert (stage / "rl.png").exists()
    assert "step 4/4: reward" in result.stderr
    settings = json.loads((stage / "settings.json").read_text())
    from stages.rl import RLConfig

    # every setting, and the run's date (what templates that read the date rendered)
    assert settings.pop("date")["status"] == "applied"
    assert sorted(settings) == sorted(RLConfig.model_fields)
    assert {s["status"] for s in settings.values()} <= {"applied", "skipped"}


def test_a_sync_that_moves_no_weights_fails_within_one_step_naming_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The transport works but the weights never land (NCCL's silent no-op off the GPU):
    the probe catches it at the first sync after an update."""
    import torch

    from engine.stage import StageContext
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset
    from stages.lib.distributed.weight_group import receive
    from stages.rl import RLConfig
    from stages.rl.run import run_rl
    from stages.rl.sync import transports as rl_sync

    class Discards(rl_sync.GroupReceiver):
        def apply(self, model: torch.nn.Module) -> None:
            if self.pg is None:
                self.pg = rl_sync._pg(self.store, self.rank, self.world, self.timeout_s, False)
            for _ in receive(self.pg, "cpu", {}):  # received, never applied
                pass

    monkeypatch.setattr(
        rl_sync, "make_receiver", lambda kind, name, path, t, *_, **kw: Discards(name, t, **kw)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    data = DatasetConfig(task="chain_sum", size=32, output=str(tmp_path / "train.jsonl"))
    ctx = StageContext("data", "dataset", str(tmp_path), str(tmp_path), str(tmp_path))
    run_dataset(data, ctx)
    stage = tmp_path / "rl"
    stage.mkdir()
    cfg = RLConfig.model_validate(
        {
            "input": str(tmp_path / "train.jsonl"),
            "output": str(stage / "checkpoint"),
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300},
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
    with pytest.raises(rl_sync.SyncFailed) as info:
        run_rl(cfg, StageContext("rl", "rl", str(stage), str(tmp_path), str(tmp_path), log=log))
    message = str(info.value)
    assert message.startswith(
        "step 1: engine 'local-0' does not match the actor after the weight sync"
    )
    assert message.endswith("the weights did not arrive")


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path: Path):
    # more steps than the kill needs: a step can take well under the 0.2 s between polls, so
    # with few steps the first run could finish before the SIGKILL lands
    steps = 20
    write(tmp_path, steps=steps)
    first = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "run", "p.yaml"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    path = tmp_path / "runs/rl/rl/metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= 3:
                break
            assert first.poll() is None, "the first run ended before it was killed"
            time.sleep(0.2)
        else:
            pytest.fail("the first run made no progress in 300 s")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole run: driver, cluster, actor
        first.wait(timeout=30)
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once, in order
    resumed = re.search(r"resuming from step_0+(\d+) \(step (\d+)\)", result.stderr)
    assert resumed is not None and resumed[1] == resumed[2], result.stderr[-2000:]
    assert int(resumed[1]) % 2 == 0 and 2 <= int(resumed[1]) < steps  # a save_steps checkpoint
    report = json.loads((tmp_path / "runs/rl/report.json").read_text())
    assert report["stages"]["rl"]["metrics"]["resumed_from_step"] == int(resumed[1])
    from stages.rl.rollout.prompts import Stream

    stream = Stream(64, 8, 0)  # the batches an uninterrupted run takes
    # each step's own prompts (dynamic sampling, off by default, draws no refills)
    assert [r["prompts"] for r in rows] == [stream.indices(s) for s in range(1, steps + 1)]


def test_a_forced_rerun_of_a_completed_stage_starts_over_and_keeps_the_old_run(tmp_path: Path):
    write(tmp_path, steps=2)
    assert pipe(tmp_path, "run", "p.yaml").returncode == 0
    first = (tmp_path / "runs/rl/rl/metrics.jsonl").read_text()
    result = pipe(tmp_path, "run", "p.yaml", "--only", "rl", "--force")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" not in result.stderr  # not from its own final checkpoint
    report = json.loads((tmp_path / "runs/rl/report.json").read_text())
    rl = report["stages"]["rl"]
    assert rl["status"] == "succeeded" and rl["metrics"]["resumed_from_step"] is None
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]  # both steps trained again
    kept = f"runs/rl/history/{report['run_id']}/replaced/rl"
    assert f"rl: forced; its completed run is kept in {kept}" in result.stderr
    assert (tmp_path / kept / "rl/metrics.jsonl").read_text() == first


PRESETS = [
    (p, m)
    for p in ("default", "high-performance", "max-throughput")
    for m in ("default", "memory_constrained")
]


@pytest.mark.parametrize(("profile", "memory"), PRESETS)
def test_every_resolved_setting_is_applied_or_skipped_with_a_reason(
    tmp_path: Path, profile: str, memory: str
):
    write(tmp_path, steps=2, profile=profile, memory=memory)
    planned = pipe(tmp_path, "plan", "p.yaml", "--format", "json")
    assert planned.returncode == 0, planned.stderr
    resolved = json.loads(planned.stdout)["stages"]["rl"]["config"]
    date = json.loads(planned.stdout)["date"]
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    settings = json.loads((tmp_path / "runs/rl/rl/settings.json").read_text())
    # every resolved setting, and the run's date, the one the plan fixed
    assert settings.pop("date")["value"] == date
    assert sorted(settings) == sorted(resolved)
    assert resolved["num_threads"] == "auto"  # a count when the stage starts, and how
    threads = settings.pop("num_threads")
    assert isinstance(threads["value"], int) and threads["value"] >= 1
    assert "; auto: " in threads["how"] and "free core(s)" in threads["how"]
    resolved.pop("num_threads")
    for key, value in resolved.items():
        if not isinstance(value, str) or not value.startswith("runs/"):
            assert settings[key]["value"] == value, key
        assert settings[key]["status"] in ("applied", "skipped"), key
        assert settings[key]["how"], key
    if profile != "default" or memory != "default":  # presets set these; on the CPU they say why
        assert settings["vllm_sync_backend"] == {
            "value": "nccl",
            "status": "skipped",
            "how": "nccl needs GPUs on both ends; this run has none there, so gloo carries them "
            "(weights reach the engine over gloo, one broadcast to every engine at once, no file "
            "written, in float32, checked by a probe after every sync)",
        }


def test_ppo_under_zero3_loads_actor_and_critic_partitioned_on_two_ranks(tmp_path: Path):
    text = PIPELINE.format(steps=2, profile="default", memory="memory_constrained")
    # hidden 160: the MLP matrices pass ZeRO-3's persistence threshold and are really split
    text = text.replace(
        "model: {hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}",
        "model: {hidden_size: 160, num_layers: 1, num_heads: 4, vocab_size: 300}\n"
        "          algorithm: ppo\n"
        "          num_processes: 2",
    )
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    for role in ("actor", "critic"):
        log = (stage / f"{role}_log.txt").read_text()
        # built inside zero.Init and filled from the checkpoint: no rank held the whole model
        assert re.search(r"\[rank 0\] INFO zero 3: \d+ checkpoint tensors read one module", log), (
            role,
            log[-2000:],
        )
        held = re.search(
            r"\[rank 0\] INFO zero 3: (\d+) of \d+ weight tensors partitioned, "
            r"(\d+) of (\d+) elements held on this rank",
            log,
        )
        assert held, (role, log[-2000:])
        split, mine, total = map(int, held.groups())
        assert split > 0 and mine < total, (role, held.group(0))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["updates"] for r in rows)
    assert all(r["value_loss"] is not None for r in rows if r["updates"])


TIMING = {"gen_s", "train_s", "sync_s", "step_s", "tokens_per_s"} | {
    "sync_gather_s",
    "sync_send_s",
    "sync_load_s",
}


def _run_with(tmp_path: Path, name: str, *sets: str) -> list[dict[str, Any]]:
    run = tmp_path / name
    run.mkdir()
    write(run, steps=4)
    args = [item for s in sets for item in ("--set", f"stages.rl.config.{s}")]
    result = pipe(run, "run", "p.yaml", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(run)


def test_async_batches_are_never_staler_than_the_queue_and_queue_zero_is_the_sync_run(
    tmp_path: Path,
):
    sync = _run_with(tmp_path, "sync")
    zero = _run_with(tmp_path, "zero", "async_train=true", "async_queue_size=0")
    strip = [{k: v for k, v in r.items() if k not in TIMING} for r in sync]
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in zero] == strip
    ahead = _run_with(tmp_path, "ahead", "async_train=true", "async_queue_size=1")
    assert [r["step"] for r in ahead] == [1, 2, 3, 4]
    assert max(r["staleness"] for r in ahead) <= 1
    assert max(r["staleness"] for r in sync) == 0
    assert any(r["staleness"] == 1 for r in ahead if r["updates"])  # it did sample ahead


AUDITED = """\
    name: rl
    cluster: {workers: 1}
    stages:
      data:
        kind: dataset
        config:
          task: chain_sum
          task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}
          size: 64
          test_size: 16
      warm:
        kind: train
        needs: [data]
        config:
          target: answer
          model: {hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}
          train_batch_size: 4
          micro_train_batch_size: 4
          max_steps: 1
          num_threads: 1
      rl:
        kind: rl
        needs: [data, warm]
        config:
          input: "@data"
          model: "@warm"
          verifier: {kind: regex, pattern: "[0-9]"}
          num_repeats: 4
          rollout_batch_size: 2
          train_batch_size: 8
          micro_train_batch_size: 8
          max_steps: 2
          max_output_tokens: 4
          log_samples_every: 1
          dynamic_sampling: true      # a step trains groups with a signal: samples to log
"""


def test_an_rl_run_leaves_samples_stop_ids_and_trains_first_batch_to_audit(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(AUDITED))
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/rl/rl"
    rows = [json.loads(line) for line in (stage / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2]
    assert all(sum(r["step"] == s for r in rows) == 4 for s in (1, 2))
    for row in rows:
        n = len(row["completion_ids"])
        assert n and len(row["loss_mask"]) == len(row["behaviour_logprobs"]) == n
        assert row["prompt"] and isinstance(row["completion"], str)
        assert isinstance(row["reward"], float) and isinstance(row["advantage"], float)
    tokens = json.loads((stage / "settings.json").read_text())["max_output_tokens"]
    assert tokens["stop_ids"] and all(isinstance(i, int) for i in tokens["stop_ids"])
    assert str(tokens["stop_ids"]) in tokens["how"]
    warm = tmp_path / "runs/rl/warm/first_batch.jsonl"
    batch = [json.loads(line) for line in warm.read_text().splitlines()]
    assert len(batch) == 4  # train_batch_size
    for row in batch:
        assert row["prompt"] and row["completion"]
        assert len(row["loss_mask"]) == len(row["completion_ids"]) and 1 in row["loss_mask"]
