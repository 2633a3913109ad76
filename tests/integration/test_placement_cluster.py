"""Placement for real on simulated GPU nodes: `dask worker --resources GPU=n` processes on
127.0.0.1, each with its own node name and device ids. Ranks run on the CPU with gloo; the
device ids each process was given are recorded and checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import ENV, ROOT, SimWorker, dask_cluster

pytestmark = pytest.mark.integration

TOYS = [sys.executable, str(ROOT / "tests" / "pipe_with_toys.py")]
PIPE = [sys.executable, "-m", "engine.cli"]


def run(
    cmd: list[str], cwd: Path, *args: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def report(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "report.json").read_text())


def test_independent_one_gpu_stages_share_a_two_gpu_worker_without_sharing_a_device(
    tmp_path: Path,
):
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            cluster: {gpus: auto, gpus_per_node: 2}
            stages:
              a: {kind: toy, resources: {gpus: 1}, config: {value: a, sleep_s: 3, record_devices: true}}
              b: {kind: toy, resources: {gpus: 1}, config: {value: b, sleep_s: 3, record_devices: true}}
              c: {kind: toy, resources: {gpus: 1}, config: {value: c, sleep_s: 0.5, record_devices: true}}
            """
        )
    )
    with dask_cluster([SimWorker(gpus=2, node="n0", devices="0,1", nthreads=3)], tmp_path) as addr:
        result = run(TOYS, tmp_path, "run", "p.yaml", "--scheduler", addr)
    assert result.returncode == 0, result.stderr
    assert "  c waits for a: they would share devices" in result.stderr
    seen = {s: json.loads((tmp_path / "runs/p" / s / "devices.json").read_text()) for s in "abc"}
    assert {seen["a"]["cuda_visible_devices"], seen["b"]["cuda_visible_devices"]} == {"0", "1"}
    assert seen["a"]["start"] < seen["b"]["end"] and seen["b"]["start"] < seen["a"]["end"]
    c = seen["c"]
    assert c["cuda_visible_devices"] in ("0", "1")
    holder = "a" if seen["a"]["cuda_visible_devices"] == c["cuda_visible_devices"] else "b"
    assert c["start"] >= seen[holder]["end"]
    stages = report(tmp_path / "runs/p")["stages"]
    assert [s["placement"][0]["devices"] for s in stages.values()] == [
        [int(seen[n]["cuda_visible_devices"])] for n in "abc"
    ]


def test_one_failing_task_stops_the_others_and_the_stage_is_retried_whole(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            cluster: {gpus: 4, gpus_per_node: 2}
            stages:
              wide: {kind: spread, retries: 1, resources: {gpus: 4}, config: {fail_node: 1}}
            """
        )
    )
    workers = [SimWorker(2, f"node{i}", "0,1") for i in range(2)]
    started = time.monotonic()
    with dask_cluster(workers, tmp_path) as address:
        result = run(TOYS, tmp_path, "run", "p.yaml", "--scheduler", address, timeout=300)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    record = report(tmp_path / "runs/p")["stages"]["wide"]
    assert (record["status"], record["attempts"]) == ("failed", 2)
    assert record["error"] == "RuntimeError: task 1 fails on attempt 2"
    assert (
        "wide: attempt 1 failed (RuntimeError: task 1 fails on attempt 1); retrying"
        in result.stderr
    )
    assert elapsed < 90  # the waiting task stopped with its stage, it did not wait out 120 s


TRAIN = """\
    name: t
    cluster: {{gpus: {gpus}, gpus_per_node: 2}}
    stages:
      train:
        kind: train
        resources: {resources}
        config:
          input: data.jsonl
          target: answer
          model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}}
          num_processes: {processes}
          num_threads: 1
          train_batch_size: 8
          micro_train_batch_size: 2
          max_steps: 8
          learning_rate: 0.01
          logging_steps: 1
"""


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "train" / "loss.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_a_four_gpu_train_stage_is_one_gloo_job_across_two_workers(tmp_path: Path):
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spread = tmp_path / "spread"
    spread.mkdir()
    (spread / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text())
    (spread / "p.yaml").write_text(
        textwrap.dedent(TRAIN.format(gpus=4, resources="{gpus: 4}", processes=1))
    )
    workers = [SimWorker(2, f"node{i}", f"{2 * i},{2 * i + 1}") for i in range(3)]
    with dask_cluster(workers, spread) as address:
        result = run(PIPE, spread, "run", "p.yaml", "--scheduler", address)
    assert result.returncode == 0, result.stderr[-3000:]
    record = report(spread / "runs/t")["stages"]["train"]
    assert len(record["workers"]) == 2
    assert [(p["node"], p["devices"]) for p in record["placement"]] == [
        ("node0", [0, 1]),
        ("node1", [2, 3]),
    ]
    ranks = record["metrics"]["ranks"]
    assert [(r["rank"], r["node_rank"], r["device"]) for r in ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 2),
        (3, 1, 3),
    ]
    assert record["metrics"]["world_size"] == 4
    given = [
        json.loads((spread / "runs/t/train/ranks" / f"rank-{r}.json").read_text()) for r in range(4)
    ]
    assert [
        (g["world_size"], g["node_rank"], g["local_rank"], g["cuda_visible_devices"]) for g in given
    ] == [
        (4, "0", "0", "0,1"),
        (4, "0", "1", "0,1"),
        (4, "1", "0", "2,3"),
        (4, "1", "1", "2,3"),
    ]
    # the same job on one machine: 4 CPU ranks, same seed, same data
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text())
    (alone / "p.yaml").write_text(
        textwrap.dedent(TRAIN.format(gpus=0, resources="{}", processes=4))
    )
    single = run(PIPE, alone, "run", "p.yaml")
    assert single.returncode == 0, single.stderr[-3000:]
    assert report(alone / "runs/t")["stages"]["train"]["metrics"]["world_size"] == 4
    spread_losses, alone_losses = _losses(spread / "runs/t"), _losses(alone / "runs/t")
    assert len(spread_losses) == len(alone_losses) == 8
    assert spread_losses == pytest.approx(alone_losses, abs=1e-5)


def test_declared_cluster_plan_places_the_gpu_example_per_node():
    result = run(
        PIPE, ROOT, "plan", "pipelines/rft_gpu_cluster.yaml", "--cluster", "6x8", "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    placement = json.loads(result.stdout)["placement"]
    assert placement["collect"] == [
        {"node": f"node{i}", "worker": None, "devices": list(range(8)), "role": "vllm"}
        for i in (0, 1)
    ]
    assert placement["train"] == [
        {"node": f"node{i}", "worker": None, "devices": list(range(8)), "role": "actor"}
        for i in (2, 3, 4, 5)
    ]
    assert os.path.exists(ROOT / "pipelines/rft_gpu_cluster.yaml")


PPO = """\
    name: ppo
    cluster: {gpus: 6, gpus_per_node: 2}
    resources: {ratio: {vllm: 1, actor: 1, critic: 1}}
    stages:
      rl:
        kind: rl
        config:
          algorithm: ppo
          input: data.jsonl
          model: {hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}
          verifier: {kind: regex, pattern: "^[0-9]+$"}
          num_repeats: 4
          rollout_batch_size: 16
          train_batch_size: 64
          micro_train_batch_size: 32
          learning_rate: 0.003
          max_steps: 12
          max_output_tokens: 3
          save_steps: 12
"""


@pytest.mark.slow
def test_ppo_runs_its_engine_actor_and_critic_on_the_workers_the_plan_gives(tmp_path: Path):
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PPO))
    planned = run(PIPE, tmp_path, "plan", "p.yaml", "--cluster", "3x2", "--format", "json")
    assert planned.returncode == 0, planned.stderr
    plan = {p["role"]: p["node"] for p in json.loads(planned.stdout)["placement"]["rl"]}
    assert plan == {"vllm": "node0", "actor": "node1", "critic": "node2"}
    workers = [SimWorker(2, f"node{i}", "0,1") for i in range(3)]
    with dask_cluster(workers, tmp_path) as address:
        result = run(PIPE, tmp_path, "run", "p.yaml", "--scheduler", address)
    assert result.returncode == 0, result.stderr[-3000:]
    record = report(tmp_path / "runs/ppo")["stages"]["rl"]
    placed = {p["role"]: (p["node"], p["worker"], p["devices"]) for p in record["placement"]}
    assert {r: n for r, (n, _, _) in placed.items()} == plan
    assert len({w for _, w, _ in placed.values()}) == 3  # three workers, one role each
    assert sorted(record["workers"]) == sorted(w for _, w, _ in placed.values())
    rows = [
        json.loads(x) for x in (tmp_path / "runs/ppo/rl/metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 12
    first, last = rows[:5], rows[-5:]
    assert sum(r["reward_mean"] for r in last) > sum(r["reward_mean"] for r in first)
    assert all(r["value_loss"] is not None for r in rows if r["updates"])


@pytest.mark.slow
def test_ppo_roles_each_span_two_workers_of_a_six_node_loopback_cluster(tmp_path: Path):
    """The reference guide's 1:1:1 at its smallest cross-node shape: every role holds two
    one-GPU nodes; two engines on two workers, actor and critic two ranks each over two
    workers, one torch.distributed job per role."""
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = textwrap.dedent(PPO).replace(
        "{gpus: 6, gpus_per_node: 2}", "{gpus: 6, gpus_per_node: 1}"
    )
    (tmp_path / "p.yaml").write_text(text)
    workers = [SimWorker(1, f"node{i}", str(i)) for i in range(6)]
    with dask_cluster(workers, tmp_path) as address:
        result = run(PIPE, tmp_path, "run", "p.yaml", "--scheduler", address)
    assert result.returncode == 0, result.stderr[-3000:]
    record = report(tmp_path / "runs/ppo")["stages"]["rl"]
    by_role: dict[str, set[str]] = {}
    for p in record["placement"]:
        by_role.setdefault(p["role"], set()).add(p["worker"])
    assert {r: len(w) for r, w in by_role.items()} == {"vllm": 2, "actor": 2, "critic": 2}
    assert len(set().union(*by_role.values())) == 6  # six workers, one role each
    out = json.loads((tmp_path / "runs/ppo/rl/rl_result.json").read_text())
    engines = out["engines"]
    assert [e["name"] for e in engines] == ["local-0", "local-1"]
    assert {e["worker"] for e in engines} == by_role["vllm"]
    assert sorted(d for e in engines for d in e["devices"]) == sorted(
        d for p in record["placement"] if p["role"] == "vllm" for d in p["devices"]
    )
    for role in ("actor", "critic"):
        ranks = out["ranks"][role]
        assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
        assert {r["worker"] for r in ranks} == by_role[role]
        assert len({r["node"] for r in ranks}) == 2
    metrics = [
        json.loads(x) for x in (tmp_path / "runs/ppo/rl/metrics.jsonl").read_text().splitlines()
    ]
    assert len(metrics) == 12
    first, last = metrics[:5], metrics[-5:]
    assert sum(r["reward_mean"] for r in last) > sum(r["reward_mean"] for r in first)
    assert all(r["probe_diff"] <= 1e-4 for r in metrics)  # both engines matched the actor
    settings = json.loads((tmp_path / "runs/ppo/rl/settings.json").read_text())
    assert settings["backend"]["how"].startswith("2 local engines on 2 node(s) (node0, node1)")
