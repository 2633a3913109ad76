"""Training rows: prompts and targets, response-only labels, DPO pairs, and data errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.train.data import (
    DataError,
    Example,
    dpo_pairs,
    read_rows,
    samples_of,
    training_set,
)


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from stages.lib.builders.tiny import train_tokenizer

    texts = [f"What is {a} + {b}? {a + b}" for a in range(0, 100, 7) for b in range(3, 60, 11)]
    return train_tokenizer(texts, 300)


def test_prompt_and_target_from_each_row_shape():
    rows = [
        {"prompt": "1 + 1 =", "answer": 2},
        {"messages": [{"role": "user", "content": "2 + 2 ="}], "completion": "4", "reward": 1.0},
        {
            "messages": [
                {"role": "user", "content": "3 + 3 ="},
                {"role": "assistant", "content": "6"},
            ]
        },
    ]
    assert samples_of(rows[:1], "answer")[0].target == "2"
    completion = samples_of(rows[1:], "completion")
    assert completion[0].prompt == [{"role": "user", "content": "2 + 2 ="}]
    assert completion[0].target == "4"
    # a chat row without a completion learns its final assistant turn
    assert completion[1].prompt == [{"role": "user", "content": "3 + 3 ="}]
    assert completion[1].target == "6"


def test_missing_fields_are_named_with_the_row():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
    with pytest.raises(DataError) as e:
        samples_of(rows, "answer", "data.jsonl")
    assert str(e.value) == "data.jsonl: row 2 has no 'answer' (target: answer)"
    with pytest.raises(DataError) as e:
        samples_of(rows, "completion", "data.jsonl")
    assert str(e.value) == (
        "data.jsonl: row 1 has no 'completion' (target: completion; use target: answer for gold "
        "answers)"
    )
    with pytest.raises(DataError) as e:
        samples_of([{"answer": "1"}], "answer", "data.jsonl")
    assert str(e.value) == "data.jsonl: row 1 has neither 'messages' nor a string 'prompt'"


def test_read_rows_names_the_bad_line(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DataError) as e:
        read_rows(str(path))
    assert str(e.value).startswith(f"{path}:3: not valid JSON: ")
    path.write_text('{"prompt": "a"}\n\n[1]\n')
    with pytest.raises(DataError, match=r":3: expected a JSON object per line$"):
        read_rows(str(path))
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert read_rows(str(path)) == [{"prompt": "a"}, {"prompt": "b"}]


def test_labels_mask_the_prompt_and_end_with_eos(tokenizer):
    data = training_set(
        [{"prompt": "What is 40 + 2?", "answer": 42}],
        tokenizer,
        algorithm="sft",
        target="answer",
        max_length=64,
    )
    (ex,) = data.examples
    prompt = tokenizer("<|bos|><|user|>What is 40 + 2?<|assistant|>", add_special_tokens=False)
    p_ids = prompt["input_ids"]
    assert ex.prompt_len == len(p_ids)
    assert list(ex.input_ids[: ex.prompt_len]) == p_ids
    assert tokenizer.decode(ex.input_ids[ex.prompt_len :]) == "42<|eos|>"
    assert ex.labels() == [-100] * len(p_ids) + list(ex.input_ids[ex.prompt_len :])
    assert ex.input_ids[-1] == tokenizer.eos_token_id
    # digits are single tokens: "4", "2", then EOS
    assert ex.response_len == 3
    assert data.units == [(0,)]


def test_long_sequences_are_cut_and_prompt_only_ones_dropped(tokenizer):
    rows = [
        {"prompt": "What is 40 + 2?", "answer": "4242424242"},
        {"prompt": "What is 40 + 2? " * 20, "answer": "1"},
    ]
    data = training_set(rows, tokenizer, algorithm="sft", target="answer", max_length=20)
    assert data.dropped == 1
    (ex,) = data.examples
    assert len(ex.input_ids) == 20
    assert tokenizer.decode(ex.input_ids[ex.prompt_len :]) == "4242424242"[: 20 - ex.prompt_len]


def rollout(idx: int, sample: int, reward: float, text: str) -> dict[str, object]:
    return {
        "prompt": f"q{idx}",
        "prompt_idx": idx,
        "sample_idx": sample,
        "completion": text,
        "reward": reward,
    }


def test_dpo_pairs_rank_by_reward_and_skip_ties_and_repeats():
    rows = [
        rollout(0, 1, 0.0, "b"),  # 0
        rollout(2, 0, 0.5, "x"),  # 1
        rollout(0, 0, 1.0, "a"),  # 2
        rollout(1, 0, 1.0, "same"),  # 3
        rollout(0, 3, 0.0, "b"),  # 4: same text as row 0
        rollout(1, 1, 1.0, "other"),  # 5: prompt 1 rewards all equal
        rollout(0, 2, 1.0, "c"),  # 6
        rollout(2, 1, 1.0, "y"),  # 7
    ]
    assert dpo_pairs(rows) == [(2, 0), (6, 0), (7, 1)]


def test_dpo_pairs_group_by_prompt_when_no_index():
    rows = [
        {"prompt": "p", "completion": "good", "reward": 1},
        {"prompt": "q", "completion": "bad", "reward": 0},
        {"prompt": "p", "completion": "bad", "reward": 0},
    ]
    assert dpo_pairs(rows) == [(0, 2)]


def test_dpo_needs_rewards():
    with pytest.raises(DataError, match=r"^row 1 has no numeric 'reward' \(algorithm: dpo\)$"):
        dpo_pairs([{"prompt": "p", "completion": "c"}])


def test_dpo_training_set_interleaves_chosen_and_rejected(tokenizer):
    rows = [rollout(0, 0, 1.0, "12"), rollout(0, 1, 0.0, "13"), rollout(1, 0, 0.0, "7")]
    data = training_set(rows, tokenizer, algorithm="dpo", target="completion", max_length=64)
    assert data.units == [(0, 1)]
    chosen, rejected = data.examples
    assert tokenizer.decode(chosen.input_ids[chosen.prompt_len :]) == "12<|eos|>"
    assert tokenizer.decode(rejected.input_ids[rejected.prompt_len :]) == "13<|eos|>"


def test_example_labels_roundtrip():
    ex = Example((5, 6, 7, 8), 2)
    assert ex.labels() == [-100, -100, 7, 8]
    assert ex.response_len == 2
