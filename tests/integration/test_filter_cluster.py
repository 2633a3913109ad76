"""The filter stage on a real `distributed.LocalCluster`: partitions in parallel, same output.

The stage runs as a Dask task (as `pipe run` runs it); with a tiny
`partition_mb` the input is split into many prompt-aligned ranges filtered by
both workers. The output and the counts must equal those of the one-process
path, byte for byte, with every rule on, and for an input out of order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.filter import FilterConfig
from stages.filter.run import run_filter

pytestmark = pytest.mark.integration

TIMING = {"seconds", "rows_per_s", "mode", "partitions", "output", "histogram"}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c


def rollouts(n_prompts: int, seed: int = 7) -> list[dict[str, Any]]:
    """Groups of 4 with uniform groups, repeated prompts and repeated answers."""
    rng = random.Random(seed)
    rows = []
    for p in range(n_prompts):
        prompt = f"What is {p % 37} + {p % 11}?"  # prompts repeat across indices
        bias = rng.choice([0.0, 1.0, 0.5])
        for s in range(4):
            answer = rng.choice(["4", "4 ", "The answer is 4", "the answer is  4", str(s + p)])
            reward = bias if bias != 0.5 else rng.choice([0.0, 0.25, 1.0])
            rows.append(
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "prompt_idx": p,
                    "sample_idx": s,
                    "completion": answer * rng.randint(1, 3),
                    "reward": reward,
                    "finish_reason": "stop",
                    "usage": {"prompt_tokens": 9, "completion_tokens": rng.randint(1, 40)},
                    "latency_s": 0.1,
                }
            )
    return rows


def run_on(
    where: Any, tmp_path: Path, name: str, src: Path, **config: Any
) -> tuple[bytes, dict[str, Any]]:
    stage_dir = tmp_path / name
    stage_dir.mkdir()
    cfg = FilterConfig(input=str(src), output=str(stage_dir / "out.jsonl"), **config)
    ctx = StageContext(name, "filter", str(stage_dir), str(tmp_path), str(tmp_path), workers=2)
    if where is None:
        report = run_filter(cfg, ctx)
    else:
        report = where.submit(run_filter, cfg, ctx, pure=False).result(timeout=300)
    assert not list(stage_dir.glob(".filter-tmp-*"))
    return (stage_dir / "out.jsonl").read_bytes(), report


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert {k: v for k, v in a.items() if k not in TIMING} == {
        k: v for k, v in b.items() if k not in TIMING
    }


CONFIGS = {
    "every_rule": {
        "drop_uniform_groups": True,
        "min_reward": 0.2,
        "max_length": 30,
        "length_unit": "tokens",
        "dedup": "normalized",
        "predicate": "cluster_predicate:no_fives",
        "top_k_per_prompt": 2,
    },
    "exact_dedup_only": {"dedup": "exact"},
    "no_dedup": {"drop_uniform_groups": True, "top_k_per_prompt": 1},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parallel_partitions_give_the_one_process_output(
    client: Any, tmp_path: Path, name: str
) -> None:
    (tmp_path / "cluster_predicate.py").write_text(
        "def no_fives(row):\n    return '5' not in row['completion']\n"
    )
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rollouts(600)))
    config = {**CONFIGS[name], "partition_mb": 0.02}  # ~20 KB ranges: a dozen or more
    seq_out, seq = run_on(None, tmp_path, "seq", src, **config)
    par_out, par = run_on(client, tmp_path, "par", src, **config)
    assert (seq["mode"], par["mode"]) == ("sequential", "parallel")
    assert par["partitions"] >= 10
    assert par_out == seq_out
    same(par, seq)
    assert 0 < seq["rows_kept"] < seq["rows_in"] == 2400
    assert sum(seq["dropped"].values()) + seq["rows_kept"] == 2400


def test_out_of_order_input_is_sorted_then_filtered_in_parallel(
    client: Any, tmp_path: Path
) -> None:
    rows = rollouts(300, seed=3)
    rng = random.Random(1)
    rng.shuffle(rows)
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"drop_uniform_groups": True, "dedup": "exact", "partition_mb": 0.02}
    seq_out, seq = run_on(None, tmp_path, "seq", src, **config)
    par_out, par = run_on(client, tmp_path, "par", src, **config)
    assert par["input_contiguous"] is False and seq["input_contiguous"] is False
    assert par_out == seq_out
    same(par, seq)
    kept = [json.loads(line) for line in par_out.splitlines()]
    keys = [(r["prompt_idx"], r["sample_idx"]) for r in kept]
    assert keys == sorted(keys)
