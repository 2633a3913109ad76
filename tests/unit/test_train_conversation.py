"""Conversations (collect's episode rows) as training rows: the loss on every assistant turn
only, the shared chat template around them, failed episodes left out."""

from __future__ import annotations

import pytest

from stages.train.data import Example, dpo_pairs, samples_of, training_set

EPISODE = {
    "prompt_idx": 0,
    "sample_idx": 0,
    "prompt": "What is 12 * 7?",
    "answer": "84",
    "messages": [
        {"role": "system", "content": "Use calc: lines."},
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "calc: 12 * 7"},
        {"role": "user", "content": "result: 84"},
        {"role": "assistant", "content": "84"},
    ],
    "rewards": [0.0, 1.0],
    "total_reward": 1.0,
    "turns": 2,
    "solved": True,
    "end": "done",
    "reward": 1.0,
}


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from stages.lib.builders.tiny import train_tokenizer

    texts = ["What is 12 * 7? calc: 12 * 7 result: 84 Use calc: lines."] * 4
    return train_tokenizer(texts, 300)


def test_an_episode_row_is_a_sample_with_every_assistant_turn():
    (sample,) = samples_of([EPISODE], "completion")
    assert sample.prompt == EPISODE["messages"][:2]
    assert sample.target == "calc: 12 * 7"
    assert sample.later == (([{"role": "user", "content": "result: 84"}], "84"),)
    assert sample.texts() == [
        "Use calc: lines.",
        "What is 12 * 7?",
        "calc: 12 * 7",
        "result: 84",
        "84",
    ]


def test_only_assistant_tokens_carry_labels(tokenizer):
    data = training_set([EPISODE], tokenizer, algorithm="sft", target="completion", max_length=128)
    (ex,) = data.examples
    text = (
        "<|bos|><|system|>Use calc: lines.<|user|>What is 12 * 7?<|assistant|>calc: 12 * 7<|eos|>"
        "<|user|>result: 84<|assistant|>84<|eos|>"
    )
    # the sequence is the chat template's rendering of the whole conversation
    assert list(ex.input_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = ex.labels()
    trained = [t for t, label in zip(ex.input_ids, labels, strict=True) if label != -100]
    assert tokenizer.decode(trained) == "calc: 12 * 7<|eos|>84<|eos|>"
    assert all(label in (-100, t) for t, label in zip(ex.input_ids, labels, strict=True))
    (first, second) = ex.trained()
    assert tokenizer.decode(ex.input_ids[: first[0]]).endswith("What is 12 * 7?<|assistant|>")
    assert tokenizer.decode(ex.input_ids[first[1] : second[0]]) == "<|user|>result: 84<|assistant|>"
    assert ex.response_len == len(trained)
    assert ex.prompt_len == first[0]


def test_one_turn_conversation_trains_as_before(tokenizer):
    row = {"messages": EPISODE["messages"][:3]}
    (ex,) = training_set(
        [row], tokenizer, algorithm="sft", target="completion", max_length=64
    ).examples
    assert ex.spans == ()
    assert tokenizer.decode(ex.input_ids[ex.prompt_len :]) == "calc: 12 * 7<|eos|>"


def test_a_cut_conversation_keeps_the_turns_that_fit(tokenizer):
    full = training_set([EPISODE], tokenizer, algorithm="sft", target="completion", max_length=128)
    (whole,) = full.examples
    (first, second) = whole.trained()
    limit = second[0] + 1  # one token of the second turn fits
    (ex,) = training_set(
        [EPISODE], tokenizer, algorithm="sft", target="completion", max_length=limit
    ).examples
    assert ex.trained() == (first, (second[0], limit))
    limit = first[1] + 2  # the second turn does not start within the bound
    (ex,) = training_set(
        [EPISODE], tokenizer, algorithm="sft", target="completion", max_length=limit
    ).examples
    assert ex.trained() == (first,)


def test_collate_targets_match_the_labels(tokenizer):
    pytest.importorskip("torch")
    from stages.train.batch_plan import Micro
    from stages.train.loss import collate

    (ex,) = training_set(
        [EPISODE], tokenizer, algorithm="sft", target="completion", max_length=128
    ).examples
    batch = collate(Micro((0,), ((0,),)), [ex], 0, False)
    # position t predicts token t+1
    assert batch.targets[0, :-1].tolist() == ex.labels()[1:]
    assert batch.targets[0, -1].item() == -100


def test_failed_episodes_are_left_out(tokenizer):
    failed = dict(EPISODE, end="failed", error="step raised ValueError: boom", messages=[])
    data = training_set(
        [failed, EPISODE], tokenizer, algorithm="sft", target="completion", max_length=128
    )
    assert len(data.examples) == 1 and data.dropped == 1
    assert samples_of([failed], "completion") == []


def test_episodes_pair_for_dpo_by_total_reward():
    worse = dict(
        EPISODE,
        sample_idx=1,
        reward=0.0,
        messages=[*EPISODE["messages"][:4], {"role": "assistant", "content": "85"}],
    )
    failed = dict(EPISODE, sample_idx=2, reward=-1.0, end="failed", error="hung")
    assert dpo_pairs([worse, EPISODE, failed]) == [(1, 0)]


def test_example_labels_with_spans():
    ex = Example((1, 2, 3, 4, 5, 6), 1, ((1, 3), (4, 6)))
    assert ex.labels() == [-100, 2, 3, -100, 5, 6]
    assert ex.response_len == 4
