"""NeMo Gym's own servers, unchanged, calling pipe's policy endpoint (`stages.lib.serve`).

`ng_run` (from `.venv-gym/`, `make install-gym`) starts example_single_tool_call's resources
server, its simple_agent, the legacy environment server and NeMo Gym's `vllm_model` server
(with `return_token_id_information: true`, as for training), the policy pointed at a
`PolicyServer` in this process. One row goes to the agent's `/run`: the model's turn must
come back to NeMo Gym as a structured tool call, the tool answers, the model answers in text,
and the Responses object comes back with a reward and each turn's token ids, the second
turn's prompt extending the first turn's ids (NeMo RL's contiguity check).

The model is scripted at the edge (the ChatML family's tokenizer; a hermes call when the
prompt holds no tool answer yet, then a sentence), since a random model writes no call.
Every server runs from the one venv (`+skip_venv_if_present=true +uv_venv_dir=...`: uv
cannot fetch an interpreter offline). Skipped without `.venv-gym/`. Every wait is bounded;
`ng_run` is stopped by its PID (SIGINT: it stops its servers and its Ray cluster), then its
process group, which this test made, if anything is left.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.lib.chat.tool_calls import format_tool_calls
from stages.lib.env.gym import gym_venv, stop_ng_run
from stages.lib.model.generate import Generation
from stages.lib.net import free_port
from stages.lib.serve.policy import PolicyServer

GYM = gym_venv()  # .venv-gym/, or $PIPE_GYM_VENV
SITE = next(GYM.glob("lib/python3*/site-packages"), GYM)
CONFIGS = (
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
)
SERVERS = (  # the server folders those configs name: each one's venv is the one venv
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
    "responses_api_models/vllm_model",
)
READY_S, RUN_S = 300, 120

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gym,
    pytest.mark.skipif(
        not (GYM / "bin" / "ng_run").exists(), reason="no .venv-gym/ (make install-gym)"
    ),
]


class Scripted:
    """A hermes call of get_weather until the prompt holds the tool's answer, then text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts: list[Any], sampling: Any) -> list[Generation]:
        out = []
        for p in prompts:
            if "<tool_response>" in self.tok.decode(p.ids):
                text = "It is cold in sf."
            else:
                call = {"function": {"name": "get_weather", "arguments": '{"city": "sf"}'}}
                text = format_tool_calls([call], "hermes")
            ids = [*self.tok.encode(text, add_special_tokens=False), self.end]
            decoded = self.tok.decode(ids, skip_special_tokens=True)
            lps = (-0.25,) * len(ids)
            out.append(Generation(decoded, "stop", len(p.ids), len(ids), tuple(ids), lps, p.ids))
        return out


def get(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: Any, timeout: float) -> Any:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture
def gym(tmp_path: Path, family_checkpoint: Any) -> Iterator[tuple[str, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_checkpoint("chatml"))
    for folder in SERVERS:
        (tmp_path / "venvs" / folder).mkdir(parents=True)
        (tmp_path / "venvs" / folder / ".venv").symlink_to(GYM)
    head = free_port()
    with PolicyServer(Scripted(tok), tok, name="tiny", api_key="k3y") as server:
        log = (tmp_path / "ng_run.log").open("wb")
        command = [
            str(GYM / "bin" / "ng_run"),
            f"+config_paths=[{','.join(CONFIGS)}]",
            f"+policy_base_url={server.base_url}",
            "+policy_api_key=k3y",
            "+policy_model_name=tiny",
            "+skip_venv_if_present=true",
            f"+uv_venv_dir={tmp_path / 'venvs'}",
            "+head_server.host=127.0.0.1",
            f"+head_server.port={head}",
        ]
        process = subprocess.Popen(
            command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield wait_for_agent(process, head, tmp_path / "ng_run.log"), tok
        finally:
            stop_ng_run(process)  # the group start_new_session made: ours
            log.close()


def wait_for_agent(process: subprocess.Popen[bytes], head: int, log: Path) -> str:
    """The agent's URL once ng_run says every server is ready (at most READY_S)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ng_run exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if b"servers ready!" in log.read_bytes():
            servers = get(f"http://127.0.0.1:{head}/server_instances")
            return next(s["url"] for s in servers if s["name"] == "simple_agent")
        time.sleep(1)
    pytest.fail(f"NeMo Gym's servers not ready after {READY_S}s:\n{log.read_text()[-3000:]}")


def test_nemo_gyms_agent_runs_a_tool_call_episode_against_the_policy_endpoint(gym):
    agent, _ = gym
    rows = SITE / "resources_servers/example_single_tool_call/data/example.jsonl"
    row = json.loads(rows.read_text().splitlines()[0])
    out = post(f"{agent}/run", row, RUN_S)
    assert out["reward"] == 1.0 and out["failure_kind"] is None
    call, answer, message = out["response"]["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "get_weather",
        {"city": "sf"},
    )
    assert answer["type"] == "function_call_output" and answer["call_id"] == call["call_id"]
    assert message["type"] == "message"
    assert message["content"][0]["text"] == "It is cold in sf."
    for turn in (call, message):  # the token ids NeMo RL trains on, from /tokenize and logprobs
        assert len(turn["generation_token_ids"]) == len(turn["generation_log_probs"]) > 0
        assert turn["generation_log_probs"] == [-0.25] * len(turn["generation_log_probs"])
    seen = call["prompt_token_ids"] + call["generation_token_ids"]
    assert message["prompt_token_ids"][: len(seen)] == seen
