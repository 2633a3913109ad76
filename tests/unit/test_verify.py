"""Verifiers: exact rewards for each kind, a real reasoning-gym entry, user callables."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from stages.lib.config import Verifier
from stages.lib.verify import extract_answer, make_verifier, normalise


def half_credit(row: dict[str, Any], completion: str) -> float:
    """A user verifier: 0.5 when the completion mentions the answer at all."""
    return 0.5 if str(row["answer"]) in completion else 0.0


def out_of_range(row: dict[str, Any], completion: str) -> float:
    return 2.0


def as_bool(row: dict[str, Any], completion: str) -> bool:
    return completion.endswith("!")


def test_extract_answer_takes_the_last_tagged_answer_else_the_whole_text():
    assert extract_answer("I think <answer>3</answer> no, <answer> 4 </answer>.") == "4"
    assert extract_answer("  42 \n") == "42"
    assert extract_answer("<answer>unclosed") == "<answer>unclosed"
    assert extract_answer("<answer>\n1\n2\n</answer>") == "1\n2"
    assert normalise("  a \n\t b  ") == "a b"


def test_exact_match_compares_normalised_answers():
    score = make_verifier(Verifier(kind="exact_match"))
    row = {"prompt": "q", "answer": "New  York"}
    assert score(row, "<answer>new york</answer>") == 0.0
    assert score(row, "<answer> New\nYork </answer>") == 1.0
    assert score(row, "New York") == 1.0
    assert score({"answer": 12}, "<answer>12</answer>") == 1.0
    other = make_verifier(Verifier(kind="exact_match", answer_field="gold"))
    assert other({"gold": "x"}, "x") == 1.0
    with pytest.raises(ValueError, match="the row has no field 'gold'"):
        other({"answer": "x"}, "x")


def test_regex_searches_the_completion_and_fills_in_the_answer():
    plain = make_verifier(Verifier(kind="regex", pattern=r"\bdone\b"))
    assert plain({}, "all done.") == 1.0
    assert plain({}, "undone") == 0.0
    templated = make_verifier(Verifier(kind="regex", pattern=r"= {answer}$"))
    assert templated({"answer": "1+1"}, "x = 1+1") == 1.0  # the answer is escaped
    assert templated({"answer": "1+1"}, "x = 11") == 0.0


def test_math_verify_accepts_equivalent_forms():
    score = make_verifier(Verifier(kind="math"))
    assert score({"answer": "\\frac{1}{2}"}, "<answer>0.5</answer>") == 1.0
    assert score({"answer": "1/2"}, "The answer is $\\frac{2}{4}$") == 1.0
    assert score({"answer": "42"}, "<answer>42</answer>") == 1.0
    assert score({"answer": "42"}, "<answer>41</answer>") == 0.0
    assert score({"answer": "42"}, "no number here") == 0.0


def test_math_verify_works_off_the_main_thread():
    score = make_verifier(Verifier(kind="math"))
    results: list[float] = []
    thread = threading.Thread(
        target=lambda: results.append(score({"answer": "3"}, "<answer>3</answer>"))
    )
    thread.start()
    thread.join(30)
    assert results == [1.0]


def test_reasoning_gym_scores_a_real_chain_sum_entry():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    entry = reasoning_gym.create_dataset("chain_sum", size=3, seed=7)[1]
    # as the dataset stage writes it: JSON round trip (tuples become lists)
    row = json.loads(
        json.dumps(
            {
                "prompt": entry["question"],
                "answer": entry["answer"],
                "task": "chain_sum",
                "metadata": entry["metadata"],
            }
        )
    )
    score = make_verifier(Verifier(kind="reasoning_gym"))
    assert score(row, f"Let me add.\n<answer>{entry['answer']}</answer>") == 1.0
    assert score(row, entry["answer"]) == 1.0
    wrong = str(int(entry["answer"]) + 1)
    assert score(row, f"<answer>{wrong}</answer>") == 0.0
    assert score(row, "") == 0.0
    no_source = {**row, "metadata": {}}
    assert score(no_source, entry["answer"]) == 1.0  # falls back to row["task"]
    with pytest.raises(ValueError, match="names no reasoning-gym task"):
        score({"answer": "1"}, "1")


def test_user_callables_are_loaded_and_checked():
    score = make_verifier(Verifier(kind="tests.unit.test_verify:half_credit"))
    assert score({"answer": 7}, "it is 7") == 0.5
    assert score({"answer": 7}, "it is 8") == 0.0
    boolean = make_verifier(Verifier(kind="tests.unit.test_verify:as_bool"))
    assert boolean({}, "yes!") == 1.0
    assert boolean({}, "no") == 0.0
    bad = make_verifier(Verifier(kind="tests.unit.test_verify:out_of_range"))
    with pytest.raises(ValueError, match=r"the verifier returned 2.0, outside \[0, 1\]"):
        bad({}, "x")
    with pytest.raises(ValueError) as info:
        make_verifier(Verifier(kind="tests.unit.nope:fn"))
    assert str(info.value) == (
        "verifier 'tests.unit.nope:fn': cannot load it (No module named 'tests.unit.nope')"
    )
    with pytest.raises(ValueError) as info:
        make_verifier(Verifier(kind="tests.unit.test_verify:missing"))
    assert str(info.value) == (
        "verifier 'tests.unit.test_verify:missing': cannot load it "
        "(module 'tests.unit.test_verify' has no attribute 'missing')"
    )
