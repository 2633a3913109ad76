"""A stage's end gives back what it held in the long-lived worker: the local generator's
cached models (two could stay on a GPU, where the next stage may be a vLLM server whose start
checks free memory) are dropped, and a process that used CUDA empties its cache (that part
runs only with CUDA: tests/integration/test_gpu_single.py runs an evaluate stage after a
training stage on one GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cluster import SimWorker, dask_cluster
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration]


def _cached_models() -> int:
    from stages.lib.model import generate

    return len(generate._CACHE)


def test_stage_end_releases_cached_models(tmp_path: Path):
    from distributed import Client

    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model

    build_tiny_model(
        TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300),
        [f"{a} + {b} = {a + b}" for a in range(10) for b in range(10)],
        str(tmp_path / "tiny"),
        0,
    )
    rows = [{"prompt": f"{a} + 1 =", "answer": str(a + 1)} for a in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              gen:
                kind: collect
                config:
                  input: prompts.jsonl
                  max_output_tokens: 2
                  backend: {kind: local, model: tiny}
            """
        )
    )
    with dask_cluster([SimWorker()], tmp_path) as address:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "engine.cli", "run", "p.yaml", "--scheduler", address],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / "runs/p/gen/rollouts.jsonl").read_text().count("\n") == 4
        with Client(address, timeout=30) as client:  # type: ignore[no-untyped-call]
            counts = client.run(_cached_models)
    # the worker ran the stage (its generator loaded the model there) and kept nothing
    assert list(counts.values()) == [0]
