"""Sharding on a real Dask LocalCluster: shard tasks, merge in input order, per-shard resume."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect
from stages.collect.shard import shard_output, split_range
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import ThreadHandle, expected_answer, start_in_thread

distributed = pytest.importorskip("distributed")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as lc,
        distributed.Client(lc) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadHandle]:
    handle = start_in_thread(capacity=16, latency_ms=2)
    yield handle
    handle.stop()


def _setup(tmp_path: Path, url: str, **kw: Any) -> tuple[CollectConfig, StageContext]:
    rows = [{"prompt": f"Q{i}", "answer": expected_answer(f"Q{i}")} for i in range(60)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = tmp_path / "stage"
    stage.mkdir()
    cfg = CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(stage / "rollouts.jsonl"),
            "num_repeats": 2,
            "start_idx": 5,
            "end_idx": 50,
            "num_samples_in_parallel": 4,
            "backend": {"kind": "openai", "base_url": url, "model": "fake"},
            "verifier": {"kind": "exact_match"},
            **kw,
        },
        strict=False,
    )
    ctx = StageContext("collect", "collect", str(stage), str(tmp_path), str(tmp_path), workers=2)
    return cfg, ctx


def _keys(path: str) -> list[tuple[int, int]]:
    return [
        (r["prompt_idx"], r["sample_idx"])
        for r in map(json.loads, Path(path).read_text().splitlines())
    ]


def test_split_range_is_contiguous_and_balanced():
    assert split_range(5, 50, 3) == [(5, 20), (20, 35), (35, 50)]
    assert split_range(0, 10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert split_range(0, 2, 5) == [(0, 1), (1, 2)]
    assert split_range(3, 3, 2) == []


def test_shards_run_as_dask_tasks_and_merge_in_input_order(
    tmp_path: Path, cluster: Any, server: ThreadHandle
):
    cfg, ctx = _setup(tmp_path, server.url, shards=3)
    metrics = cluster.submit(run_collect, cfg, ctx, pure=False).result(timeout=120)
    assert metrics["shards"] == 3
    assert (metrics["rows"], metrics["written"], metrics["failures"]) == (90, 90, 0)
    assert _keys(cfg.output) == [(i, s) for i in range(5, 50) for s in range(2)]
    # the shards merged into one output; track.jsonl: their progress points for the trackers
    assert sorted(p.name for p in Path(ctx.stage_dir).iterdir()) == [
        "rollouts.jsonl",
        "rollouts.jsonl.done.json",  # what the merged output was made with; the shards' gone
        "track.jsonl",
    ]
    rows = [json.loads(x) for x in Path(cfg.output).read_text().splitlines()]
    assert all(r["reward"] == 1.0 for r in rows)


def test_a_finished_shard_is_not_redone(tmp_path: Path, cluster: Any, server: ThreadHandle):
    cfg, ctx = _setup(tmp_path, server.url, shards="auto")  # auto: ctx.workers = 2
    first = cfg.model_copy(
        update={"start_idx": 5, "end_idx": 27, "shards": 1, "output": shard_output(cfg.output, 0)}
    )
    cluster.submit(run_collect, first, ctx, pure=False).result(
        timeout=120
    )  # as a killed run left it
    before = server.server.counters.requests
    metrics = cluster.submit(run_collect, cfg, ctx, pure=False).result(timeout=120)
    assert server.server.counters.requests - before == (50 - 27) * 2
    assert metrics["shards"] == 2 and metrics["written"] == (50 - 27) * 2
    assert _keys(cfg.output) == [(i, s) for i in range(5, 50) for s in range(2)]
    again = cluster.submit(run_collect, cfg, ctx, pure=False).result(timeout=120)
    assert again == {"up_to_date": True, "rows": 90, "failures": 0, "written": 0}


def test_outside_a_dask_worker_shards_run_in_one_piece(tmp_path: Path, server: ThreadHandle):
    cfg, ctx = _setup(tmp_path, server.url, shards=3)
    metrics = run_collect(cfg, ctx)
    assert "shards" not in metrics and metrics["rows"] == 90
    assert _keys(cfg.output) == [(i, s) for i in range(5, 50) for s in range(2)]


def test_shards_in_worker_processes(tmp_path: Path, server: ThreadHandle):
    """Shards pickled to separate worker processes, as on a real cluster."""
    cfg, ctx = _setup(tmp_path, server.url, shards=2)
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        distributed.Client(lc) as client,
    ):
        metrics = client.submit(run_collect, cfg, ctx, pure=False).result(timeout=120)
        pids = set(client.run(os.getpid).values())
    assert len(pids) == 2 and os.getpid() not in pids
    assert metrics["shards"] == 2 and metrics["rows"] == 90
    assert _keys(cfg.output) == [(i, s) for i in range(5, 50) for s in range(2)]
