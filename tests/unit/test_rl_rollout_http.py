"""The rl stage's requests to vLLM engines (`stages.rl.rollout.vllm_requests`), against the tests'
fake OpenAI server (token-id prompts answered with token ids and log-probabilities): with
`num_samples_in_parallel: auto` one step of 64 prompts x 8 samples keeps the server full;
a number bounds what is in flight; the knob is validated; every step records it."""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stages.rl import RLConfig
from tests.conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import ANSWER_IDS, ThreadHandle, start_in_thread


class Tokens:
    """A tokenizer for prompts given as token ids (all the rl stage sends after turn 1)."""

    eos_token_id = 2


@pytest.fixture
def server() -> Any:
    """The fake server in a thread of this process. The heap the earlier tests of a full run
    leave here (~500k objects) is frozen first: a gen-2 collection over it stalls the server
    and the client alike, the adaptive limit reads the stall as queueing at startup and settles
    near 64 instead of 128 (seen in every full `tests/unit` run on 2 cores, never alone)."""
    gc.collect()
    gc.freeze()
    handle: ThreadHandle = start_in_thread(capacity=128, latency_ms=200)
    yield handle
    handle.stop()
    gc.unfreeze()


def rollouts(server: Any, parallel: int | str) -> Any:
    from stages.rl.rollout.vllm_requests import HTTPRollouts

    url = server.url.removesuffix("/v1")
    return HTTPRollouts([url], Tokens(), "fake", {}, 30.0, parallel)


def step(engine: Any, prompts: int = 64, group: int = 8) -> list[list[Any]]:
    from stages.lib.chat.prompt import TokenPrompt

    return engine.generate(
        [TokenPrompt((1, 5 + i % 7, 9)) for i in range(prompts)],
        num_samples=group,
        temperature=1.0,
        max_new_tokens=4,
        seed=3,
    )


def test_auto_keeps_the_server_at_its_limit_for_a_whole_step(server: Any):
    engine = rollouts(server, "auto")
    gens = step(engine)
    assert [len(g) for g in gens] == [8] * 64
    g = gens[0][0]
    assert g.token_ids == ANSWER_IDS and g.logprobs == (-0.5,) * 3 and g.prompt_ids == (1, 5, 9)
    counters = server.server.counters
    assert counters.served == 512  # one request per sample
    # the server's 128 slots were all taken: >= 90% of its limit in service at once
    assert counters.peak_in_service >= 0.9 * 128
    stats = engine.stats
    assert stats["in_flight_peak"] >= 0.9 * 128 and stats["parallel_limit"] >= 115
    assert stats["queue_wait_s"] is None  # the fake exports no /metrics
    # the next step starts where the limit settled: full from its first round trip
    counters.peak_in_service = 0
    step(engine)
    assert engine.stats["in_flight"] >= 0.9 * 128 and counters.peak_in_service == 128


def test_a_number_bounds_the_requests_in_flight(server: Any):
    engine = rollouts(server, 16)
    step(engine, prompts=8)
    assert server.server.counters.peak_in_service == 16
    assert engine.stats["in_flight_peak"] == 16 and engine.stats["parallel_limit"] == 16


def test_each_sample_is_seeded_and_a_group_goes_to_one_server(server: Any):
    from stages.lib.api.client import sample_seed

    server.server.record_bodies = True
    engine = rollouts(server, 8)
    step(engine, prompts=2, group=3)
    bodies = server.server.counters.bodies
    seeds = sorted(b["seed"] for b in bodies)
    assert seeds == sorted(sample_seed(3, i, s, 3) for i in range(2) for s in range(3))
    assert all(b["n"] == 1 and b["return_token_ids"] and b["logprobs"] == 0 for b in bodies)


@pytest.mark.parametrize(
    ("how", "logprobs"),
    [
        ("kept", (-0.5, -0.5, -0.5, -0.25)),  # vLLM's V1 engine: the id and its log-prob
        ("left_out_scored", (-0.5, -0.5, -0.5, -0.25)),  # the id joins with its log-prob
        ("left_out", (-0.5, -0.5, -0.5)),  # no log-prob reported: the id stays out
    ],
)
def test_an_answer_has_one_log_prob_per_token_id_whatever_the_stop(
    server: Any, how: str, logprobs: tuple[float, ...]
):
    """Issue 45: a stop id the engine's `token_ids` left out was appended with no
    log-probability, so a sample's `old_logprobs` were one shorter than its completion."""
    from stages.lib.chat.prompt import TokenPrompt
    from stages.rl.rollout.vllm_requests import HTTPRollouts

    server.server.stop = (7, how)
    url = server.url.removesuffix("/v1")
    engine = HTTPRollouts([url], Tokens(), "fake", {}, 30.0, 8, stops=[7])
    for g in [g for group in step(engine, prompts=2, group=2) for g in group]:
        assert g.logprobs == logprobs and len(g.token_ids) == len(logprobs)
        assert g.token_ids[:3] == ANSWER_IDS and g.finish_reason == "stop"
    # greedy asks for no log-probability: the sampled stop id joins the ids
    ((greedy,),) = engine.generate(
        [TokenPrompt((1, 5))], num_samples=1, temperature=0.0, max_new_tokens=4, seed=0
    )
    assert greedy.token_ids == (*ANSWER_IDS, 7) and greedy.logprobs == ()
    # an engine that scores fewer tokens than it returns fails the step, naming it
    server.server.stop = None
    engine.generation = lambda choice, prompt, scored: HTTPRollouts.generation(  # type: ignore
        engine, {**choice, "logprobs": {"token_logprobs": [-0.5]}}, prompt, scored
    )
    with pytest.raises(RuntimeError, match=f"^{url}/v1/completions: an answer of 3 token ids "
                       "came with 1 log-probabilities: the loss needs"):  # fmt: skip
        step(engine, prompts=1, group=1)


@pytest.mark.parametrize(
    ("how", "completion"), [("left_out_scored", (*ANSWER_IDS, 7)), ("left_out", ANSWER_IDS)]
)
def test_a_sample_trains_one_behaviour_log_prob_per_completion_token(
    server: Any, how: str, completion: tuple[int, ...]
):
    """Through the rl rollout: every sample's `old_logprobs` as long as its completion."""
    from stages.lib.env.contract import environment_factory
    from stages.rl.controller.batch import rollout
    from stages.rl.rollout.prompts import Stream
    from stages.rl.rollout.vllm_requests import HTTPRollouts

    server.server.stop = (7, how)
    url = server.url.removesuffix("/v1")
    engine = HTTPRollouts([url], _Chat(), "fake", {}, 30.0, 8, stops=[7])
    # reinforce_pp (dynamic sampling off by default): the fake's groups, all alike, train too
    cfg = RLConfig(input="x.jsonl", rollout_batch_size=2, num_repeats=2, advantage="reinforce_pp")
    c = SimpleNamespace(
        cfg=cfg,
        engine=engine,
        data=SimpleNamespace(rows=[{"prompt": "1 + 1", "answer": "2"}] * 2),
        stream=Stream(2, 2, 0),
        make_env=environment_factory(None, cfg.verifier.model_copy(update={"kind": "exact_match"})),
        version=0,
        reward=None,  # no reward model: the verifier scores
        ctx=SimpleNamespace(log=logging.getLogger("test")),
    )
    samples = rollout(c, 1).samples
    assert samples
    for s in samples:
        assert s.ids[s.prompt_len :] == completion
        assert len(s.old_logprobs) == s.completion_len == len(completion)


# softmax(logits / T) over the whole vocabulary: nothing else (vLLM's top_k off is 0 or -1)
def policy(temperature: float) -> dict[str, Any]:
    return {
        "temperature": temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip


def test_a_checkpoints_generation_config_does_not_change_the_policy_sampled(server: Any):
    """A server that fills what a request leaves out from the checkpoint's
    generation_config.json (vLLM's default `--generation-config auto`: Qwen2.5-Instruct's
    top_k 20, top_p 0.8, repetition_penalty 1.05) samples every rl request, sampled or
    greedy, with the policy the loss assumes: each request says every field."""
    from stages.lib.chat.prompt import TokenPrompt

    server.server.record_bodies = True
    server.server.defaults = {
        "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "min_p": 0.1, "temperature": 0.7,
    }  # fmt: skip
    engine = rollouts(server, 8)
    step(engine, prompts=2, group=2)
    assert server.server.counters.sampled == [policy(1.0)] * 4
    engine.generate([TokenPrompt((1, 5))], num_samples=1, temperature=0.0, max_new_tokens=4, seed=0)
    assert server.server.counters.sampled[-1] == policy(0.0)  # held-out scoring: greedy


def test_settings_record_the_sampling_each_vllm_request_sent():
    from stages.rl.controller.applied import account
    from stages.rl.sync.choice import SyncChoice

    vllm = {"kind": "vllm", "model": "m"}
    cfg = RLConfig(input="x.jsonl", temperature=0.9, backend=vllm)  # type: ignore[arg-type]
    saved = ("float32", "auto: the input's")
    status, how = account(cfg, "torch", "cpu", 1, SyncChoice("gloo", None), saved=saved)[
        "temperature"
    ]
    assert status == "applied" and "softmax(logits / T) over the whole vocabulary" in how
    assert json.dumps(policy(0.9)) in how and "--generation-config vllm" in how
    local = account(
        RLConfig(input="x.jsonl"), "torch", "cpu", 1, SyncChoice("gloo", None), saved=saved
    )
    assert "sampled by the local engine itself" in local["temperature"][1]


def test_every_step_records_what_was_in_flight(server: Any):
    from stages.lib.env.contract import environment_factory
    from stages.lib.env.field import EnvironmentConfig  # noqa: F401  (the rollout's imports)
    from stages.rl.controller.batch import rollout
    from stages.rl.controller.loop import ENGINE_FIELDS
    from stages.rl.rollout.prompts import Stream

    engine = rollouts(server, "auto")
    cfg = RLConfig(input="x.jsonl", rollout_batch_size=4, num_repeats=2)
    rows = [{"prompt": "1 + 1", "answer": "2"}] * 4
    c = SimpleNamespace(
        cfg=cfg,
        engine=engine,
        data=SimpleNamespace(rows=rows),
        stream=Stream(4, 4, 0),
        make_env=environment_factory(None, cfg.verifier.model_copy(update={"kind": "exact_match"})),
        version=0,
        reward=None,  # no reward model: the verifier scores
        ctx=SimpleNamespace(log=logging.getLogger("test")),
    )
    engine.tokenizer = _Chat()
    batch = rollout(c, 1)
    assert set(ENGINE_FIELDS) <= set(batch.engine) and batch.engine["in_flight_peak"] == 8


class _Chat(Tokens):
    """Renders a chat prompt to a few token ids (the opening turn's prompt)."""

    def apply_chat_template(self, messages: Any, **_: Any) -> str:
        return "x"

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [1, 4, 9]}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "expected a positive integer or 'auto', found 0"),
        ("fast", "expected a positive integer or 'auto', found 'fast'"),
    ],
)
def test_the_knob_is_validated_located(tmp_path: Path, value: str, message: str):
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n  rl:\n    kind: rl\n    config:\n      input: d.jsonl\n"
        f"      num_samples_in_parallel: {value}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 2
    assert f"p.yaml:7:32: stages.rl.config.num_samples_in_parallel: {message}" in out.stderr
