"""Local batched generation: determinism, shapes, finish reasons, prompt formats."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.model.generate import Generation, generate  # noqa: E402
from tests.unit.test_model import rigged_checkpoint, tiny_checkpoint  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["12 + 5 =", "What is 7 + 80?", "3", "What is 91 + 4? Think then answer."]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    plain = tiny_checkpoint(root)
    return {
        "plain": plain,
        "sevens": rigged_checkpoint(plain, root / "sevens", "7"),
        "stops": rigged_checkpoint(plain, root / "stops", "<|eos|>"),
    }


def _texts(out: list[list[Generation]]) -> list[list[str]]:
    return [[g.text for g in row] for row in out]


def test_greedy_is_deterministic_and_independent_of_batching(models: dict[str, Path]):
    kw = {"num_samples": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 6, "seed": 0}
    one = generate(str(models["plain"]), PROMPTS, batch_size=1, **kw)
    again = generate(str(models["plain"]), PROMPTS, batch_size=1, **kw)
    batched = generate(str(models["plain"]), PROMPTS, batch_size=4, **kw)
    assert one == again
    assert _texts(batched) == _texts(one)  # left padding does not change the answer


def test_samples_have_the_requested_shape_and_seeded_randomness(models: dict[str, Path]):
    kw = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 5, "batch_size": 8}
    out = generate(str(models["plain"]), PROMPTS[:3], num_samples=5, seed=3, **kw)
    assert [len(row) for row in out] == [5, 5, 5]
    assert out == generate(str(models["plain"]), PROMPTS[:3], num_samples=5, seed=3, **kw)
    assert out != generate(str(models["plain"]), PROMPTS[:3], num_samples=5, seed=4, **kw)
    texts = {g.text for row in out for g in row}
    assert len(texts) > 1  # sampling at temperature 1 from a random model varies


def test_answers_cut_by_the_budget_finish_with_length(models: dict[str, Path]):
    out = generate(
        str(models["sevens"]),
        PROMPTS,
        num_samples=2,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=3,
        seed=0,
        batch_size=3,
    )
    prompt_lengths = [row[0].prompt_tokens for row in out]
    assert all(
        g == Generation("777", "length", n, 3)
        for row, n in zip(out, prompt_lengths, strict=True)
        for g in row
    )
    assert prompt_lengths[2] == 4  # <|bos|> <|user|> 3 <|assistant|>


def test_end_of_sequence_finishes_with_stop(models: dict[str, Path]):
    out = generate(
        str(models["stops"]),
        ["1 + 1 ="],
        num_samples=1,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=8,
        seed=0,
        batch_size=1,
    )
    assert out == [[Generation("", "stop", out[0][0].prompt_tokens, 1)]]


def test_a_string_is_a_single_user_message(models: dict[str, Path]):
    kw = {
        "num_samples": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": 4,
        "seed": 0,
        "batch_size": 2,
    }
    as_text = generate(str(models["plain"]), ["12 + 5 ="], **kw)
    as_messages = generate(str(models["plain"]), [[{"role": "user", "content": "12 + 5 ="}]], **kw)
    assert as_text == as_messages
    with_system = generate(
        str(models["plain"]),
        [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 5 ="}]],
        **kw,
    )
    assert with_system[0][0].prompt_tokens > as_text[0][0].prompt_tokens


def test_a_tiny_nucleus_keeps_only_the_top_token(models: dict[str, Path]):
    kw = {"num_samples": 1, "max_new_tokens": 5, "seed": 0, "batch_size": 4}
    greedy = generate(str(models["plain"]), PROMPTS, temperature=0.0, top_p=1.0, **kw)
    nucleus = generate(str(models["plain"]), PROMPTS, temperature=1.0, top_p=1e-6, **kw)
    assert _texts(nucleus) == _texts(greedy)


def test_decoding_passes_the_kv_cache_by_its_current_name_without_a_deprecation_warning(
    models: dict[str, Path],
):
    """transformers 5.24 renames `past_key_values` to `cache` (the old name warns on every run
    and goes in 5.40); older releases take `past_key_values` only."""
    import inspect
    import logging

    from stages.lib.model.generate import load

    model, _ = load(str(models["sevens"]))  # never ends early: prefill, then every step
    current = "cache" if "cache" in inspect.signature(type(model).forward).parameters else None
    passed: list[set[str]] = []
    spy = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: passed.append({"cache", "past_key_values"} & set(kwargs)),
        with_kwargs=True,
    )
    messages: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(catch)
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    try:
        generate(str(models["sevens"]), PROMPTS[:2], num_samples=2, max_new_tokens=3)
    finally:
        logging.getLogger("transformers").removeHandler(catch)
        spy.remove()
    assert passed == [set()] + [{current or "past_key_values"}] * 2  # prefill, then 2 steps
    assert [m for m in messages if "deprecated" in m] == []


def test_a_lora_model_decodes_with_its_base_models_cache_name(models: dict[str, Path]):
    """A peft model's own forward takes **kwargs: the cache's name is its base model's, so
    rl's local engine with `lora:` warns no deprecation either."""
    import inspect

    peft = pytest.importorskip("peft")
    from stages.lib.model.generate import generate_with, load

    base, tokenizer = load(str(models["sevens"]))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    current = "cache" if "cache" in inspect.signature(type(base).forward).parameters else None
    passed: list[set[str]] = []
    spy = base.register_forward_pre_hook(
        lambda _m, _a, kwargs: passed.append({"cache", "past_key_values"} & set(kwargs)),
        with_kwargs=True,
    )
    kw = {"num_samples": 1, "temperature": 0.0, "top_p": 1.0, "seed": 0, "batch_size": 2}
    try:
        generate_with(lora, tokenizer, PROMPTS[:2], max_new_tokens=3, **kw)
    finally:
        spy.remove()
    assert passed == [set()] + [{current or "past_key_values"}] * 2  # prefill, then 2 steps


def test_the_prefill_projects_only_the_last_position_onto_the_vocabulary(
    models: dict[str, Path],
):
    """`model.generate`'s habit (`logits_to_keep=1`): at Gemma 3's 262k-token vocabulary the
    logits of every prompt position cost as much as the rest of the prefill; the answers are
    the same."""
    from stages.lib.model.generate import load

    model, _ = load(str(models["plain"]))
    head = model.get_output_embeddings()
    rows: list[int] = []
    spy = head.register_forward_hook(lambda _m, _a, out: rows.append(out.shape[1]))
    kw = {"num_samples": 2, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 3, "seed": 0}
    try:
        out = generate(str(models["plain"]), PROMPTS[3:], **kw)
    finally:
        spy.remove()
    assert rows[0] == 1  # the prompt is several tokens long: only its last is projected
    assert rows == [1] * len(rows)
    assert len(out[0]) == 2
