"""`pipe tune` against the bench's capacity-limited fake OpenAI server (issue 7, acceptance 1).

The server runs in its own process (capacity 64, 100 ms a request), bound to
127.0.0.1; the sweep goes through the real collector client and verifier.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from stages.collect.tune.cli import tune_command
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PIPELINE = """\
# Tuned by the test; only num_samples_in_parallel may change.
name: tune_it
cluster: {scheduler: local, workers: 1}
stages:
  collect:
    kind: collect
    config:
      input: prompts.jsonl        # sample prompts
      num_samples_in_parallel: 8  # before tuning
      num_repeats: 2
      backend: {kind: openai, base_url: "http://127.0.0.1:{port}/v1", model: fake}
      verifier: {kind: exact_match}
"""


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    script = ROOT / "bench" / "collect" / "fake_server.py"
    cmd = [sys.executable, str(script), "--port", "0", "--capacity", "64", "--latency-ms", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield int(line.split()[-1])
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def pipeline(tmp_path: Path, server_port: int) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.replace("{port}", str(server_port)))
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(300)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tune_finds_the_knee_of_a_capacity_64_server_and_writes_it(pipeline: Path) -> None:
    before = pipeline.read_text()
    args = [str(pipeline), "--stage", "collect", "--format", "json", "--write"]
    result = CliRunner().invoke(tune_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {"levels", "knee", "recommended"}
    levels = doc["levels"]
    assert 2 <= len(levels) <= 8
    assert [lv["parallelism"] for lv in levels] == [8 * 2**i for i in range(len(levels))]
    assert all(
        set(lv) == {"parallelism", "rollouts_per_s", "p50_s", "p95_s", "errors"} for lv in levels
    )
    assert all(lv["errors"] == 0 for lv in levels)
    assert 48 <= doc["knee"] <= 128, levels
    assert 40 <= doc["recommended"] <= 104, levels
    diff = list(
        difflib.unified_diff(
            before.splitlines(), pipeline.read_text().splitlines(), n=0, lineterm=""
        )
    )
    assert diff[2:] == [
        "@@ -9 +9 @@",
        "-      num_samples_in_parallel: 8  # before tuning",
        f"+      num_samples_in_parallel: {doc['recommended']}  # before tuning",
    ]
    assert (pipeline.parent / "p.tune-collect.png").read_bytes()[:4] == b"\x89PNG"


def test_diagnose_says_parallelism_limits_below_capacity(pipeline: Path) -> None:
    # 5 and 20 in flight are both under the capacity of 64: throughput scales ~4x
    args = [
        str(pipeline),
        "--stage",
        "collect",
        "--diagnose",
        "--plot",
        str(pipeline.parent / "d.png"),
    ]
    result = CliRunner().invoke(tune_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["parallelism", "rollouts/s", "p50", "s", "p95", "s", "errors"]
    assert [int(line.split()[0]) for line in lines[1:3]] == [5, 20]
    assert lines[3] == "verdict: parallelism is the limit"
    assert lines[4].startswith("why: throughput scaled ")
    assert lines[5] == (
        "next step: raise num_samples_in_parallel: run `pipe tune` to find the knee, with --write "
        "to keep it"
    )
