"""Tool-use conversations as token ids, on the four families' real tokenizers: the ids are the
template's rendering (tools, calls and results included), only the assistant turns are trained
(the call text and the closing token too), tool outputs never; a row that is not OpenAI's
shape is refused with its line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from stages.lib.chat.template import template_text
from stages.lib.chat.tool_calls import format_tool_calls, parser_for, tool_call
from stages.lib.env.tools import TOOLS
from stages.train.data import DataError, samples_of, tokenize

CALC = TOOLS["calculator"].schema
TEMPLATES = {"chatml": None, "llama3": None, "gemma": "gemma_tools", "mistral": "mistral_tools"}


def conversation(family: str) -> list[dict[str, Any]]:
    ids = {"mistral": ("a1b2c3d4e", "f5g6h7i8j")}.get(family, ("call_0_0", "call_2_0"))
    first = tool_call("calculator", {"expression": "123 + 456"}, ids[0])
    second = tool_call("calculator", {"expression": "579 + 100"}, ids[1])
    return [
        {"role": "user", "content": "What is 123 + 456 + 100?"},
        {"role": "assistant", "content": "", "tool_calls": [first]},
        {"role": "tool", "tool_call_id": ids[0], "content": "result: 579"},
        {"role": "assistant", "content": "", "tool_calls": [second]},
        {"role": "tool", "tool_call_id": ids[1], "content": "result: 679"},
        {"role": "assistant", "content": "679"},
    ]


@pytest.fixture(params=list(TEMPLATES))
def family(request: Any) -> str:
    return str(request.param)


def tokenizer_of(family: str, family_checkpoint: Callable[..., Path]) -> Any:
    from tests.families import family_tokenizer

    tok = family_tokenizer(family_checkpoint, f"{family}-real")
    if TEMPLATES[family]:
        tok = type(tok).from_pretrained(tok.name_or_path)  # the cached one stays as it is
        tok.chat_template = template_text(TEMPLATES[family])
    return tok


def test_sft_on_a_tool_use_row_trains_the_assistant_turns_and_never_the_tool_outputs(
    family: str, family_checkpoint: Callable[..., Path]
):
    from stages.lib.chat.tool_calls import template_messages

    tok = tokenizer_of(family, family_checkpoint)
    messages = conversation(family)
    row = {"messages": messages, "tools": [CALC]}
    (sample,) = samples_of([row], "completion")
    (example,) = tokenize([sample], tok, max_length=4096)

    text = tok.apply_chat_template(template_messages(messages), tools=[CALC], tokenize=False)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert (
        list(example.input_ids) == whole[: len(example.input_ids)]
    )  # the rendering, cut after the answer
    assert CALC["function"]["description"] in tok.decode(example.input_ids)

    trained = [tok.decode(example.input_ids[a:b]) for a, b in example.trained()]
    parser = parser_for(tok.chat_template)
    assert parser is not None and len(trained) == 3
    for turn, message in zip(trained, [messages[1], messages[3], messages[5]], strict=True):
        calls = message.get("tool_calls")
        written = format_tool_calls(calls, parser) if calls else message["content"]
        assert written.strip() in turn  # the call text (or the answer) is trained
    closing = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
    assert all(t.endswith(closing.get(family, "</s>")) for t in trained)
    assert not any("result: " in t for t in trained)  # tool outputs: never trained


def test_a_row_whose_tool_messages_are_not_openais_is_refused_with_its_line():
    broken = {"messages": [*conversation("chatml")[:2], {"role": "tool", "content": "579"}]}
    broken["messages"].append({"role": "assistant", "content": "579"})
    with pytest.raises(
        DataError,
        match=r"data.jsonl: row 2 has a message that is not OpenAI.s: .*without a .tool_call_id.",
    ):
        samples_of([{"prompt": "x", "completion": "y"}, broken], "completion", "data.jsonl")
    with pytest.raises(
        DataError, match=r"row 1 has tools that are not OpenAI.s function schemas: .*not a list"
    ):
        samples_of([{"prompt": "x", "completion": "y", "tools": {"a": 1}}], "completion")


def test_collect_rows_with_tool_calls_read_back_as_the_conversation_they_were():
    row = {
        "messages": json.loads(json.dumps(conversation("chatml"))),
        "tools": [CALC],
        "rewards": [0.0, 0.0, 1.0],
        "total_reward": 1.0,
        "turns": 3,
        "end": "done",
    }
    (sample,) = samples_of([row], "completion")
    assert list(sample.conversation) == conversation("chatml") and sample.tools == (CALC,)


def test_a_local_model_is_prompted_with_the_tools_and_its_calls_are_answered(
    family_checkpoint: Callable[..., Path],
):
    """The calculator with a ChatML checkpoint in memory (evaluate's and collect's `local`
    engine): every turn's prompt holds the rendered tools, and a reply in the hermes format
    is read into a call the calculator answers with a `tool` message."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.lib.env.builtin import calculator
    from stages.lib.env.message_play import local_answer, play_batched
    from stages.lib.env.messages import episode_parser

    path = family_checkpoint("chatml")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    sampled = local_answer(
        model, tok, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0, batch_size=4
    )
    prompts: list[str] = []
    call = format_tool_calls([tool_call("calculator", {"expression": "2 + 3"}, "x")], "hermes")

    def answer(conversations: list[Any]) -> list[Any]:
        from stages.lib.chat.prompt import format_prompt

        gens = sampled(conversations)  # the model's own turn (random), then a scripted one
        prompts.extend(format_prompt(tok, c) for c in conversations)  # what it was prompted with
        return [call if len(prompts) <= len(gens) else "5" for _ in gens]

    def exact(row: dict[str, Any], completion: str) -> float:
        return float(completion.strip() == row["answer"])

    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}] * 2
    episodes = asyncio.run(
        play_batched(
            lambda: calculator(exact), rows, answer, max_turns=3, parser=episode_parser(None, tok)
        )
    )
    assert prompts and all(CALC["function"]["description"] in p for p in prompts)
    for episode in episodes:
        assert episode.messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
        assert episode.messages[2]["role"] == "tool" and episode.messages[2]["content"] == (
            "result: 5"
        )
        assert episode.rewards == [0.0, 1.0] and episode.solved


@pytest.mark.parametrize("tokens", ["extend", "rerender"])
def test_rl_episodes_with_tool_calls_keep_every_sampled_id_and_train_no_tool_output(
    family: str, family_checkpoint: Callable[..., Path], tokens: str
):
    """rl's token-level episodes with the calculator, on each family's real tokenizer and a
    template that renders tools: the prompt holds the tools, the model's call (its family's
    format, as sampled) is read and answered by a `tool` message, each later prompt extends
    the ids so far (`extend`), and the loss mask covers the sampled ids and nothing of the
    tool's answer."""
    from stages.lib.chat.tokens import answer_end
    from stages.lib.env.builtin import calculator
    from stages.lib.env.messages import episode_parser
    from stages.rl.rollout.token_play import PlaySettings, play
    from tests.unit.test_episode_tokens import Scripted, answer_ids, encode, runs

    tok = tokenizer_of(family, family_checkpoint)
    parser = episode_parser(None, tok)
    assert parser is not None
    end = list(answer_end(tok).ids)
    written = format_tool_calls([tool_call("calculator", {"expression": "2 + 3"}, "x")], parser)
    answers = [encode(tok, written) + end, answer_ids(tok, "5") + end]

    def exact(row: dict[str, Any], completion: str) -> float:
        return float(completion.strip() == row["answer"])

    s = PlaySettings(2, 1.0, 64, 4096, 0, 8, 3, 10.0, 4, tokens, parser)  # type: ignore[arg-type]
    engine = Scripted(tok, answers)
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}]
    (group,) = play(engine, tok, lambda: calculator(exact), rows, s)
    assert CALC["function"]["description"] in tok.decode(engine.prompts[0])
    for t in group:
        messages = t.episode.messages
        assert t.episode.error is None and t.episode.rewards == [0.0, 1.0], t.episode.error
        assert messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
        assert messages[2] == {
            "role": "tool",
            "tool_call_id": messages[1]["tool_calls"][0]["id"],
            "name": "calculator",
            "content": "result: 5",
        }
        tail = t.ids[t.prompt_len :]
        trained = [tok.decode(r) for r in runs(t.mask, tail)]
        assert not any("result: 5" in r for r in trained)
        if tokens == "extend":
            assert runs(t.mask, tail) == answers  # every sampled id, as sampled
            assert engine.prompts[1] == t.ids[: len(engine.prompts[1])]  # contiguous


def test_an_answers_text_keeps_the_tool_call_markers_and_drops_its_closing(family_checkpoint):
    """Mistral v0.3's `[TOOL_CALLS]` is a special token: decoded with the others skipped, a
    call reads as a bare JSON list no parser can tell from text. The answer's text (the local
    engine's, and the rl engine's from vLLM's ids) keeps it, and only it."""
    from transformers import AutoTokenizer

    from stages.lib.chat.tokens import answer_text
    from stages.lib.chat.tool_calls import parse_tool_calls
    from stages.lib.model.generate import _finish

    tok = AutoTokenizer.from_pretrained(family_checkpoint("chatml"))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    calls = '[{"name": "calculator", "arguments": {"expression": "1 + 2"}, "id": "a1b2c3d4e"}]'
    ids = [
        *tok.encode("[TOOL_CALLS]", add_special_tokens=False),
        *tok.encode(" " + calls, add_special_tokens=False),
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert tok.decode(ids, skip_special_tokens=True).strip() == calls  # the marker lost
    text = answer_text(tok, ids)
    assert text == "[TOOL_CALLS] " + calls
    (call,) = parse_tool_calls(text, "mistral").tool_calls
    assert call["function"]["name"] == "calculator"
    assert _finish(tok, ids, {ids[-1]}, 3).text == text
    plain = tok.encode("no call here", add_special_tokens=False)
    assert answer_text(tok, [*plain, ids[-1]]) == "no call here"
