"""`pipe run` on a model named by hub id, served by a fake hub on 127.0.0.1 (`HF_ENDPOINT`): the
stage reads the family checkpoint's snapshot, downloaded once into `HF_HOME`; a second run is
cached, a moved `main` re-runs the stage; offline, the cache alone serves the next plan; the
token sent to the hub is in no file of the run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.hub_server import FakeHub

pytestmark = [pytest.mark.integration]

TOKEN = "hf_pipeTestSecretToken0123456789"
PIPELINE = """\
name: p
stages:
  evaluate:
    kind: evaluate
    config:
      input: prompts.jsonl
      checkpoints: [org/chat]
      max_output_tokens: 4
      verifier: {kind: exact_match}
"""


def _status(run: Path) -> str:
    return json.loads((run / "report.json").read_text())["stages"]["evaluate"]["status"]


def test_a_run_reads_the_hub_snapshot_reruns_when_main_moves_and_writes_no_token(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    family_checkpoint: Callable[..., Path],
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "prompts.jsonl").write_text(
        '{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n'
    )
    run = tmp_path / "runs" / "p"
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        first = hub.add("org/chat", family_checkpoint("chatml"))
        result = run_cli("run", "p.yaml", cwd=tmp_path)
        assert result.exit_code == 0, result.stderr
        assert _status(run) == "succeeded"
        snapshot = tmp_path / "hf" / "hub" / "models--org--chat" / "snapshots" / first
        assert (snapshot / "config.json").is_file()
        report = json.loads((run / "evaluate" / "report.json").read_text())
        assert [r["checkpoint"] for r in report["results"]] == ["org/chat"]
        stamp = json.loads((run / "evaluate" / ".pipe-stage.json").read_text())
        assert stamp["hub"] == {str(snapshot): "org/chat"}
        downloads = [r for r in hub.requests if "/resolve/" in r[1]]
        assert downloads and all(r[2] == f"Bearer {TOKEN}" for r in downloads)

        again = run_cli("run", "p.yaml", cwd=tmp_path)
        assert again.exit_code == 0, again.stderr
        assert _status(run) == "cached"
        assert [r for r in hub.requests if "/resolve/" in r[1]] == downloads  # nothing new

        hub.add("org/chat", family_checkpoint("chatml"))  # main moves to a new commit
        moved = run_cli("run", "p.yaml", cwd=tmp_path)
        assert moved.exit_code == 0, moved.stderr
        assert _status(run) == "succeeded"
    plans = [p.read_text() for p in run.glob("history/*/plan.lock.yaml")]
    for sha in (first, hub.repos["model", "org/chat"].refs["main"]):  # each run's commit
        assert any(f"org/chat@{sha}" in text for text in plans), sha

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is gone: the cache pins the same commit
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    offline = run_cli("run", "p.yaml", cwd=tmp_path)
    assert offline.exit_code == 0, offline.stderr
    assert _status(run) == "cached"

    leaked = [str(p) for p in run.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert leaked == []
