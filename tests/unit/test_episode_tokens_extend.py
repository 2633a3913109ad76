"""rl's token-in, token-out multi-turn mode (`multi_turn_tokens: extend`, the default; issue 57
point 4), on every family with its real tokenizer: each turn's prompt is the ids so far (the
opening, then each answer's ids as sampled) followed by the template's rendering of only what
follows them, the observation and the generation prompt.

Checked: every sampled id of every turn is in the final sequence, in order, with its
behaviour log-prob and mask 1, answers beginning or ending with whitespace under a template
that trims them (Llama 3's, Gemma's) included; the ids between two answers are the template's
text after the first answer's closing token, through the next generation prompt, tokenized; and
each turn's prompt begins with all ids so far (NeMo RL's contiguity check)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.chat.clock import render
from stages.lib.chat.tokens import answer_end
from tests.unit.test_episode_tokens import (
    ALL,
    LOGPROB,
    QUESTION,
    TRIMS,
    answer_ids,
    encode,
    play,
    rendered,
    runs,
    sampled_ids,
    tokenizer,
)

SENTINEL = "PIPEANSWERSENTINEL7"


def between(tok: Any, messages: list[dict[str, str]], closed: bool) -> str:
    """The template's text after the last assistant turn's closing token (its whole closing
    where the answer was cut), through the generation prompt: written out here from the two
    renderings, independently of `follow_ids`."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    fixed = [*messages[:last], {"role": "assistant", "content": SENTINEL}, *messages[last + 1 :]]
    full = render(tok, fixed, add_generation_prompt=True)
    end = answer_end(tok)
    at = full.index(SENTINEL) + len(SENTINEL)
    assert full[at:].startswith(end.text)
    skip = len(end.text) - len(end.rest) if closed else 0
    return full[at + skip :]


@pytest.mark.parametrize("family", ALL)
def test_every_sampled_id_is_trained_as_sampled(family, family_checkpoint):
    """Three turns: closed with whitespace the template trims, cut at max_new_tokens (closed
    by the template outside the loss), then closed."""
    tok = tokenizer(family, family_checkpoint)
    end = answer_end(tok)
    texts = ["4\n ", "It is 4 and", "4 "]
    trims = family.partition("-")[0] in TRIMS

    def sampled(text: str) -> list[int]:  # the whitespace a template trims, as sampled
        return sampled_ids(tok, family, text)

    answers = [
        sampled(texts[0]) + list(end.ids),
        sampled(texts[1]),
        sampled(texts[2]) + list(end.ids),
    ]
    group, engine = play(tok, answers, tokens="extend")
    opening = rendered(tok, [{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    for t in group:
        assert t.episode.end == "done" and t.episode.rewards == [0.0, 0.0, 1.0]
        messages = t.episode.messages
        assert [m["content"] for m in messages if m["role"] == "assistant"] == texts
        assert t.ids[: t.prompt_len] == opening
        tail = t.ids[t.prompt_len :]
        assert len(t.mask) == len(t.logprobs) == len(tail)
        assert runs(t.mask, tail) == answers
        assert t.logprobs == [LOGPROB if m else 0.0 for m in t.mask]
        gaps = [between(tok, messages[:3], closed=True), between(tok, messages[:5], False)]
        assert runs([1 - m for m in t.mask], tail) == [encode(tok, g) for g in gaps]
        if not trims:  # the answers render as sampled: the template's rendering, up to the last
            assert t.ids == rendered(tok, messages)[: len(t.ids)]
    # each turn's prompt is every id before it: turn 1's prompt, then all it was answered
    first, second, third = engine.prompts[0], engine.prompts[1], engine.prompts[-1]
    assert second[: len(first) + len(answers[0])] == first + answers[0]
    assert third[: len(second) + len(answers[1])] == second + answers[1]
    assert group[0].ids == third + answers[2]


@pytest.mark.parametrize("family", ["llama3", "llama3-real", "chatml"])
def test_an_answer_beginning_with_whitespace_keeps_every_token(family, family_checkpoint):
    """The case `rerender` loses whole (a trimming template drops the answer's first token):
    in `extend`, the first answer's ids are all trained, and the episode differs from
    `rerender`'s only where the template rewrote them."""
    tok = tokenizer(family, family_checkpoint)
    end = answer_end(tok)
    answers = [
        encode(tok, " 4") + list(end.ids),
        answer_ids(tok, "4") + list(end.ids),
    ]
    extended, _ = play(tok, answers, tokens="extend")
    again, _ = play(tok, answers, tokens="rerender")
    tail = extended[0].ids[extended[0].prompt_len :]
    assert runs(extended[0].mask, tail) == answers
    kept = runs(again[0].mask, again[0].ids[again[0].prompt_len :])
    if family.startswith("llama3"):  # `| trim`: the sampled space is not rendered
        assert kept == [answers[1]]
    else:
        assert kept == answers


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_an_episode_past_max_length_ends_there(family, family_checkpoint):
    """No room for the next answer once the observation is appended: the episode ends at
    "length" after its first answer, as in `rerender`."""
    tok = tokenizer(family, family_checkpoint)
    answers = [answer_ids(tok, "4") + list(answer_end(tok).ids)] * 2
    opening = rendered(tok, [{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    group, engine = play(
        tok, answers, tokens="extend", max_length=len(opening) + len(answers[0]) + 2
    )
    assert engine.calls == 1
    for t in group:
        assert t.episode.end == "length" and t.ids == opening + answers[0]
