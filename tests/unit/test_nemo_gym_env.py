"""Environments of kind nemo_gym without NeMo Gym installed: Responses items read as chat
messages, the config's refusals, and collect's path through an agent (a stand-in for NeMo
Gym's head and agent servers at the edge: routes and answers as NeMo Gym 0.7.0's; the real
servers are in tests/integration/test_nemo_gym_env.py, marked `gym`)."""

from __future__ import annotations

import json
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine.stage import StageContext
from stages.collect import CollectConfig, io
from stages.collect.run import run_collect
from stages.lib.env.gym import overrides
from stages.lib.env.responses import agent_episode, run_body
from stages.lib.net import free_port
from tests.conftest import run_cli, stub_checkpoint

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
ROW = {
    "responses_create_params": {
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "weather in sf?"},
        ],
        "tools": [TOOL],
        "temperature": 1.0,
    },
    "expected": "sf",
}


def result(reward: float, **extra: Any) -> dict[str, Any]:
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city": "sf"}',
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    output = {"type": "function_call_output", "call_id": "c1", "output": "cold"}
    message = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "It is cold."}],
        "prompt_token_ids": [1, 2, 3, 9],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.1, -0.2],
    }
    usage = {"input_tokens": 6, "output_tokens": 3}
    response = {"output": [call, output, message], "usage": usage}
    return {"response": response, "reward": reward, "failure_kind": None, **extra}


def test_a_run_result_reads_as_chat_messages_with_tool_calls_and_tool_answers():
    episode = agent_episode(ROW, result(1.0))
    assert episode.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in sf?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "assistant", "content": "It is cold."},
    ]
    assert episode.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert (episode.turns, episode.usage, episode.solved) == (2, (6, 3), True)
    assert [t["generation_token_ids"] for t in episode.token_turns] == [[3], [4, 5]]
    record = episode.record()
    assert (record["rewards"], record["end"], record["turns"]) == ([1.0], "done", 2)


def test_a_failed_run_is_a_failed_episode_and_a_masked_one_says_so():
    record = agent_episode(
        ROW, result(0.0, failure_kind="timeout", failure_reason="slow", mask_sample=True)
    ).record()
    assert (record["end"], record["error"], record["solved"]) == ("failed", "timeout: slow", False)
    assert record["mask_sample"] is True
    with pytest.raises(ValueError, match="not a run result"):
        agent_episode(ROW, {"reward": 1.0})


def test_the_stages_sampling_replaces_the_rows_and_a_row_without_input_is_refused():
    body = json.loads(run_body(ROW, {"temperature": 0.5, "max_output_tokens": 8}))
    assert body["responses_create_params"]["temperature"] == 0.5
    assert body["responses_create_params"]["max_output_tokens"] == 8
    assert body["expected"] == "sf" and body["responses_create_params"]["tools"] == [TOOL]
    with pytest.raises(ValueError, match="'responses_create_params' with its 'input'"):
        run_body({"prompt": "hi"}, {})


def test_config_overrides_are_dotted_for_nemo_gyms_command_line():
    assert overrides({"a": {"b": {"max_steps": 3}}, "c": "x"}) == [
        "++a.b.max_steps=3",
        '++c="x"',
    ]


def test_validate_refuses_what_a_nemo_gym_environment_cannot_run(tmp_path: Path):
    stub_checkpoint(tmp_path / "m")
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              a: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, environment: {kind: nemo_gym, config_paths: [c.yaml]}}}
              b: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, environment: {kind: nemo_gym, agent: g, config_paths: [c.yaml], head: "h:1", max_turns: 2}}}
              c: {kind: evaluate, config: {input: x.jsonl, checkpoints: [m], backend: {kind: local}, environment: {kind: calculator, agent: g}}}
              d: {kind: rl, config: {model: m, input: x.jsonl, eval_input: x.jsonl, multi_turn_tokens: rerender, environment: {kind: nemo_gym, agent: g, config_paths: [c.yaml]}}}
            """
        )
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[:4] == [
        "p.yaml:3:101: stages.a.config.environment.kind: kind nemo_gym needs 'agent': the agent "
        "server each row is sent to, as its configs name it",
        "p.yaml:4:101: stages.b.config.environment.kind: kind nemo_gym needs exactly one of "
        "'config_paths' (pipe starts NeMo Gym's servers) or 'head' (they run already: "
        "host:port of the head server)",
        "p.yaml:4:169: stages.b.config.environment.max_turns: NeMo Gym's agent decides when an "
        "episode ends (its config's max_steps): remove max_turns, or set the agent's max_steps "
        "through 'config'",
        "p.yaml:5:129: stages.c.config.environment.agent: 'agent' is for kind nemo_gym (this is "
        "calculator)",
    ]
    assert sorted(lines[4:]) == [
        "p.yaml:6:64: stages.d.config.eval_input: with NeMo Gym's agent playing the episodes, "
        "held-out episodes are scored by an evaluate stage on the rl stage's checkpoint "
        "(environment kind nemo_gym there too): leave eval_input out",
        "p.yaml:6:92: stages.d.config.multi_turn_tokens: NeMo Gym's agent asks every turn "
        "itself; the endpoint serving it extends each turn's sampled ids (token in, token "
        "out), so this would act on nothing: remove it",
    ]


class Gym:
    """NeMo Gym's head and one agent at the edge, in a thread: the head lists the agent and
    names the policy; `/run` answers each row's `expected` city with reward 1.0, a row asking
    for it fails once with 503, and a `broken` row gets a body that is not JSON."""

    def __init__(self, policy: str) -> None:
        self.policy, self.port = policy, free_port()
        self.seen: list[dict[str, Any]] = []
        self.flaky_left = 1
        self.ready = threading.Event()

    @property
    def head(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def instances(self, _: web.Request) -> web.Response:
        url = f"http://127.0.0.1:{self.port}"
        agent = {"process_name": "weather_agent", "name": "simple_agent", "url": url}
        return web.json_response([agent, {"process_name": "m", "name": "vllm_model"}])

    async def config(self, _: web.Request) -> web.Response:
        return web.json_response(f"policy_base_url: {self.policy}\npolicy_model_name: m\n")

    async def run(self, request: web.Request) -> web.Response:
        row = await request.json()
        self.seen.append(row)
        if row.get("flaky") and self.flaky_left:
            self.flaky_left -= 1
            return web.Response(status=503, text="busy")
        if row.get("broken"):
            return web.Response(text="<html>")
        out = result(1.0 if row["expected"] == "sf" else 0.0)
        return web.json_response(out)

    def serve(self) -> Iterator[Gym]:
        import asyncio

        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/server_instances", self.instances)
        app.router.add_get("/global_config_dict_yaml", self.config)
        app.router.add_post("/run", self.run)
        runner = web.AppRunner(app)

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            self.ready.set()
            loop.run_forever()

        thread = threading.Thread(target=main, daemon=True)
        thread.start()
        assert self.ready.wait(10)
        yield self
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


POLICY = "http://127.0.0.1:9/v1"


@pytest.fixture
def gym() -> Iterator[Gym]:
    yield from Gym(POLICY).serve()


def collect_config(tmp_path: Path, head: str, base_url: str = POLICY) -> CollectConfig:
    rows = [dict(ROW, expected=c) for c in ("sf", "nyc")]
    rows += [dict(ROW, flaky=True), dict(ROW, broken=True)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    environment = {"kind": "nemo_gym", "agent": "weather_agent", "head": head}
    return CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(tmp_path / "episodes.jsonl"),
            "backend": {"kind": "openai", "base_url": base_url, "model": "m"},
            "environment": environment,
            "temperature": 0.5,
            "max_retries": 1,
            "backoff_s": 0.01,
            "num_samples_in_parallel": 2,
        },
        strict=False,
    )


def ctx(tmp_path: Path) -> StageContext:
    return StageContext("collect", "collect", str(tmp_path), str(tmp_path), str(tmp_path))


def test_collect_sends_every_row_to_the_agent_and_writes_its_episodes(tmp_path: Path, gym: Gym):
    cfg = collect_config(tmp_path, gym.head)
    metrics = run_collect(cfg, ctx(tmp_path))
    assert (metrics["written"], metrics["failures"], metrics["retries"]) == (3, 1, 2)
    rows = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    assert [(r["prompt_idx"], r["reward"], r["turns"]) for r in rows] == [
        (0, 1.0, 2),
        (1, 0.0, 2),
        (2, 1.0, 2),  # after one 503, retried
    ]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "It is cold."}
    assert all(s["responses_create_params"]["temperature"] == 0.5 for s in gym.seen)
    failures = [json.loads(x) for x in Path(io.failures_path(cfg.output)).read_text().splitlines()]
    assert [(f["prompt_idx"], f["error_kind"]) for f in failures] == [(3, "bad_response")]


def test_servers_already_running_must_call_the_stages_backend(tmp_path: Path, gym: Gym):
    cfg = collect_config(tmp_path, gym.head, base_url="http://127.0.0.1:8/v1")
    with pytest.raises(ValueError, match=r"call the policy at http://127\.0\.0\.1:9/v1, not the"):
        run_collect(cfg, ctx(tmp_path))
    assert gym.seen == []
