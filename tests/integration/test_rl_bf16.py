"""bf16 GRPO on CPU, as GPU users train: the actor in bf16 (DeepSpeed), the local engine in
bf16 too (the actor's compute dtype; fp32 before issue 37), weights over gloo in bf16
(`stages.rl.sync.transports.wire_dtype`), the probe after every sync.
Before the wire dtype, ZeRO-0 failed its first probe (log-probabilities off by 3.78) and
ZeRO-3 over two ranks met NaN probabilities at the first sampling (on an H100 too). The
20-step learning comparison with fp32 is bench/rl_bf16.py (BENCHMARKS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.cluster import pipe_run
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

sys.path.insert(0, str(ROOT / "bench"))
from rl_bf16 import PIPELINE  # noqa: E402  (the benchmark's pipeline, fewer steps)


@pytest.mark.parametrize(("zero", "ranks"), [(0, 1), (3, 2)])
def test_bf16_grpo_every_probe_passes(tmp_path: Path, zero: int, ranks: int):
    proc = pipe_run(tmp_path, PIPELINE.format(bf16="true", zero=zero, ranks=ranks, steps=3))
    assert proc.returncode == 0, proc.stderr[-4000:]
    stage = tmp_path / "runs/bf16/rl"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the engine computes in the actor's dtype (bf16), on the weights the wire carried
    diffs = [r["probe_diff"] for r in rows if r["updates"]]
    assert diffs and all(0 <= d <= 5e-2 for d in diffs), diffs
    how = json.loads((stage / "settings.json").read_text())["vllm_sync_backend"]["how"]
    assert "over gloo, one broadcast to every engine at once, no file written, in bfloat16" in how
    ranks_seen = sorted(p.name for p in (stage / "ranks").iterdir())
    assert ranks_seen == [f"actor-{r}.json" for r in range(ranks)]
