"""Environments with tools: OpenAI messages through the contract, the calculator as a function
tool, the HTTP protocol carrying the structured message, text-only environments unchanged."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from stages.lib.env.builtin import HTTPEnvironment, calculator, single_turn
from stages.lib.env.contract import open_episode, take_turn
from stages.lib.env.messages import Completion, EpisodeFailed, completion_of, messages_of, tools_of
from stages.lib.env.tools import TOOLS

CALCULATOR_TOOL = TOOLS["calculator"].schema

ROW = {"prompt": "What is 12 * 34?", "answer": "408"}


def exact(row: dict[str, Any], completion: str) -> float:
    return float(completion.strip() == row["answer"])


def call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def play(env: Any, answers: list[Any], row: dict[str, Any] = ROW, max_turns: int = 4) -> Any:
    async def run() -> Any:
        episode = await open_episode(env, row, 5.0)
        for answer in answers:
            if episode.done:
                break
            await take_turn(episode, answer, max_turns, 5.0)
        return episode

    return asyncio.run(run())


def test_the_calculator_offers_a_function_tool_and_answers_calls_with_tool_messages():
    server_message = {"content": "", "tool_calls": [call("calculator", {"expression": "12*34"})]}
    episode = play(calculator(exact), [server_message, "408"])
    assert episode.tools == [CALCULATOR_TOOL]
    assert episode.messages[1] == {"role": "assistant", "content": "", **server_message}
    assert episode.messages[2] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "calculator",
        "content": "result: 408",
    }
    assert episode.rewards == [0.0, 1.0] and episode.end == "done"
    assert episode.record()["tools"] == [CALCULATOR_TOOL]


def test_a_call_to_an_unknown_tool_or_with_bad_arguments_is_answered_not_crashed():
    calls = [call("search", {"q": "x"}), call("calculator", {"expr": "1"}, "call_1")]
    episode = play(calculator(exact), [{"content": "", "tool_calls": calls}])
    answers = [m["content"] for m in episode.messages[2:]]
    assert answers == [
        "error: no tool named 'search'; the tools are calculator",
        "error: the calculator takes {'expression': '<arithmetic>'}",
    ]
    assert [m["tool_call_id"] for m in episode.messages[2:]] == ["call_0", "call_1"]
    assert not episode.done and episode.error is None


def test_the_calculator_keeps_its_calc_line_for_a_template_without_tool_calls():
    episode = play(calculator(exact), ["calc: 12 * 34", "408"])
    assert episode.messages[2] == {"role": "user", "content": "result: 408"}
    assert episode.rewards == [0.0, 1.0]


def test_a_text_only_environment_gets_a_str_and_records_plain_messages():
    seen: list[Any] = []

    class Echo(single_turn):
        def step(self, messages: Any, completion: str) -> Any:
            seen.append(completion)
            return 1.0, None, True

    episode = play(Echo(exact), ["hello"])
    assert seen == ["hello"] and isinstance(seen[0], str)
    assert episode.messages[-1] == {"role": "assistant", "content": "hello"}
    assert episode.tools is None and "tools" not in episode.record()


def test_a_rows_tools_are_the_episodes_and_reset_may_return_its_own():
    tool = {"type": "function", "function": {"name": "lookup"}}
    episode = play(single_turn(exact), [], row={**ROW, "tools": [tool]})
    assert episode.tools == [
        {
            "type": "function",
            "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
        }
    ]

    class PerEpisode(single_turn):
        def reset(self, row: dict[str, Any]) -> Any:
            return {"messages": [{"role": "user", "content": "hi"}], "tools": [CALCULATOR_TOOL]}

    assert play(PerEpisode(exact), []).tools == [CALCULATOR_TOOL]


def test_messages_and_tools_are_checked_with_the_reason():
    with pytest.raises(EpisodeFailed, match="tool message without a 'tool_call_id'"):
        messages_of([{"role": "tool", "content": "1"}], "step")
    with pytest.raises(EpisodeFailed, match=r"tool_calls .* on a user message"):
        messages_of([{"role": "user", "content": "", "tool_calls": [call("f", {})]}], "step")
    with pytest.raises(EpisodeFailed, match="is not a function schema"):
        tools_of([{"type": "function"}], "reset")
    arguments_as_object = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    (message,) = messages_of([arguments_as_object], "step")
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == (
        '{"x": 1}'
    )


def test_a_completion_is_its_text_with_the_message_attached():
    done = completion_of("plain", None, 0)
    assert done == "plain" and done.tool_calls == [] and done.parse_error is None
    assert isinstance(done, str) and isinstance(done, Completion)


class _StepServer(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.path.endswith("/reset"):
            answer: dict[str, Any] = {
                "messages": [{"role": "user", "content": "go"}],
                "tools": [CALCULATOR_TOOL],
            }
        else:
            first = body["message"]["tool_calls"][0]
            answer = {
                "reward": 0.0,
                "observation": [{"role": "tool", "tool_call_id": first["id"], "content": "7"}],
                "done": False,
            }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_http_protocol_carries_tools_and_the_structured_message():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StepServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = HTTPEnvironment(f"http://127.0.0.1:{server.server_port}", 5.0)
        tool_call = {"content": "", "tool_calls": [call("calculator", {"expression": "3+4"})]}
        episode = play(env, [tool_call], max_turns=2)
    finally:
        server.shutdown()
        server.server_close()
    assert episode.tools == [CALCULATOR_TOOL]
    step = _StepServer.bodies[-1]
    assert step["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert step["completion"] == ""
    assert episode.messages[-1] == {"role": "tool", "tool_call_id": "call_0", "content": "7"}


def test_vllm_servers_start_with_the_templates_tool_call_parser(tmp_path):
    from stages.lib.backends.vllm.server import tool_call_args

    qwen, plain = tmp_path / "qwen", tmp_path / "plain"
    for folder, template in [(qwen, "{{ '<|im_start|>' }}"), (plain, "{{ '<|user|>' }}")]:
        folder.mkdir()
        (folder / "chat_template.jinja").write_text(template)
    assert tool_call_args(str(qwen)) == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    assert tool_call_args(str(plain)) == [] and tool_call_args("Qwen/Qwen2.5-0.5B") == []
    named = tool_call_args("Qwen/Qwen2.5-0.5B", "pythonic")  # the environment's setting wins
    assert named == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


@pytest.mark.parametrize(
    ("template", "refused"),
    [
        ("gemma", "use chat_template: gemma_tools"),
        ("mistral", "use chat_template: mistral_tools"),
        ("gemma_tools", None),
        ("chatml", None),
    ],
)
def test_validate_refuses_a_tool_environment_whose_template_cannot_render_tools(
    tmp_path, template, refused
):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n  s:\n    kind: rl\n    config:\n      input: d.jsonl\n"
        f"      environment: {{kind: calculator}}\n      chat_template: {template}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    if refused is None:
        assert "cannot render tools" not in out.stderr, out.stderr
    else:
        assert out.exit_code == 2
        assert (
            f"p.yaml:8:22: stages.s.config.chat_template: the chat template '{template}' cannot "
            f"render tools; {refused}"
        ) in out.stderr, out.stderr


def test_the_python_environment_answers_a_tool_call_from_the_sandbox():
    from stages.lib.env.builtin import BUILT_IN

    env = BUILT_IN["python"].factory(exact, wall_s=5.0)
    code = call("python", {"code": "print(6 * 7)"})
    episode = play(env, [{"content": "", "tool_calls": [code]}, "408"])
    assert episode.tools == [TOOLS["python"].schema]
    assert episode.messages[2]["role"] == "tool"
    assert episode.messages[2]["content"].strip() == "42"
    assert episode.rewards == [0.0, 1.0]


def test_text_is_parsed_into_tool_calls_by_the_episodes_format():
    async def run(text: str) -> Any:
        episode = await open_episode(calculator(exact), ROW, 5.0, "hermes")
        await take_turn(episode, text, 4, 5.0)
        return episode

    written = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    )
    episode = asyncio.run(run(written))
    assert episode.messages[1]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": '{"expression": "12*34"}',
    }
    assert episode.messages[2]["content"] == "result: 408" and episode.parse_errors == 0
    broken = asyncio.run(run('<tool_call>\n{"name": "calculator", "arguments": {</tool_call>'))
    assert broken.parse_errors == 1 and not broken.done
    assert broken.messages[1] == {"role": "assistant", "content": broken.messages[1]["content"]}
    assert broken.messages[2]["role"] == "user"
    assert broken.messages[2]["content"].startswith("error: your tool call:")


def test_tools_offered_at_run_time_to_a_template_that_cannot_render_them_are_refused():
    from types import SimpleNamespace

    from stages.lib.chat.clock import render
    from stages.lib.chat.template import template_text

    gemma = SimpleNamespace(chat_template=template_text("gemma"))
    with pytest.raises(ValueError, match="cannot render them; set the stage's chat_template: "):
        render(gemma, [{"role": "user", "content": "hi"}], tools=[CALCULATOR_TOOL])
