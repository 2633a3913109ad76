"""A multi-turn episode's tokens are the chat template's rendering of its conversation
(issue 38; rl's `multi_turn_tokens: rerender`, `test_episode_tokens_extend.py` the default), on
every family: the rl episode (engine at the edge scripted as token ids), and
the conversation evaluate's and collect's `local` backends render for the next turn.

"Equal" here, exactly: with R = `apply_chat_template(final messages, tokenize=True)`, an
episode whose last answer ended with the template's closing token has ids R less the text
after that token (`answer_end(tok).rest`: ChatML's and Gemma's "\\n", nothing for Llama 3
and Mistral); one whose last answer was cut has ids R less that answer's whole end
(`answer_end(tok).text`), since the last turn is left as sampled. A cut turn the episode
goes on from is closed as the template closes it, outside the loss."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.chat.prompt import prompt_ids
from stages.lib.chat.tokens import answer_end
from stages.lib.model.generate import Generation
from tests.families import FAMILIES, family_tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"

QUESTION = "What is 2 + 2?"
AGAIN = "Try again."
LOGPROB = -0.5


class Guess:
    """An episode of `turns` answers: an observation after each but the last."""

    def __init__(self, turns: int, role: str = "user") -> None:
        self.turns, self.role, self.steps = turns, role, 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": QUESTION}]

    def step(self, messages: Any, completion: str) -> tuple[float, Any, bool]:
        self.steps += 1
        if self.steps == self.turns:
            return 1.0, None, True
        return 0.0, [{"role": self.role, "content": AGAIN}], False


class Scripted:
    """The engine at the edge: turn k answers every prompt with `answers[k]` (token ids)."""

    def __init__(self, tokenizer: Any, answers: list[list[int]]) -> None:
        self.tokenizer, self.answers, self.calls = tokenizer, answers, 0
        self.prompts: list[list[int]] = []

    def generate(self, prompts: list[Any], *, num_samples: int, **_: Any) -> list[Any]:
        ids = self.answers[self.calls]
        self.calls += 1
        out = []
        for p in prompts:
            encoded = prompt_ids(self.tokenizer, p)
            self.prompts.append(encoded)
            gen = generation(self.tokenizer, ids, encoded)
            out.append([gen] * num_samples)
        return out


def generation(tok: Any, ids: list[int], prompt: list[int]) -> Generation:
    stopped = bool(ids) and ids[-1] in answer_end(tok).ids
    return Generation(
        tok.decode(ids, skip_special_tokens=True),
        "stop" if stopped else "length",
        len(prompt),
        len(ids),
        tuple(ids),
        (LOGPROB,) * len(ids),
        tuple(prompt),
    )


# every family, and mistral and gemma with their releases' SentencePiece vocabularies
ALL = [*FAMILIES, "mistral-real", "gemma-real"]


def tokenizer(family: str, family_checkpoint: Callable[..., Path]) -> Any:
    return family_tokenizer(family_checkpoint, family)


def rendered(tok: Any, messages: list[dict[str, str]], **kw: Any) -> list[int]:
    got = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(got["input_ids"] if hasattr(got, "keys") else got)


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def answer_ids(tok: Any, text: str) -> list[int]:
    """The ids of `text` as an answer: as the template renders it after the question (a
    SentencePiece tokenizer puts a `▁` before a text tokenized alone, not after `[/INST]`)."""
    question = [{"role": "user", "content": QUESTION}]
    head = rendered(tok, question, add_generation_prompt=True)
    full = rendered(tok, [*question, {"role": "assistant", "content": text}])
    end = encode(tok, answer_end(tok).text)
    assert full[: len(head)] == head and full[len(full) - len(end) :] == end
    return full[len(head) : len(full) - len(end)]


TRIMS = ("llama3", "gemma")  # the families whose templates trim an answer


def sampled_ids(tok: Any, family: str, text: str) -> list[int]:
    """The ids of `text` as a model samples it: under a template that trims answers (Llama
    3's, Gemma's), the trimmed whitespace as its own tokens after the answer's."""
    core = text.rstrip()
    if family.partition("-")[0] not in TRIMS:
        return answer_ids(tok, text)
    return answer_ids(tok, core) + encode(tok, text[len(core) :])


def play(
    tok: Any,
    answers: list[list[int]],
    role: str = "user",
    max_length: int = 512,
    tokens: str = "rerender",
) -> Any:
    from stages.rl.rollout.token_play import PlaySettings, play

    s = PlaySettings(2, 1.0, 16, max_length, 0, 8, len(answers), 10.0, 4, tokens)
    engine = Scripted(tok, answers)
    groups = play(engine, tok, lambda: Guess(len(answers), role), [{"prompt": QUESTION}], s)
    return groups[0], engine


def runs(mask: list[int], ids: list[int]) -> list[list[int]]:
    """The maximal runs of ids where the mask is 1."""
    out: list[list[int]] = []
    for k, m in enumerate(mask):
        if m and (k == 0 or not mask[k - 1]):
            out.append([])
        if m:
            out[-1].append(ids[k])
    return out


@pytest.mark.parametrize("last", ["closed", "cut"])
@pytest.mark.parametrize("family", ALL)
def test_an_episodes_ids_are_the_templates_rendering(family, family_checkpoint, last):
    """Three turns: closed, cut (closed by the template before the observation), then the
    last one closed or cut; the loss mask is 1 exactly on the sampled tokens."""
    tok = tokenizer(family, family_checkpoint)
    end = answer_end(tok)
    texts = ["4", "It is 4 and", "The answer is 4"]
    answers = [
        answer_ids(tok, texts[0]) + list(end.ids),
        answer_ids(tok, texts[1]),  # cut at max_new_tokens: no closing token
        answer_ids(tok, texts[2]) + (list(end.ids) if last == "closed" else []),
    ]
    group, _ = play(tok, answers)
    for t in group:
        assert t.episode.end == "done" and t.episode.rewards == [0.0, 0.0, 1.0]
        assert [m["content"] for m in t.episode.messages if m["role"] == "assistant"] == texts
        full = rendered(tok, t.episode.messages)
        trimmed = encode(tok, end.rest if last == "closed" else end.text)
        assert full[len(full) - len(trimmed) :] == trimmed
        assert t.ids == full[: len(full) - len(trimmed)]
        assert t.ids[: t.prompt_len] == rendered(
            tok, t.episode.messages[:1], add_generation_prompt=True
        )
        tail = t.ids[t.prompt_len :]
        assert len(t.mask) == len(t.logprobs) == len(tail)
        assert runs(t.mask, tail) == answers
        assert t.logprobs == [LOGPROB if m else 0.0 for m in t.mask]


@pytest.mark.parametrize("family", ALL)
def test_an_episode_with_sampled_whitespace_is_the_templates_rendering_up_to_its_answer(
    family, family_checkpoint
):
    """Issue 45 point 7: Llama 3's and Gemma's templates trim an answer. Each turn is asked
    from the template's rendering of the conversation so far (as evaluate and collect ask
    it), the episode's ids up to its last answer are that rendering, the last answer is as
    sampled; an earlier answer is trained, with its sampled log-probs, only where its tokens
    in the rendering are the sampled ones (the closing of a cut one outside the loss)."""
    tok = tokenizer(family, family_checkpoint)
    end = answer_end(tok)
    trims = family.partition("-")[0] in TRIMS

    def sampled(text: str) -> list[int]:
        return sampled_ids(tok, family, text)

    texts = ["4\n ", "It is 4 and", "4 "]
    answers = [
        sampled(texts[0]) + list(end.ids),
        sampled(texts[1]),  # cut at max_new_tokens: the template closes it
        sampled(texts[2]) + list(end.ids),
    ]
    group, engine = play(tok, answers)
    assert all(answers), "every answer has tokens of its own"
    for t in group:
        assert t.episode.end == "done"
        messages = t.episode.messages
        assert [m["content"] for m in messages if m["role"] == "assistant"] == texts
        asked = rendered(tok, messages[:-1], add_generation_prompt=True)
        assert t.ids == asked + answers[2]
        assert engine.prompts[-1] == asked  # turn 3 asked from the template's rendering
        if not trims:
            assert t.ids == rendered(tok, messages)[: len(t.ids)]
        tail = t.ids[t.prompt_len :]
        trained = runs(t.mask, tail)
        # the trimmed first answer: trained up to its first token the template rewrote
        assert answer_ids(tok, "4") == answers[0][:1]
        first = answers[0][:1] if trims else answers[0]
        expected = [first, answers[1], answers[2]]
        assert trained == expected
        assert t.logprobs == [LOGPROB if m else 0.0 for m in t.mask]


@pytest.mark.parametrize("family", ALL)
def test_the_next_turns_prompt_is_the_same_in_rl_evaluate_and_collect(
    family, family_checkpoint, monkeypatch
):
    """rl continues from token ids; evaluate's and collect's `local` backends render the
    conversation so far (`local_answer`): turn 2's prompt is the same ids, the template's
    rendering with the generation prompt, after a cut first turn too."""
    import asyncio

    from stages.lib.env import message_play as lib_play
    from stages.lib.model import generate

    tok = tokenizer(family, family_checkpoint)
    answers = [answer_ids(tok, "It is 4 and"), answer_ids(tok, "4") + list(answer_end(tok).ids)]
    group, engine = play(tok, answers)
    rl_turn2 = engine.prompts[-1]

    seen: list[Any] = []

    def generate_with(model: Any, tokenizer: Any, prompts: list[Any], **kw: Any) -> Any:
        ids = answers[len(seen)]
        seen.append([list(p) for p in prompts])
        return [[generation(tok, ids, prompt_ids(tok, p))] for p in prompts]

    monkeypatch.setattr(generate, "generate_with", generate_with)
    answer = lib_play.local_answer(
        None, tok, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=0, batch_size=8
    )
    episodes = asyncio.run(
        lib_play.play_batched(lambda: Guess(2), [{"prompt": QUESTION}], answer, max_turns=2)
    )
    conversation = seen[1][0]  # turn 2's conversation, as the local backends send it
    expected = rendered(tok, conversation, add_generation_prompt=True)
    assert prompt_ids(tok, conversation) == expected == rl_turn2
    assert episodes[0].messages == group[0].episode.messages
    assert episodes[0].usage == [len(engine.prompts[0]) + len(rl_turn2), sum(map(len, answers))]


@pytest.mark.parametrize("tokens", ["rerender", "extend"])
@pytest.mark.parametrize("family", FAMILIES)
def test_an_observation_the_template_refuses_fails_the_episode(family, family_checkpoint, tokens):
    """Gemma's and Mistral's templates take user and assistant turns only, alternating: in
    either multi-turn mode the episode fails with the template's reason."""
    tok = tokenizer(family, family_checkpoint)
    answers = [answer_ids(tok, "4") + list(answer_end(tok).ids)] * 2
    group, _ = play(tok, answers, role="system", tokens=tokens)
    for t in group:
        if family in ("gemma", "mistral"):
            assert t.episode.end == "failed"
            assert t.episode.error == (
                "the chat template cannot render the observation: Conversation roles must "
                "alternate user/assistant/user/assistant/..."
            )
        elif tokens == "extend":
            assert t.episode.end == "done"
            assert runs(t.mask, t.ids[t.prompt_len :]) == answers
        else:
            assert t.episode.end == "done"
            assert (
                t.ids
                == rendered(tok, t.episode.messages)[
                    : -len(encode(tok, answer_end(tok).rest)) or None
                ]
            )
