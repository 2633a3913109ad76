"""The evaluate stage: pass@k, the report's exact shape, names, and the stage end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.evaluate import EvaluateConfig
from stages.evaluate.report_files import render_markdown
from stages.evaluate.run import checkpoint_names, evaluate_checkpoints
from stages.evaluate.scores import k_values, pass_at_k, summarize
from stages.lib.backends.local import LocalBackend
from stages.lib.config import Verifier


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 4, 1, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 2, 2, 5 / 6),
        (4, 1, 4, 1.0),
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: float):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="need 0 < k <= n and 0 <= c <= n, found n=2, c=0, k=3"):
        pass_at_k(2, 0, 3)


def test_k_values_are_powers_of_two_and_n():
    assert [k_values(n) for n in (1, 2, 4, 5, 8)] == [
        [1],
        [1, 2],
        [1, 2, 4],
        [1, 2, 4, 5],
        [1, 2, 4, 8],
    ]


def test_summary_of_known_rewards():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.5, 1.0, 0.0]]
    assert summarize("rft", rewards) == {
        "checkpoint": "rft",
        "n": 3,
        "accuracy": pytest.approx(1 / 3),
        "mean_reward": pytest.approx(3.5 / 12),
        "pass_at_k": {
            "1": pytest.approx((0.5 + 0 + 0.25) / 3),
            "2": pytest.approx((5 / 6 + 0 + 0.5) / 3),
            "4": pytest.approx(2 / 3),
        },
    }


def test_checkpoint_names_come_from_stage_folders(tmp_path: Path):
    run = tmp_path / "run"
    paths = [str(run / "warmup" / "checkpoint"), str(run / "rft" / "checkpoint"), "/models/base"]
    assert checkpoint_names(paths, str(run)) == ["warmup", "rft", "/models/base"]
    # two folders of one name are told apart by their paths, not `ckpt`, `ckpt-2`
    assert checkpoint_names(["/a/ckpt", "/b/ckpt"], str(run)) == ["/a/ckpt", "/b/ckpt"]
    assert checkpoint_names(["org/model"], str(run)) == ["org/model"]  # a hub id as written


def test_checkpoints_are_labelled_by_the_stage_that_made_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`@sft` names sft's output wherever it is written (outside the run's folder, or nested
    in another stage's name): the engine hands each output's stage to the run
    (`StageContext.producers`); a folder no stage makes is named by its path from the
    pipeline's folder."""
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve
    from engine.run.execute import producers
    from tests.conftest import stub_checkpoint

    monkeypatch.chdir(tmp_path)
    stub_checkpoint(tmp_path / "models" / "base")
    (tmp_path / "x.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    elsewhere = tmp_path / "elsewhere" / "checkpoint"
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n"
        f"  sft: {{kind: train, config: {{input: x.jsonl, model: models/base, output: {elsewhere}}}}}\n"
        "  rft: {kind: train, needs: [sft], config: {input: x.jsonl, model: '@sft', "
        "output: ../other/checkpoint}}\n"
        "  ev: {kind: evaluate, needs: [sft, rft], config: {input: x.jsonl, "
        "checkpoints: ['@sft', '@rft', models/base]}}\n"
    )
    planned = plan(resolve(load_pipeline("p.yaml", ()), run_dir="runs/p"))
    made = producers(planned)
    assert made[str(elsewhere)] == "sft"
    assert made[str(tmp_path / "runs/p/ev/report.json")] == "ev"
    cfg = planned.stages["ev"].resolved.config
    names = checkpoint_names(cfg.checkpoints, str(tmp_path / "runs/p"), made, str(tmp_path))
    assert names == ["sft", "rft", "models/base"]  # rft's folder is runs/p/other/checkpoint


def test_markdown_table_shows_differences_to_the_baseline():
    report = {
        "baseline": "warmup",
        "results": [
            {
                "checkpoint": "warmup",
                "n": 4,
                "accuracy": 0.25,
                "mean_reward": 0.3,
                "pass_at_k": {"1": 0.25},
            },
            {
                "checkpoint": "rft",
                "n": 4,
                "accuracy": 0.5,
                "mean_reward": 0.4,
                "pass_at_k": {"1": 0.5},
            },
        ],
    }
    assert render_markdown(report).splitlines() == [
        "# Evaluation: baseline `warmup`",
        "",
        "| checkpoint | n | accuracy | Δ accuracy | mean reward | Δ mean reward | pass@1 |",
        "|---|---|---|---|---|---|---|",
        "| `warmup` | 4 | 0.250 | +0.0 pts | 0.300 | +0.000 | 0.250 |",
        "| `rft` | 4 | 0.500 | +25.0 pts | 0.400 | +0.100 | 0.500 |",
    ]


# --- with real (tiny, rigged) checkpoints ------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.unit.test_model import rigged_checkpoint, tiny_checkpoint

    run = tmp_path_factory.mktemp("run")
    plain = tiny_checkpoint(run / "init")
    (run / "sevens").mkdir()
    (run / "stops").mkdir()
    rigged_checkpoint(plain, run / "sevens" / "checkpoint", "7")
    rigged_checkpoint(plain, run / "stops" / "checkpoint", "<|eos|>")
    (run / "evaluate").mkdir()
    return run


ROWS = [
    {"prompt": "3 + 4 =", "answer": "77"},
    {"prompt": "70 + 7 =", "answer": "77"},
    {"prompt": "1 + 1 =", "answer": "2"},
    {"prompt": "50 + 27 =", "answer": "77"},
]


def _config(run: Path, **fields: Any) -> EvaluateConfig:
    return EvaluateConfig(
        output=str(run / "evaluate" / "report.json"),
        max_output_tokens=2,
        backend=LocalBackend(kind="local", batch_size=3),
        **fields,
    )


def _exact(row: dict[str, Any], completion: str) -> float:
    return 1.0 if completion.strip() == row["answer"] else 0.0


def test_report_has_the_documented_shape_and_values(run_dir: Path):
    sevens, stops = run_dir / "sevens" / "checkpoint", run_dir / "stops" / "checkpoint"
    cfg = _config(run_dir, num_samples=4, temperature=1.0)
    metrics = evaluate_checkpoints(
        cfg, [str(sevens), str(stops)], str(stops), ROWS, _exact, str(run_dir)
    )
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    # the rigged models answer "77" and "" whatever they sample: 3 of 4 prompts want "77"
    assert report == {
        "baseline": "stops",
        "checkpoints": {"stops": str(stops), "sevens": str(sevens)},
        "sampling": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        },
        "results": [
            {"checkpoint": "stops", "n": 4, "accuracy": 0.0, "mean_reward": 0.0,
             "pass_at_k": {"1": 0.0, "2": 0.0, "4": 0.0}},
            {"checkpoint": "sevens", "n": 4, "accuracy": 0.75, "mean_reward": 0.75,
             "pass_at_k": {"1": 0.75, "2": 0.75, "4": 0.75}},
        ],
    }  # fmt: skip
    assert metrics["accuracy_delta"] == {"stops": 0.0, "sevens": 0.75}
    md = (run_dir / "evaluate" / "report.md").read_text()
    assert "| `sevens` | 4 | 0.750 | +75.0 pts | 0.750 | +0.750 | 0.750 | 0.750 | 0.750 |" in md
    assert (run_dir / "evaluate" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gens = [
        json.loads(x) for x in (run_dir / "evaluate" / "generations.jsonl").read_text().splitlines()
    ]
    assert len(gens) == 2 * 4 * 4
    assert gens[0] == {
        "checkpoint": "stops", "prompt_idx": 0, "sample_idx": 0, "completion": "", "reward": 0.0,
        "finish_reason": "stop", "completion_tokens": 1, "answer": "77",
    }  # fmt: skip
    assert {(g["completion"], g["finish_reason"]) for g in gens if g["checkpoint"] == "sevens"} == {
        ("77", "length")
    }


def test_the_stage_scores_with_the_configured_verifier(run_dir: Path):
    pytest.importorskip("stages.lib.verify")
    from stages.evaluate.run import run_evaluate

    data = run_dir / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    sevens = str(run_dir / "sevens" / "checkpoint")
    cfg = _config(
        run_dir,
        input=str(data),
        checkpoints=[sevens],
        limit=3,
        verifier=Verifier(kind="exact_match"),
    )
    ctx = StageContext(
        "evaluate", "evaluate", str(run_dir / "evaluate"), str(run_dir), str(run_dir)
    )
    metrics = run_evaluate(cfg, ctx)
    assert metrics["baseline"] == "sevens"
    assert metrics["results"] == [
        {
            "checkpoint": "sevens",
            "n": 3,
            "accuracy": 2 / 3,
            "mean_reward": 2 / 3,
            "pass_at_k": {"1": 2 / 3},
        }
    ]


def test_greedy_requests_to_an_openai_server_say_temperature_0_in_openais_fields(
    tmp_path: Path,
):
    """A served model (`backend: openai`, a server the stage did not start) gets greedy
    requests in OpenAI's own fields: temperature 0, top_p 1, no penalties, and no vLLM-only
    field, which OpenAI's API would refuse; the report says what was sent. (A vLLM server
    the stage starts runs with `--generation-config vllm` and is sent every field:
    tests/unit/test_collect_run.py.)"""
    import sys

    from stages.evaluate.run import run_evaluate
    from stages.lib.backends.openai import OpenAIBackend
    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench" / "collect"))
    from fake_server import start_in_thread

    handle = start_in_thread(capacity=4)
    handle.server.record_bodies = True
    handle.server.defaults = {"repetition_penalty": 1.05, "top_k": 20, "temperature": 0.7}
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = EvaluateConfig(
        input=str(data),
        output=str(tmp_path / "evaluate" / "report.json"),
        backend=OpenAIBackend(kind="openai", base_url=handle.url, model="fake"),
        verifier=Verifier(kind="exact_match"),
    )
    (tmp_path / "evaluate").mkdir()
    ctx = StageContext("evaluate", "evaluate", str(tmp_path / "evaluate"), str(tmp_path), "")
    try:
        run_evaluate(cfg, ctx)
    finally:
        handle.stop()
    greedy = {"temperature": 0.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    keys = {"top_k", "min_p", "repetition_penalty", *greedy}
    bodies = [{k: v for k, v in b.items() if k in keys} for b in handle.server.counters.bodies]
    assert bodies == [greedy] * len(ROWS)
    assert json.loads(Path(cfg.output).read_text())["sampling"] == greedy


def test_a_relative_baseline_resolves_against_the_pipeline_folder_like_its_checkpoints(
    tmp_path: Path,
):
    """`baseline: ckpt` names the same folder as `checkpoints: [ckpt]` from any working directory."""
    from tests.conftest import run_cli, stub_checkpoint

    folder = tmp_path / "pipes"
    for name in ("sft", "ckpt"):
        stub_checkpoint(folder / name)
    (folder / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (folder / "p.yaml").write_text(
        "name: p\nstages:\n  evaluate:\n    kind: evaluate\n"
        "    config: {input: prompts.jsonl, checkpoints: [sft, ckpt], baseline: ckpt}\n"
    )
    result = run_cli("plan", "pipes/p.yaml", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    config = json.loads(result.stdout)["stages"]["evaluate"]["config"]
    assert config["checkpoints"] == ["pipes/sft", "pipes/ckpt"]
    assert config["baseline"] == "pipes/ckpt"
