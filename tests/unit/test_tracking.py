"""The `tracking:` block, the driver's tracker writer without a cluster, and the headlines.

The writer is fed by hand here (stage statuses set as `execute` sets them, events
appended with the stages' own `stages.lib.io.metrics.Metrics`) and writes to real trackers:
TensorBoard's event files read back with TensorBoard's reader, and an MLflow server
that is not there (a closed port) to show a failing tracker costs one warning.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import pytest

from engine.errors import PipeError
from engine.load.load import load_pipeline
from engine.plan.dag import plan
from engine.resolve.resolve import resolve
from engine.run.headline import headlines
from engine.run.report import RunReport
from engine.run.tracking.recorder import start_tracking
from stages.lib.io.metrics import Metrics
from tests.conftest import run_cli

TWO_STAGES = """\
name: two
stages:
  a:
    kind: dataset
    config: {source: reasoning_gym, task: chain_sum, size: 10, test_size: 2}
  b:
    kind: dataset
    config: {source: reasoning_gym, task: chain_sum, size: 12, test_size: 2}
"""


def test_tracking_mistakes_are_located(tmp_path: Path):
    path = tmp_path / "p.yaml"
    path.write_text(TWO_STAGES + "tracking:\n  mlfow: {}\n  wandb: {mode: onlin}\n")
    result = run_cli("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"{path}:10:3: tracking.mlfow: unknown field 'mlfow'; did you mean 'mlflow'?",
        f"{path}:11:17: tracking.wandb.mode: expected 'online' or 'offline', found 'onlin'; did "
        "you mean 'online'?",
    ]


def test_a_tracker_whose_library_is_missing_is_a_located_error(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    path.write_text(TWO_STAGES + "tracking:\n  tensorboard: {}\n  wandb: {mode: offline}\n")
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec: not installed
    with pytest.raises(PipeError) as err:
        load_pipeline(path)
    assert err.value.render() == (
        f"{path}:11:3: tracking.wandb: tracker 'wandb' needs the 'wandb' package, which is not "
        "installed; install the tracking extra: pip install 'pipe-engine[tracking]'"
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_writer_feeds_tensorboard_and_survives_a_tracker_that_is_down(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, run_dir = tmp_path / "tb", tmp_path / "run"
    path = tmp_path / "p.yaml"
    path.write_text(
        TWO_STAGES + f"tracking:\n  tensorboard: {{dir: {tb}}}\n"
        f"  mlflow: {{tracking_uri: 'http://127.0.0.1:{_closed_port()}'}}\n"
    )
    planned = plan(resolve(load_pipeline(path), run_dir=str(run_dir)))
    report = RunReport("run-1", str(path), planned.name, "local")
    for name in planned.order:
        (run_dir / name).mkdir(parents=True)
        report.add(name, "dataset", f"key-{name}", str(run_dir / name))
    report.stages["b"].status = "cached"
    (run_dir / "a" / "track.jsonl").write_text('{"step": 9, "metrics": {"loss": 9.0}}\n')
    with caplog.at_level(logging.WARNING, logger="pipe.tracking"):
        recorder = start_tracking(planned, report)
        assert recorder is not None
        a = report.stages["a"]
        a.status = "running"
        Metrics(a.stage_dir).log(1, {"loss": 0.5, "lr": 1e-3, "note": "not a number"})
        recorder.scan()
        Metrics(a.stage_dir).log(2, {"loss": 0.25, "nested": {"x": 1}})
        (run_dir / "a" / "report.json").write_text('{"rows": 3}\n')
        (run_dir / "a" / "samples.jsonl").write_text('{"step": 1, "prompt": "1+2="}\n')
        a.status, a.metrics = "succeeded", {"rows": 3, "flag": True}
        links = recorder.close()
    assert links == {"tensorboard": f"tensorboard --logdir {tb}"}  # not mlflow: it failed
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].startswith("tracking: mlflow failed (")

    acc = EventAccumulator(str(tb / "run-1" / "a"))
    acc.Reload()
    # the line written before the run started belongs to an earlier run: not logged again
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("nested/x")] == [(2, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("result/rows")] == [(0, 3.0)]
    assert {"stage", "status", "report.json", "samples.jsonl"} <= set(acc.Tags()["tensors"])
    cached = EventAccumulator(str(tb / "run-1" / "b"))
    cached.Reload()
    assert cached.Tags()["scalars"] == []
    status = cached.Tensors("status")[0].tensor_proto.string_val[0].decode()
    assert status == "cached: not run again (cache key key-b)"
    top = EventAccumulator(str(tb / "run-1"))
    top.Reload()
    table = top.Tensors("plan")[0].tensor_proto.string_val[0].decode()
    assert f"| stages.a.config.size | 10 | {path}:5:60 |" in table.splitlines()


EVALUATION = {
    "baseline": "warmup",
    "results": [
        {
            "checkpoint": "warmup",
            "n": 500,
            "accuracy": 0.638,
            "mean_reward": 0.7,
            "pass_at_k": {"1": 0.638, "4": 0.81},
        },
        {
            "checkpoint": "rft",
            "n": 500,
            "accuracy": 0.804,
            "mean_reward": 0.85,
            "pass_at_k": {"1": 0.804, "4": 0.9},
        },
    ],
    "accuracy_delta": {"warmup": 0.0, "rft": 0.166},
}


def test_headlines_end_with_the_accuracy_table_and_the_links(tmp_path: Path):
    report = RunReport("run-1", "p.yaml", "p", "local")
    train = report.add("warmup", "train", "k1", str(tmp_path / "warmup"))
    train.status = "cached"  # a cached stage's figures come from its metrics.json
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "metrics.json").write_text(
        '{"final_loss": 0.41, "initial_loss": 2.5, "steps": 1000, "tokens_per_s": 9000.4}'
    )
    filt = report.add("filter", "filter", "k2", str(tmp_path / "filter"))
    filt.status, filt.metrics = (
        "succeeded",
        {"rows_in": 10, "rows_kept": 7, "dropped": {"min_reward": 3, "top_k": 0}},
    )
    failed = report.add("collect", "collect", "k3", str(tmp_path / "collect"))
    failed.status = "failed"
    ev = report.add("evaluate", "evaluate", "k4", str(tmp_path / "evaluate"))
    ev.status, ev.metrics = "succeeded", EVALUATION
    report.tracking = {"tensorboard": "tensorboard --logdir runs/tb"}
    assert headlines(report) == [
        "warmup (cached): final loss 0.4100 (from 2.5000) after 1000 steps, 9000 tokens/s",
        "filter: kept 7 of 10 rows; dropped: min_reward 3",
        "evaluate:",
        "  checkpoint    n  accuracy  pass@1  pass@4  mean_reward      delta",
        "  warmup      500     63.8%   63.8%   81.0%        0.700   baseline",
        "  rft         500     80.4%   80.4%   90.0%        0.850  +16.6 pts",
        "tensorboard: tensorboard --logdir runs/tb",
    ]


def test_rl_and_collect_headlines():
    from stages.collect import CollectConfig
    from stages.rl import RLConfig

    rl = {
        "steps": 40,
        "reward_first": 0.31,
        "reward_last": 0.52,
        "eval_accuracy_start": 0.6,
        "eval_accuracy_end": None,
    }
    assert RLConfig.headline(rl) == [
        "reward 0.310 -> 0.520, held-out accuracy 60.0% -> - over 40 steps"
    ]
    collect = {
        "rows": 64,
        "rollouts_per_s": 12.34,
        "latency_s": {"p95": 1.5},
        "errors": {"timeout": 2},
        "failures": 1,
        "retries": 3,
    }
    assert CollectConfig.headline(collect) == [
        "64 rollouts, 12.3 rollouts/s, p95 latency 1.50 s, 2 errors, 1 failed, 3 retries"
    ]
