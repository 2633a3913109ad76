"""The `local` backend: in-process batched generation on a tiny checkpoint, with resume.

Slow: it imports torch and transformers and builds a tiny checkpoint (~10 s on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.stage import StageContext  # noqa: E402
from stages.collect import CollectConfig, io  # noqa: E402
from stages.collect.run import run_collect  # noqa: E402
from tests.unit.test_model import rigged_checkpoint, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def sevens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("local")
    return rigged_checkpoint(tiny_checkpoint(root), root / "sevens", "7")


def _run(tmp_path: Path, model: Path, rows: list[Any], **kw: Any) -> tuple[dict[str, Any], str]:
    (tmp_path / "in.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    )
    stage = tmp_path / "stage"
    stage.mkdir(exist_ok=True)
    cfg = CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(stage / "rollouts.jsonl"),
            "num_repeats": 2,
            "max_output_tokens": 3,
            "backend": {"kind": "local", "model": str(model), "batch_size": 2},
            "verifier": {"kind": "exact_match"},
            **kw,
        },
        strict=False,
    )
    ctx = StageContext("collect", "collect", str(stage), str(tmp_path), str(tmp_path))
    return run_collect(cfg, ctx), cfg.output


ROWS: list[Any] = [
    {"prompt": "1 + 2 =", "answer": "777"},
    {"messages": [{"role": "user", "content": "9 + 9 ="}], "answer": "7"},
    "not json",
    {"prompt": "5 + 5 =", "answer": "777"},
]


def test_local_generation_writes_every_pair(tmp_path: Path, sevens: Path):
    metrics, out = _run(tmp_path, sevens, ROWS)
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in rows] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (3, 0),
        (3, 1),
    ]
    assert {r["completion"] for r in rows} == {"777"}
    assert {r["finish_reason"] for r in rows} == {"length"}
    assert [r["reward"] for r in rows] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert all(
        r["usage"]["completion_tokens"] == 3 and r["usage"]["prompt_tokens"] > 0 for r in rows
    )
    failures = [json.loads(line) for line in Path(io.failures_path(out)).read_text().splitlines()]
    assert [(f["prompt_idx"], f["error_kind"]) for f in failures] == [
        (2, "bad_row"),
        (2, "bad_row"),
    ]
    assert (metrics["written"], metrics["failed"]) == (6, 2)


def test_local_generation_resumes(tmp_path: Path, sevens: Path):
    stage = tmp_path / "stage"
    stage.mkdir()
    # as a killed run left it: same settings, prompt 0 done, prompt 3 half done
    probe = CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "num_repeats": 2,
            "max_output_tokens": 3,
            "backend": {"kind": "local", "model": str(sevens), "batch_size": 2},
            "verifier": {"kind": "exact_match"},
        },
        strict=False,
    )
    out = str(stage / "rollouts.jsonl")
    io.prepare(out, io.resume_key(probe))
    done = [(0, 0), (0, 1), (3, 1)]
    Path(io.partial_path(out)).write_text(
        "".join(
            json.dumps({"prompt_idx": p, "sample_idx": s, "completion": "OLD"}) + "\n"
            for p, s in done
        )
    )
    metrics, out = _run(tmp_path, sevens, ROWS)
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"], r["completion"]) for r in rows] == [
        (0, 0, "OLD"),
        (0, 1, "OLD"),
        (1, 0, "777"),
        (1, 1, "777"),
        (3, 0, "777"),
        (3, 1, "OLD"),
    ]
    assert (metrics["skipped_resumed"], metrics["written"]) == (3, 3)
