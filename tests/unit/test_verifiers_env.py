"""`environment: {kind: verifiers}`: a verifiers 0.4.0 taskset behind pipe's environment
contract, served by the bridge from `.venv-verifiers` (docs/rl/verifiers.md).

The plan-time refusals run without verifiers. The `verifiers` tests start the real bridge
(`stages/lib/env/verifiers_bridge.py`) on tasksets written here against verifiers' own
classes (`tests/verifiers_envs/`: a single-turn task with a reward, a task with a python tool
and a stop predicate) and play episodes through `HTTPEnvironment` with scripted model turns;
they skip without `.venv-verifiers` (`make install-verifiers`).
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stages.lib.env import served as served_module
from stages.lib.env.contract import Episode, environments, open_episode, take_turn
from stages.lib.env.field import EnvironmentConfig
from tests.conftest import ROOT, run_cli

ENVS = ROOT / "tests" / "verifiers_envs"
needs_venv = pytest.mark.skipif(
    not Path(
        os.environ.get(served_module.PYTHON_ENV) or ROOT / ".venv-verifiers" / "bin" / "python"
    ).exists(),
    reason="needs verifiers' venv: make install-verifiers (or $PIPE_VERIFIERS_PYTHON)",
)


def _validate(tmp_path: Path, environment: str, extra: str = "") -> tuple[int, list[str]]:
    text = f"""\
        name: p
        stages:
          r: {{kind: rl, config: {{input: x.jsonl, {extra}environment: {environment}}}}}
        """
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    return result.exit_code, [line for line in result.output.splitlines() if "p.yaml:" in line]


def test_verifiers_needs_an_env_id(tmp_path: Path) -> None:
    code, lines = _validate(tmp_path, "{kind: verifiers, max_turns: 2}")
    assert code == 2
    assert lines == [
        "p.yaml:3:62: stages.r.config.environment.kind: kind 'verifiers' needs 'env_id': the "
        "taskset to load (a module or an installed package exporting one verifiers Taskset "
        "subclass)"
    ]


def test_env_id_belongs_to_verifiers_only(tmp_path: Path) -> None:
    code, lines = _validate(tmp_path, "{kind: retry, env_id: my_tasks}")
    assert code == 2
    assert lines == [
        "p.yaml:3:77: stages.r.config.environment.env_id: 'env_id' is for kind 'verifiers' only"
    ]


def test_a_verifiers_taskset_scores_itself_and_needs_a_bound(tmp_path: Path) -> None:
    code, lines = _validate(
        tmp_path, "{kind: verifiers, env_id: my_tasks}", "verifier: {kind: exact_match}, "
    )
    assert code == 2
    assert lines == [
        "p.yaml:3:59: stages.r.config.verifier.kind: the environment (p.yaml:3:93) scores the "
        "episodes itself, so this verifier would be ignored: remove it (the built-in "
        "environments single_turn, retry, calculator and python are the ones scored by the "
        "verifier)",
        "p.yaml:3:93: stages.r.config.environment.kind: an environment of your own (kind "
        "'module:Class', verifiers or url) needs 'max_turns': it decides when an episode is "
        "done, so the stage needs a bound",
    ]


def test_a_missing_venv_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(served_module.PYTHON_ENV, raising=False)
    monkeypatch.setattr(served_module, "REPO", tmp_path)
    cfg = EnvironmentConfig(kind="verifiers", env_id="vf_arith", max_turns=1)
    with pytest.raises(RuntimeError) as err, environments(cfg, None):
        pass
    assert str(err.value) == (
        f"environment kind 'verifiers' runs in verifiers' own venv, and {tmp_path}/.venv-verifiers "
        "is missing: run `make install-verifiers` (or set $PIPE_VERIFIERS_PYTHON to an "
        "interpreter with verifiers 0.4.0)"
    )


# -- through the bridge ---------------------------------------------------------------------


def _config(env_id: str, max_turns: int, **config: Any) -> EnvironmentConfig:
    return EnvironmentConfig(
        kind="verifiers", env_id=env_id, max_turns=max_turns, config=config, timeout_s=30
    )


async def _play(make_env: Any, row: dict[str, Any], turns: list[str], bound: int) -> Episode:
    episode = await open_episode(make_env(), row, 30, parser="hermes")
    for text in turns:
        if episode.done:
            break
        await take_turn(episode, text, bound, 30)
    return episode


def _call(name: str, **arguments: int) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.verifiers
@needs_venv
def test_a_single_turn_taskset_is_scored_by_its_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ENVS))
    row = {"prompt_idx": 0, "prompt": "2 + 3 = ?", "answer": "5"}
    with environments(_config("vf_arith", 1, n=2), None) as make_env:
        proc = make_env.proc
        right = asyncio.run(_play(make_env, row, ["5"], 1))
        wrong = asyncio.run(_play(make_env, row, ["6"], 1))
    assert proc.poll() is not None  # stopped with the block
    assert right.messages == [
        {"role": "user", "content": "2 + 3 = ?"},
        {"role": "assistant", "content": "5"},
    ]
    assert (right.rewards, right.end, right.solved) == ([1.0], "done", True)
    assert (wrong.rewards, wrong.end, wrong.solved) == ([0.0], "done", False)


@pytest.mark.verifiers
@needs_venv
def test_a_tool_taskset_answers_calls_and_stops_on_its_predicate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ENVS))
    row = {"prompt": "6 * 7?", "answer": "42"}
    with pytest.raises(KeyboardInterrupt), environments(_config("vf_tools", 6), None) as make_env:
        proc = make_env.proc
        solved = asyncio.run(_play(make_env, row, [_call("multiply", a=6, b=7), "42"], 6))
        bad_args = asyncio.run(_play(make_env, row, [_call("multiply", a=6), "41"], 6))
        stopped = asyncio.run(_play(make_env, row, [_call("multiply", a=1, b=1)] * 5, 6))
        raise KeyboardInterrupt  # Ctrl-C in the stage: the bridge stops too
    assert proc.poll() is not None
    assert solved.tools == [
        {
            "type": "function",
            "function": {
                "name": "multiply",
                "description": "Multiply two integers.",
                "parameters": {
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "type": "object",
                },
            },
        }
    ]
    call_id = solved.messages[1]["tool_calls"][0]["id"]
    assert solved.messages[2] == {"role": "tool", "tool_call_id": call_id, "content": "42"}
    assert (solved.rewards, solved.end, solved.solved) == ([0.0, 1.0], "done", True)
    assert bad_args.messages[2]["content"].startswith("error: TypeError: ")
    assert (bad_args.rewards, bad_args.solved) == ([0.0, 0.0], False)
    # the task's @vf.stop: at most 3 tool results (its config's max_calls), then scored
    assert (stopped.rewards, stopped.end, stopped.turns) == ([0.0, 0.0, 0.0], "done", 3)


@pytest.mark.verifiers
@pytest.mark.slow
@needs_venv
def test_collect_plays_a_taskset_with_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collect stage with the local backend: one episode per (row, sample), scored by
    the taskset's reward; the bridge it started is gone when the stage returns."""
    pytest.importorskip("torch")
    import psutil

    from stages.collect.run import run_collect
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from tests.unit.test_collect_env import config, ctx

    monkeypatch.setenv("PYTHONPATH", str(ENVS))
    rows = [{"prompt": f"{i} + {i + 1} = ?", "answer": str(2 * i + 1)} for i in range(4)]
    build_tiny_model(
        TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300),
        [f"{r['prompt']} {r['answer']}" for r in rows] * 5,
        str(tmp_path / "m"),
        seed=0,
    )
    local = {"kind": "local", "model": str(tmp_path / "m"), "batch_size": 4}
    env = {"kind": "verifiers", "env_id": "vf_arith", "max_turns": 1}
    cfg = config(tmp_path, "", backend=local, environment=env, verifier={}, max_output_tokens=4)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = run_collect(cfg, ctx(tmp_path))
    got = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    assert metrics["written"] == 8 and metrics["episodes"]["failed"] == 0
    for r in got:
        reply = r["messages"][1]["content"].strip()
        assert r["messages"][0] == {"role": "user", "content": rows[r["prompt_idx"]]["prompt"]}
        assert r["rewards"] == [float(reply == r["answer"])] and r["end"] == "done"
    bridges = [
        p
        for p in psutil.Process().children(recursive=True)
        if "verifiers_bridge" in " ".join(p.cmdline())
    ]
    assert bridges == []
