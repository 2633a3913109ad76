"""The evaluate stage with an environment: episodes per checkpoint, the report's episode
fields, failures counted below the threshold and fatal above it, and the HTTP backend."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext
from stages.evaluate import EvaluateConfig
from stages.evaluate.run import evaluate_checkpoints, run_evaluate
from stages.lib.backends.openai import OpenAIBackend
from stages.lib.config import Verifier
from stages.lib.env.field import EnvironmentConfig
from tests.unit.test_evaluate import ROWS, _config, _exact, run_dir  # noqa: F401  (a fixture)

EXACT = Verifier(kind="exact_match")


class SecondChance:
    """Never takes the first answer; scores the second exactly against the row's answer."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[dict[str, str]], completion: str) -> tuple[float, Any, bool]:
        if len(messages) == 1:
            return 0.0, [{"role": "user", "content": "again"}], False
        return _exact(self.row, completion), None, True


class Broken(SecondChance):
    """Breaks on the row '1 + 1 =' (raises, or answers a NaN reward, as `fault` says)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def step(self, messages: list[dict[str, str]], completion: str) -> tuple[float, Any, bool]:
        if self.row["prompt"] != "1 + 1 =":
            return super().step(messages, completion)
        if self.fault == "raise":
            raise KeyError("scorer")
        return math.nan, None, True


def _read(run: Path) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    folder = run / "evaluate"
    lines = (folder / "generations.jsonl").read_text().splitlines()
    report = json.loads((folder / "report.json").read_text())
    return report, (folder / "report.md").read_text(), [json.loads(x) for x in lines]


def test_retry_episodes_report_success_first_turn_turns_and_reward(run_dir: Path) -> None:  # noqa: F811
    sevens, stops = run_dir / "sevens" / "checkpoint", run_dir / "stops" / "checkpoint"
    cfg = _config(run_dir, verifier=EXACT, environment=EnvironmentConfig(kind="retry"))
    metrics = evaluate_checkpoints(
        cfg, [str(sevens), str(stops)], str(stops), ROWS, _exact, str(run_dir)
    )
    report, md, gens = _read(run_dir)
    # "stops" answers "" twice on every row; "sevens" answers "77", right on 3 of 4 rows at
    # once, and twice wrong on "1 + 1 =": rewards [1], [1], [-0.5, -0.5], [1]
    assert report.pop("sampling")["temperature"] == 0.0  # greedy (test_evaluate: its shape)
    assert report == {
        "baseline": "stops",
        "checkpoints": {"stops": str(stops), "sevens": str(sevens)},
        "results": [
            {"checkpoint": "stops", "n": 4, "accuracy": 0.0, "mean_reward": -0.5,
             "pass_at_k": {"1": 0.0}, "first_turn_accuracy": 0.0, "mean_turns": 2.0,
             "mean_total_reward": -1.0, "failed_episodes": 0},
            {"checkpoint": "sevens", "n": 4, "accuracy": 0.75, "mean_reward": 0.4,
             "pass_at_k": {"1": 0.75}, "first_turn_accuracy": 0.75, "mean_turns": 1.25,
             "mean_total_reward": 0.5, "failed_episodes": 0},
        ],
    }  # fmt: skip
    assert metrics["accuracy_delta"] == {"stops": 0.0, "sevens": 0.75}
    assert metrics["first_turn_accuracy_delta"] == {"stops": 0.0, "sevens": 0.75}
    assert md.splitlines()[2:6] == [
        "| checkpoint | n | accuracy | Δ accuracy | mean reward | Δ mean reward | pass@1 "
        "| first-turn accuracy | Δ first-turn accuracy | mean turns | mean total reward "
        "| failed episodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| `stops` | 4 | 0.000 | +0.0 pts | -0.500 | +0.000 | 0.000 "
        "| 0.000 | +0.0 pts | 2.00 | -1.000 | 0 |",
        "| `sevens` | 4 | 0.750 | +75.0 pts | 0.400 | +0.900 | 0.750 "
        "| 0.750 | +75.0 pts | 1.25 | 0.500 | 0 |",
    ]
    assert (run_dir / "evaluate" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(gens) == 8  # one row per episode
    assert gens[6] == {
        "checkpoint": "sevens", "prompt_idx": 2, "sample_idx": 0,
        "messages": [
            {"role": "user", "content": "1 + 1 ="},
            {"role": "assistant", "content": "77"},
            {"role": "user", "content": "wrong, try again"},
            {"role": "assistant", "content": "77"},
        ],
        "rewards": [-0.5, -0.5], "total_reward": -1.0, "turns": 2, "solved": False,
        "end": "max_turns", "answer": "2",
    }  # fmt: skip


def test_a_users_environment_solves_at_the_second_turn_within_max_turns(run_dir: Path) -> None:  # noqa: F811
    sevens = str(run_dir / "sevens" / "checkpoint")
    env = EnvironmentConfig(kind=f"{__name__}:SecondChance", max_turns=3)
    cfg = _config(run_dir, environment=env, num_samples=2, temperature=1.0)
    evaluate_checkpoints(cfg, [sevens], None, ROWS, _exact, str(run_dir))
    report, _, gens = _read(run_dir)
    (line,) = report["results"]
    # whatever it samples, the rigged model answers "77": solved at turn 2 on 3 rows of 4
    assert line["accuracy"] == 0.75 > line["first_turn_accuracy"] == 0.0
    assert (line["mean_turns"], line["mean_total_reward"]) == (2.0, 0.75)
    assert line["pass_at_k"] == {"1": 0.75, "2": 0.75}
    assert [(g["prompt_idx"], g["sample_idx"]) for g in gens] == [
        (p, s) for p in range(4) for s in range(2)
    ]
    assert all(1 <= g["turns"] <= 3 and g["end"] == "done" for g in gens)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("raise", "step raised KeyError: 'scorer'"),
        ("nan", "step returned the reward nan: expected a finite number"),
    ],
)
def test_broken_episodes_are_counted_below_the_threshold(
    run_dir: Path,  # noqa: F811
    fault: str,
    reason: str,
) -> None:
    sevens = str(run_dir / "sevens" / "checkpoint")
    env = EnvironmentConfig(
        kind=f"{__name__}:Broken", max_turns=2, config={"fault": fault}, max_failed_share=0.25
    )
    evaluate_checkpoints(
        _config(run_dir, environment=env), [sevens], None, ROWS, _exact, str(run_dir)
    )
    report, md, gens = _read(run_dir)
    (line,) = report["results"]
    # the broken episode ends at its first step, with no reward and no turn counted
    assert (line["failed_episodes"], line["accuracy"], line["mean_turns"]) == (1, 0.75, 1.5)
    assert [g.get("error") for g in gens] == [None, None, reason, None]
    assert gens[2]["end"] == "failed"
    assert md.splitlines()[4].endswith("| 1.50 | 0.750 | 1 |")


def test_broken_episodes_above_the_threshold_fail_the_stage(run_dir: Path) -> None:  # noqa: F811
    sevens = str(run_dir / "sevens" / "checkpoint")
    env = EnvironmentConfig(kind=f"{__name__}:Broken", max_turns=2, config={"fault": "raise"})
    with pytest.raises(RuntimeError) as err:
        evaluate_checkpoints(
            _config(run_dir, environment=env), [sevens], None, ROWS, _exact, str(run_dir)
        )
    assert str(err.value) == (
        "evaluate 'sevens': 1 of 4 episodes failed (25%), above "
        "environment.max_failed_share (10%); the first reasons are in the log"
    )


# --- an OpenAI-compatible server in this process -----------------------------------------


@pytest.fixture
def chat_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A chat endpoint answering "7" to a conversation's first turn and "77" after."""
    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        text = "7" if len(body["messages"]) == 1 else "77"
        choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return web.json_response({"choices": [choice], "usage": {}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_a_served_model_plays_each_episode_over_http(
    tmp_path: Path, chat_server: tuple[str, list[dict[str, Any]]]
) -> None:
    url, seen = chat_server
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = EvaluateConfig(
        input=str(data),
        output=str(tmp_path / "evaluate" / "report.json"),
        backend=OpenAIBackend(kind="openai", base_url=url, model="served"),
        verifier=EXACT,
        environment=EnvironmentConfig(kind="retry"),
    )
    ctx = StageContext(
        "evaluate", "evaluate", str(tmp_path / "evaluate"), str(tmp_path), str(tmp_path)
    )
    (tmp_path / "evaluate").mkdir()
    (line,) = run_evaluate(cfg, ctx)["results"]
    # "7" is wrong everywhere; "77" right on 3 rows: rewards [-0.5, 1] x 3 and [-0.5, -0.5]
    assert line == {
        "checkpoint": "served", "n": 4, "accuracy": 0.75, "mean_reward": 0.0625,
        "pass_at_k": {"1": 0.75}, "first_turn_accuracy": 0.0, "mean_turns": 2.0,
        "mean_total_reward": 0.125, "failed_episodes": 0,
    }  # fmt: skip
    assert len(seen) == 8
    assert len({b["seed"] for b in seen}) == 8
    assert {(b["model"], b["temperature"], b["max_tokens"]) for b in seen} == {("served", 0.0, 64)}
    neutral = ("top_p", "presence_penalty", "frequency_penalty")  # an openai server: its fields
    assert {tuple(b[k] for k in neutral) for b in seen} == {(1.0, 0.0, 0.0)}
    assert not any({"top_k", "min_p", "repetition_penalty"} & set(b) for b in seen)
    assert {json.dumps(b["messages"]) for b in seen if len(b["messages"]) == 3} == {
        json.dumps(
            [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "wrong, try again"},
            ]
        )
        for r in ROWS
    }


def test_episodes_refuse_the_completions_endpoint(tmp_path: Path) -> None:
    cfg = EvaluateConfig(
        output=str(tmp_path / "report.json"),
        backend=OpenAIBackend(
            kind="openai", base_url="http://x/v1", model="m", endpoint="completions"
        ),
        environment=EnvironmentConfig(kind="retry"),
    )
    with pytest.raises(ValueError) as err:
        evaluate_checkpoints(cfg, ["m"], None, ROWS, _exact, str(tmp_path))
    assert str(err.value) == (
        "evaluate: backend.endpoint: an environment's episodes are conversations, sent to the "
        "chat endpoint: set it to 'chat', found 'completions'"
    )
