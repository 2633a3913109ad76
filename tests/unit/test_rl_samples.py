"""The records an rl run is audited by: a few samples per logged step, as text and as ids,
with the loss mask, log-probabilities, reward and advantage lined up token by token."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from stages.lib.io.audit import token_record
from stages.rl.algo.logprobs import Sample
from stages.rl.controller.records import SAMPLES_PER_STEP, logs_samples, sample_records


class Chars:
    """A tokenizer whose ids are character codes."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def sample(prompt: str, answer: str, **extra: Any) -> Sample:
    ids = tuple(ord(c) for c in prompt + answer)
    return Sample(ids=ids, prompt_len=len(prompt), **extra)


def test_each_logged_sample_lines_up_ids_mask_and_logprobs():
    samples = [
        sample("1+2=", "3.", old_logprobs=(-0.1, -0.2), reward=1.0, advantage=0.5, version=3),
        sample("2+2=", "5?4", old_logprobs=(-1.0, -2.0, -0.5), mask=(1, 0, 1), advantage=-0.5),
    ] + [sample("0+0=", "0", old_logprobs=(-0.3,))] * 5
    rows = sample_records(7, samples, Chars())
    assert len(rows) == SAMPLES_PER_STEP == 4  # the first ones of the batch
    first, second = rows[0], rows[1]
    assert first["step"] == 7 and first["index"] == 0 and first["version"] == 3
    assert (first["prompt"], first["completion"]) == ("1+2=", "3.")
    assert first["prompt_ids"] == [ord(c) for c in "1+2="]
    assert first["completion_ids"] == [ord("3"), ord(".")]
    assert first["loss_mask"] == [1, 1]  # no mask: every completion token is trained
    assert first["behaviour_logprobs"] == [-0.1, -0.2]
    assert (first["reward"], first["advantage"]) == (1.0, 0.5)
    assert second["loss_mask"] == [1, 0, 1]  # an observation token carries no loss
    for row in rows:
        n = len(row["completion_ids"])
        assert len(row["loss_mask"]) == len(row["behaviour_logprobs"]) == n
        assert row["ref_logprobs"] == [] and row["advantages"] == []  # not in this step
        assert row["teacher_logprobs"] == []


@pytest.mark.parametrize(
    ("every", "steps", "logged"),
    [
        (10, 3, [1]),  # a 3-step run shows its first batch
        (10, 25, [1, 10, 20]),
        (2, 5, [1, 2, 4]),
        (1, 3, [1, 2, 3]),
        (0, 25, []),  # 0: none
    ],
)
def test_samples_are_logged_at_step_1_and_every_log_samples_every_th_step(
    every: int, steps: int, logged: list[int]
):
    assert [s for s in range(1, steps + 1) if logs_samples(s, every)] == logged


def test_a_mask_that_does_not_match_the_completion_is_refused():
    with pytest.raises(ValueError, match="2 mask values for 3 completion ids"):
        token_record(Chars(), [1, 2, 3, 4], 1, [1, 1])


def test_settings_json_names_the_stop_ids_with_max_output_tokens(tmp_path):
    from stages.rl import RLConfig
    from stages.rl.controller.records import write_settings

    cfg = RLConfig.model_validate({"input": "x.jsonl", "model": "m"})
    how = {k: ("applied", "acts") for k in RLConfig.model_fields}
    write_settings(str(tmp_path / "settings.json"), cfg, how, [2, 7])
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert sorted(settings) == sorted(RLConfig.model_fields)  # still one entry per setting
    assert settings["max_output_tokens"]["stop_ids"] == [2, 7]
    assert settings["max_output_tokens"]["how"].endswith("stop ids [2, 7]")


def test_train_writes_its_first_batch_as_text_ids_and_loss_mask(tmp_path):
    from stages.train.data import Example
    from stages.train.worker import write_first_batch

    examples = [
        Example(input_ids=tuple(ord(c) for c in "1+2=3."), prompt_len=4),
        Example(input_ids=tuple(ord(c) for c in "a?b!c."), prompt_len=2, spans=((2, 4), (5, 6))),
        Example(input_ids=tuple(ord(c) for c in "9+9=18"), prompt_len=4),
    ]
    step = SimpleNamespace(units=(1, 0))  # the first step trains units 1 and 0
    loop = SimpleNamespace(
        plan=SimpleNamespace(total_steps=3, step=lambda i: step),
        data=SimpleNamespace(examples=examples, units=[(0,), (1,), (2,)]),
    )
    path = tmp_path / "first_batch.jsonl"
    write_first_batch(loop, Chars(), str(path))  # type: ignore[arg-type]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["unit"] for r in rows] == [1, 0]
    assert (rows[0]["prompt"], rows[0]["completion"]) == ("a?", "b!c.")
    assert rows[0]["loss_mask"] == [1, 1, 0, 1]  # a conversation's other turn is not trained
    assert rows[1]["completion_ids"] == [ord("3"), ord(".")] and rows[1]["loss_mask"] == [1, 1]
