"""The policy endpoint (`stages.lib.serve`): a model in memory served over HTTP as vLLM's
OpenAI server answers, what NeMo Gym's `vllm_model` server calls.

The server runs for real in its thread, on a free loopback port; requests go over HTTP. The
model is the ChatML family's test checkpoint (a template that renders tools, hermes calls).
Where a test needs the model to write a tool call, the engine is scripted at the edge: it
answers given token ids, as a model would have written them.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from stages.lib.chat.prompt import ChatPrompt, prompt_ids
from stages.lib.chat.tool_calls import format_tool_calls
from stages.lib.model.generate import Generation
from stages.lib.serve.batcher import local_engine
from stages.lib.serve.policy import PolicyServer, model_len
from stages.lib.serve.wire import Sampling
from tests.families import FAMILIES, family_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather_of_a_city_3f9c",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def loaded(family_checkpoint: Any) -> tuple[Any, Any]:
    from stages.lib.model.generate import load

    return load(str(family_checkpoint("chatml")))


def post(url: str, body: Any, key: str | None = None) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Scripted:
    """The engine at the edge: every prompt answered with `answer` (token ids), after `delay_s`."""

    def __init__(self, tokenizer: Any, answer: list[int], delay_s: float = 0.0) -> None:
        self.tokenizer, self.answer, self.delay_s = tokenizer, answer, delay_s
        self.calls: list[tuple[list[Any], Sampling]] = []

    def __call__(self, prompts: list[Any], sampling: Sampling) -> list[Generation]:
        self.calls.append((prompts, sampling))
        time.sleep(self.delay_s)
        text = self.tokenizer.decode(self.answer, skip_special_tokens=True)
        n = len(self.answer)
        return [
            Generation(text, "stop", len(p.ids), n, tuple(self.answer), (-0.5,) * n, tuple(p.ids))
            for p in prompts
        ]


@pytest.fixture(scope="module")
def served(loaded: tuple[Any, Any]) -> Iterator[PolicyServer]:
    model, tokenizer = loaded
    server = PolicyServer(
        local_engine(model, tokenizer),
        tokenizer,
        name="tiny",
        max_model_len=model_len(model, tokenizer),
    )
    with server:
        yield server


def scripted_server(tokenizer: Any, answer: list[int], **kw: Any) -> tuple[PolicyServer, Scripted]:
    engine = Scripted(tokenizer, answer, kw.pop("delay_s", 0.0))
    return PolicyServer(engine, tokenizer, name="scripted", **kw), engine


def test_a_chat_answer_carries_its_token_ids_and_the_models_logprobs(served, loaded):
    """Greedy: the ids in `logprobs.content` (`token_id:<id>`) are the answer's, decode to its
    text, and their log-probs are the model's own on the prompt's ids then the answer's."""
    import torch

    model, tok = loaded
    body = {
        "model": "tiny",
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    status, out = post(served.base_url + "/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    ids = [int(e["token"].removeprefix("token_id:")) for e in choice["logprobs"]["content"]]
    assert ids == choice["token_ids"] and len(ids) == out["usage"]["completion_tokens"] > 0
    assert choice["message"]["content"] == tok.decode(ids, skip_special_tokens=True)
    prompt = prompt_ids(tok, ASK)
    assert out["prompt_token_ids"] == prompt and out["usage"]["prompt_tokens"] == len(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    served_lps = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
    assert torch.allclose(served_lps, expected, atol=1e-4)
    status, tokenized = post(served.base_url.removesuffix("/v1") + "/tokenize", {"messages": ASK})
    assert status == 200 and tokenized["tokens"] == prompt and tokenized["count"] == len(prompt)


def test_tools_are_rendered_into_the_prompt_as_the_chat_template_writes_them(served, loaded):
    _, tok = loaded
    url = served.base_url.removesuffix("/v1") + "/tokenize"
    _, with_tools = post(url, {"model": "tiny", "messages": ASK, "tools": [WEATHER]})
    _, without = post(url, {"model": "tiny", "messages": ASK})
    assert "weather_of_a_city_3f9c" in tok.decode(with_tools["tokens"])
    assert "weather_of_a_city_3f9c" not in tok.decode(without["tokens"])
    assert with_tools["tokens"] == prompt_ids(tok, ChatPrompt(tuple(ASK), (WEATHER,)))
    status, out = post(
        served.base_url + "/chat/completions",
        {"messages": ASK, "tools": [WEATHER], "max_tokens": 2, "return_token_ids": True},
    )
    assert status == 200 and out["prompt_token_ids"] == with_tools["tokens"]
    _, models = post_get(served.base_url + "/models")
    assert [m["id"] for m in models["data"]] == ["tiny"]


def post_get(url: str) -> tuple[int, dict[str, Any]]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())


def test_a_hermes_tool_call_comes_back_structured(loaded):
    _, tok = loaded
    text = format_tool_calls(
        [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}], "hermes"
    )
    answer = [*tok.encode(text, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    server, _ = scripted_server(tok, answer)
    with server:
        status, out = post(
            server.base_url + "/chat/completions",
            {
                "messages": ASK,
                "tools": [WEATHER],
                "logprobs": True,
                "return_tokens_as_token_ids": True,
            },
        )
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"] == [
            {
                "id": "call_0_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ]
        assert [e["token"] for e in choice["logprobs"]["content"]] == [
            f"token_id:{t}" for t in answer
        ]
        # with tool_choice "none" (or no tools) the same text stays text
        _, plain = post(
            server.base_url + "/chat/completions",
            {"messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
        )
        assert plain["choices"][0]["message"]["content"] == text
        assert plain["choices"][0]["finish_reason"] == "stop"


def test_nemo_gyms_history_fields_are_tolerated_and_change_nothing(loaded):
    """The second turn as NeMo Gym sends it: the assistant's call with its log-probs, the
    tool's answer, content as text parts, a developer message: rendered as without them
    (without the turn's ids, which `test_a_turns_sampled_ids_are_extended...` sends)."""
    _, tok = loaded
    call = {
        "id": "call_0_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    plain = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "sunny"},
    ]
    sent = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "generation_log_probs": [-0.1, -0.2],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "sunny"},
    ]
    answer = tok.encode("It is sunny.", add_special_tokens=False)
    server, engine = scripted_server(tok, answer)
    with server:
        body = {
            "messages": sent,
            "tools": [WEATHER],
            "metadata": {"x": "1"},
            "parallel_tool_calls": True,
            "store": False,
            "return_token_ids": True,
            "seed": 7,
            "max_completion_tokens": 9,
        }
        status, out = post(server.base_url + "/chat/completions", body)
    assert status == 200, out
    assert out["prompt_token_ids"] == prompt_ids(tok, ChatPrompt(tuple(plain), (WEATHER,)))
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": "It is sunny.",
        "tool_calls": [],
    }
    assert engine.calls[0][1] == Sampling(1.0, 1.0, 9, 7)


def test_a_turns_sampled_ids_are_extended_token_in_token_out(loaded):
    """NeMo Gym's training capture: the history's last assistant turn carries the ids it was
    asked with and sampled, so the next prompt is those ids then the template's ids of the
    tool's answer and the generation prompt (not a rendering of the call, which would write
    its JSON as the template does), and the answer's message carries its own ids."""
    from stages.lib.chat.turns import follow_ids

    _, tok = loaded
    call = {
        "id": "call_0_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    opening = prompt_ids(tok, ChatPrompt(tuple(ASK), (WEATHER,)))
    # as sampled: the call with the model's own spacing, closed by <|im_end|>
    written = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    sampled = [
        *tok.encode(written, add_special_tokens=False),
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "prompt_token_ids": opening,
            "generation_token_ids": sampled,
            "generation_log_probs": [-0.1] * len(sampled),
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "sunny"},
    ]
    answer = tok.encode("It is sunny.", add_special_tokens=False)
    server, engine = scripted_server(tok, answer)
    with server:
        body = {
            "messages": history,
            "tools": [WEATHER],
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        status, out = post(server.base_url + "/chat/completions", body)
    assert status == 200, out
    plain = [{k: v for k, v in m.items() if "token" not in k and "log" not in k} for m in history]
    follow = follow_ids(tok, plain, True, [WEATHER])
    assert tok.decode(follow).startswith("\n<|im_start|>user\n<tool_response>")
    asked = [*opening, *sampled, *follow]
    assert list(engine.calls[0][0][0].ids) == asked
    assert asked != prompt_ids(tok, ChatPrompt(tuple(plain), (WEATHER,)))  # a rendering differs
    message = out["choices"][0]["message"]
    assert message["prompt_token_ids"] == asked
    assert message["generation_token_ids"] == answer
    assert message["generation_log_probs"] == [-0.5] * len(answer)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": []}, "messages: expected a non-empty list of messages, found []"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "messages[0].role: expected one of 'system', 'developer', 'user', 'assistant', 'tool', found \"robot\"",
        ),
        (
            {"messages": ASK, "n": 2},
            "n: 2 is not supported: one choice per request is served (n: 1)",
        ),
        (
            {"messages": ASK, "temperature": "hot"},
            'temperature: expected a number in [0, 100], found "hot"',
        ),
        ({"messages": ASK, "max_tokens": 0}, "max_tokens: expected an integer >= 1, found 0"),
        (
            {"messages": ASK, "tools": [{"type": "function"}]},
            "tools[0]: expected {'type': 'function', 'function': {'name': str, 'parameters': {...}}}, found {\"type\": \"function\"}",
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0]: a tool message needs its 'tool_call_id'",
        ),
        (
            {"messages": ASK, "max_tokens": 1000},
            "This model's maximum context length is 200 tokens. However, you requested 1111 tokens (111 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
        ),
        (
            b"{not json",
            "the body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
    ],
)
def test_a_bad_request_gets_400_with_its_message(loaded, body, message):
    _, tok = loaded
    server, engine = scripted_server(tok, [1], max_model_len=200)
    with server:
        status, out = post(server.base_url + "/chat/completions", body)
    assert (status, out["error"]["message"]) == (400, message)
    assert engine.calls == []


def test_a_key_is_asked_for_and_the_server_stays_on_loopback(loaded):
    _, tok = loaded
    server, _ = scripted_server(tok, [1], api_key="s3cret")
    with server:
        assert server.base_url.startswith("http://127.0.0.1:")
        status, out = post(server.base_url + "/chat/completions", {"messages": ASK})
        assert (status, out["error"]["message"]) == (401, "missing or wrong bearer key")
        status, _ = post(server.base_url + "/chat/completions", {"messages": ASK}, key="s3cret")
        assert status == 200


def test_concurrent_requests_are_batched_into_one_engine_call(loaded):
    """While one call runs, the requests that arrive wait and then go together."""
    _, tok = loaded
    server, engine = scripted_server(tok, tok.encode("ok", add_special_tokens=False), delay_s=0.5)
    results: list[int] = []
    with server:
        url = server.base_url + "/chat/completions"
        first = threading.Thread(target=lambda: results.append(post(url, {"messages": ASK})[0]))
        first.start()
        time.sleep(0.2)  # the first call is running
        rest = [
            threading.Thread(target=lambda: results.append(post(url, {"messages": ASK})[0]))
            for _ in range(4)
        ]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(30)
    assert results == [200] * 5
    assert server.batcher.batches == [1, 4] and [len(p) for p, _ in engine.calls] == [1, 4]


@pytest.mark.parametrize("family", [*FAMILIES, *(f"{f}-real" for f in FAMILIES)])
def test_every_familys_next_turn_begins_with_the_sampled_ids(family_checkpoint, family):
    """Token in, token out on each family's template (ChatML, Llama 3, Gemma, Mistral; their
    releases' vocabularies too, Gemma 3's among them): a
    second user turn after a sampled answer (closed by the template's closing ids) is asked
    from those ids and the template's ids of what follows, the whole of them first."""
    from stages.lib.chat.tokens import answer_end
    from stages.lib.chat.turns import follow_ids

    tok = family_tokenizer(family_checkpoint, family)
    opening = prompt_ids(tok, ChatPrompt(tuple(ASK), ()))
    end = list(answer_end(tok).ids)
    sampled = [*tok.encode("It  is sunny .", add_special_tokens=False), *end]  # odd spacing
    said = {"role": "assistant", "content": "It is sunny."}
    history = [
        *ASK,
        {**said, "prompt_token_ids": opening, "generation_token_ids": sampled},
        {"role": "user", "content": "And tomorrow?"},
    ]
    server, engine = scripted_server(tok, tok.encode("Rain.", add_special_tokens=False))
    with server:
        status, out = post(server.base_url + "/chat/completions", {"messages": history})
    assert status == 200, out
    asked = list(engine.calls[0][0][0].ids)
    plain = [*ASK, said, history[-1]]
    assert asked == [*opening, *sampled, *follow_ids(tok, plain, bool(end))]
