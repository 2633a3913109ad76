"""Token ids read as checkpoints bring them (issue 37), on every family and the tiny model:
an `eos_token_id` list and a missing pad id give the rl roles a pad id; an answer ends
with what the chat template closes an assistant turn with, in training, the rl probe and
generation's stops, whatever the tokenizer's `eos_token`; an SFT row is the template's
tokens; a vLLM answer gets no stop token the engine did not sample (issue 38)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.builders.conventions import FAMILIES as SPECS  # noqa: E402
from stages.lib.chat.tokens import answer_end, checkpoint_eos_ids, eos_ids, pad_id  # noqa: E402
from tests.families import FAMILIES, family_tokenizer  # noqa: E402

torch.set_num_threads(1)
os.environ["HF_HUB_OFFLINE"] = "1"

Build = Callable[..., Path]
QUESTION = "What is 2 + 3?"
ONE_TURN = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "5"}]
TWO_TURNS = [
    *ONE_TURN,
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
]
# what each template writes after an assistant turn's content, and the token trained last
END = {
    "chatml": ("<|im_end|>\n", "<|im_end|>"),
    "llama3": ("<|eot_id|>", "<|eot_id|>"),
    "gemma": ("<end_of_turn>\n", "<end_of_turn>"),
    "mistral": ("</s>", "</s>"),
    "tiny": ("<|eos|>", "<|eos|>"),
}
END["mistral-real"], END["gemma-real"] = END["mistral"], END["gemma"]
# every family, mistral and gemma with their releases' SentencePiece vocabularies too, and the
# tiny model
ALL = [*FAMILIES, "mistral-real", "gemma-real", "tiny"]


def tokenizer_of(family: str, family_checkpoint: Build) -> Any:
    """The family's tokenizer; `<family>-real`: with the release's vocabulary (a
    SentencePiece one for mistral)."""
    if family == "tiny":
        from stages.lib.builders.tiny import train_tokenizer

        return train_tokenizer([f"{QUESTION} 5", "And 4 + 4? 8"] * 5, 300)
    return family_tokenizer(family_checkpoint, family)


def rendered_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The template's tokens of `messages`, less its text after the closing token."""
    got = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = list(got["input_ids"] if hasattr(got, "keys") else got)
    rest = tokenizer(answer_end(tokenizer).rest, add_special_tokens=False)["input_ids"]
    assert ids[len(ids) - len(rest) :] == rest
    return ids[: len(ids) - len(rest)]


def sft_example(tokenizer: Any, rows: list[dict[str, Any]]) -> Any:
    from stages.train.data import training_set

    data = training_set(rows, tokenizer, algorithm="sft", target="completion", max_length=512)
    return data.examples[0]


@pytest.mark.parametrize("family", ALL)
def test_the_end_of_an_answer_is_what_the_template_writes_after_it(family, family_checkpoint):
    tok = tokenizer_of(family, family_checkpoint)
    end = answer_end(tok)
    text, last = END[family]
    assert end.text == text
    assert end.ids == (tok.convert_tokens_to_ids(last),)
    assert end.rest == text.removeprefix(last)


@pytest.mark.parametrize("family", FAMILIES)
def test_rl_roles_get_a_pad_id_from_a_config_with_an_eos_list_and_no_pad(
    family, family_checkpoint, monkeypatch
):
    """Llama 3's config has `eos_token_id` a list and no pad: `int()` of it killed the actor."""
    import transformers

    from stages.rl.roles import actor, critic, ref, trained

    path = family_checkpoint(family)
    fam = SPECS[family]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    expected = tok.convert_tokens_to_ids(fam.config_pad or fam.config_stop[0])

    def load(model_dir: str, ds_config: Any) -> Any:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir)

    monkeypatch.setattr(
        actor, "load_trained", lambda model_dir, ds_config, *a: load(model_dir, None)
    )
    monkeypatch.setattr(critic, "load_model", load)
    monkeypatch.setattr(trained, "make_trainer", lambda *a: None)  # the actor's and critic's
    monkeypatch.setattr(ref, "load_reference", lambda model_dir, *a: (load(model_dir, None), None))
    cfg = SimpleNamespace(kl_coef=0.0, teacher=None, bf16=False, lora=None)
    spec = SimpleNamespace(
        config=cfg,
        model_dir=str(path),
        ds_config=None,
        trainer="torch",
        total_updates=1,
        ref_in_actor=False,
        resume_tag=None,
    )
    roles = [
        actor.Actor(spec, 0, 1, "cpu"),
        critic.CriticRank(spec, 0, 1, "cpu"),
        ref.RefRank(spec, 0, 1, "cpu"),
    ]
    assert [r.pad_id for r in roles] == [expected] * 3
    if family == "llama3":
        assert isinstance(transformers.AutoConfig.from_pretrained(path).eos_token_id, list)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stops_at_every_eos_and_the_templates_end_of_turn(family, family_checkpoint):
    import transformers

    from stages.lib.model.generate import _eos_ids

    path = family_checkpoint(family)
    fam = SPECS[family]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = SimpleNamespace(
        config=transformers.AutoConfig.from_pretrained(path),
        generation_config=transformers.GenerationConfig.from_pretrained(path),
    )
    stops = {fam.eos, *fam.stop, *fam.config_stop, END[family][1]}
    assert _eos_ids(model, tok) == {tok.convert_tokens_to_ids(t) for t in stops}
    assert set(checkpoint_eos_ids(str(path), tok)) == _eos_ids(model, tok)


def test_a_base_chatml_tokenizer_trains_answers_to_end_with_im_end(family_checkpoint):
    """A base tokenizer's eos is `<|endoftext|>`; its template still closes turns with
    `<|im_end|>`: that is what an answer ends with, in training, the probe and the stops."""
    from stages.rl.rollout.prompts import probe_ids

    tok = tokenizer_of("chatml", family_checkpoint)
    tok.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    example = sft_example(tok, [{"prompt": QUESTION, "completion": "5", "reward": 1.0}])
    trained = [t for t in example.labels() if t != -100]
    assert trained[-1] == im_end and example.input_ids[-1] == im_end
    assert tok.eos_token_id not in example.input_ids
    ids, start = probe_ids(tok, QUESTION, "5")
    assert ids[-1] == im_end and ids == example.input_ids and start == example.prompt_len
    assert eos_ids(tok) == [tok.eos_token_id, im_end]
    assert pad_id(tok) == tok.convert_tokens_to_ids("<|endoftext|>")


def said(tok: Any, ids: tuple[int, ...], span: tuple[int, int]) -> str:
    """The text a trained range adds to the sequence before it (decoded as a whole: a
    SentencePiece decoder drops the space it put before a text's first piece)."""
    a, b = span
    return tok.decode(ids[:b])[len(tok.decode(ids[:a])) :]


@pytest.mark.parametrize("family", ALL)
def test_an_sft_row_of_one_turn_is_the_chat_templates_tokens(family, family_checkpoint):
    tok = tokenizer_of(family, family_checkpoint)
    expected = rendered_ids(tok, ONE_TURN)
    for row in ({"messages": ONE_TURN}, {"prompt": QUESTION, "completion": "5"}):
        example = sft_example(tok, [row])
        assert list(example.input_ids) == expected
        (span,) = example.trained()
        assert said(tok, example.input_ids, span) == "5" + END[family][0].removesuffix(
            answer_end(tok).rest
        )
        assert list(example.input_ids[span[1] - len(answer_end(tok).ids) :]) == list(
            answer_end(tok).ids
        )


@pytest.mark.parametrize("family", ALL)
def test_an_sft_row_of_a_conversation_is_the_chat_templates_tokens(family, family_checkpoint):
    """The text after a closing token (ChatML's newline) is put back between turns, untrained."""
    tok = tokenizer_of(family, family_checkpoint)
    example = sft_example(tok, [{"messages": TWO_TURNS}])
    assert list(example.input_ids) == rendered_ids(tok, TWO_TURNS)
    closing = END[family][1]
    assert [said(tok, example.input_ids, s) for s in example.trained()] == [
        "5" + closing,
        "8" + closing,
    ]


# answers as a sampler writes them: whitespace around them, which Llama 3's and Gemma's
# templates trim (`| trim`) and ChatML's and Mistral's keep
SAMPLED = [" 5\n", "  And 8 ", "8\n\n"]
TRIMS = {"llama3", "gemma"}


def spoken(family: str, text: str) -> str:
    """An answer's text as the family's template renders it."""
    return text.strip() if family.partition("-")[0] in TRIMS else text


@pytest.mark.parametrize("family", ALL)
def test_rows_with_sampled_whitespace_are_the_chat_templates_tokens(family, family_checkpoint):
    """Issue 45 point 7: an RFT row, a chat row and a conversation of collect's with sampled
    whitespace train the template's rendering of the conversation (the trimmed answer where
    the template trims), each assistant turn's range its rendered text and closing token."""
    tok = tokenizer_of(family, family_checkpoint)
    closing = END[family][1]
    talk = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": SAMPLED[0]},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": SAMPLED[1]},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": SAMPLED[2]},
    ]
    rows = [
        ({"prompt": QUESTION, "completion": SAMPLED[0], "reward": 1.0}, talk[:2]),
        ({"messages": talk[:2]}, talk[:2]),
        ({"messages": talk, "turns": 3, "end": "done"}, talk),
    ]
    for row, messages in rows:
        example = sft_example(tok, [row])
        assert list(example.input_ids) == rendered_ids(tok, messages), row
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [said(tok, example.input_ids, s) for s in example.trained()] == [
            spoken(family, a) + closing for a in answers
        ]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_vllm_answer_stopped_on_another_stop_token_gets_no_unsampled_eos(
    family, family_checkpoint
):
    """Issue 38: an answer stopped on `<|endoftext|>` got a `<|im_end|>` appended."""
    from stages.rl.rollout.vllm_requests import HTTPRollouts

    path = family_checkpoint(family)
    tok = tokenizer_of(family, family_checkpoint)
    engine = HTTPRollouts(["http://x"], tok, "m", {}, 1.0, 1, checkpoint_eos_ids(str(path), tok))
    for stop in engine.stops:
        for reason in (stop, None):
            choice = {"finish_reason": "stop", "token_ids": [7, stop], "stop_reason": reason}
            assert engine.generation(choice, [1]).token_ids == (7, stop)
    left_out = {"finish_reason": "stop", "token_ids": [7], "stop_reason": engine.stops[-1]}
    assert engine.generation(left_out, [1]).token_ids == (7, engine.stops[-1])
    length = {"finish_reason": "length", "token_ids": [7, 8]}
    assert engine.generation(length, [1]).token_ids == (7, 8)
