"""A reward model reads what it was trained on, wherever it is read: the rl stage's sequences
scored as evaluate scores the same text, cut at max_output_tokens or not, on the policy's ids
or on text the reward model's own tokenizer and template make; which of the two the plan
chooses and `--explain` says; the pad a saved reward model's tokenizer and config agree on;
the statistics `normalize_reward` divides by. Tiny models built from config, on the CPU."""

from __future__ import annotations

import json
import logging
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.reward_models import build_policy, build_reward_model

pytest.importorskip("transformers")
PROMPT = "5 + 7 ="


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("models")
    policy = build_policy(root / "policy")
    return policy, build_reward_model(policy, root / "rm"), AutoTokenizer.from_pretrained(policy)


def trace(tokenizer: Any, answer: list[int]) -> Any:
    """An rl episode of one turn: the prompt as the engine was given it, then `answer`."""
    from stages.lib.chat.prompt import prompt_ids
    from stages.lib.env.contract import Episode
    from stages.rl.rollout.token_play import Trace

    text = tokenizer.decode(answer, skip_special_tokens=True)
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": text}]
    ids = prompt_ids(tokenizer, PROMPT)
    t = Trace(Episode({"prompt": PROMPT}, None, messages), ids + answer, len(ids))  # type: ignore[arg-type]
    t.answers.append((tuple(answer), (0.0,) * len(answer)))
    return t


def rl_scores(rm: Path, tokenizer: Any, traces: list[Any], mode: str) -> list[float]:
    """The scores the rl stage's reward role gives `traces` (`RewardRanks.score`'s payload)."""
    from stages.rl.roles.reward import RewardRank, sequences

    config = SimpleNamespace(bf16=False, micro_train_batch_size=4)
    rank = RewardRank(SimpleNamespace(config=config, model_dir=str(rm)), 0, 1, "cpu")
    return rank.reward_scores(sequences(traces, tokenizer, mode)) or []


def evaluate_scores(rm: Path, completions: list[str]) -> list[float]:
    from stages.evaluate.reward_scores import SCORE, score_samples

    samples = [{"prompt_idx": 0, "completion": c, "checkpoint": "c"} for c in completions]
    score_samples(str(rm), [{"prompt": PROMPT}], samples, "cpu")
    return [s[SCORE] for s in samples]


def test_rl_scores_an_answer_as_evaluate_does_whether_it_stopped_or_was_cut(models: Any) -> None:
    from stages.lib.chat.tokens import answer_end
    from stages.lib.model.reward_model import load_reward_model, score

    _, rm, tokenizer = models
    answer = tokenizer("12", add_special_tokens=False)["input_ids"]
    stopped = trace(tokenizer, [*answer, answer_end(tokenizer).stop_id])
    cut = trace(tokenizer, answer)  # at max_output_tokens: no closing token
    expected = evaluate_scores(rm, ["12", "12"])
    for mode in ("ids", "text"):
        assert rl_scores(rm, tokenizer, [stopped, cut], mode) == pytest.approx(expected, abs=1e-5)
    # read at the content token the cut answer ended on, as before, the score was another
    model = load_reward_model(str(rm), False, "cpu")
    assert abs(score(model, [cut.ids], 1)[0] - expected[1]) > 0.1


def test_closing_keeps_an_end_replaces_another_stop_and_appends_to_a_cut() -> None:
    from stages.lib.model.reward_model import closed

    assert closed([5, 6, 2], [2], [2, 9]) == [5, 6, 2]
    assert closed([5, 6, 9], [2], [2, 9]) == [5, 6, 2]
    assert closed([5, 6], [7, 2], [2]) == [5, 6, 7, 2]


def other_template(rm: Path, out: Path) -> Path:
    """`rm` with a chat template of its own: turns rendered after a system marker."""
    from engine.checkpoint import chat_template

    shutil.copytree(rm, out)
    template = chat_template(str(rm))
    assert isinstance(template, str)
    (out / "chat_template.jinja").write_text("<|system|>" + template)
    return out


def test_a_reward_model_with_its_own_template_reads_text_and_the_plan_says_so(
    models: Any, tmp_path: Path
) -> None:
    from stages.lib.model.reward_tokens import compare

    policy, rm, tokenizer = models
    other = other_template(rm, tmp_path / "other")
    assert compare(str(policy), None, str(rm)).mode == "ids"
    assert (compare(str(policy), None, str(other)).differs) == "chat template"
    answer = tokenizer("12", add_special_tokens=False)["input_ids"]
    traces = [trace(tokenizer, answer)]
    as_text = rl_scores(other, tokenizer, traces, "text")
    assert as_text == pytest.approx(evaluate_scores(other, ["12"]), abs=1e-5)
    assert abs(rl_scores(other, tokenizer, traces, "ids")[0] - as_text[0]) > 0.1

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    pipeline = """\
        name: p
        stages:
          same: {kind: rl, config: {input: d.jsonl, model: %s, reward_model: %s}}
          other: {kind: rl, config: {input: d.jsonl, model: %s, reward_model: other}}
          forced: {kind: rl, config: {input: d.jsonl, model: %s, reward_model: other, %s}}
        """
    text = textwrap.dedent(pipeline % (policy, rm, policy, policy, "reward_sequences: ids"))
    (tmp_path / "p.yaml").write_text(text)
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    column = text.splitlines()[4].index("reward_sequences: ids") + len("reward_sequences: ") + 1
    assert result.stderr.splitlines() == [
        f"p.yaml:5:{column}: stages.forced.config.reward_sequences: ids: the reward model's "
        "chat template differs from the policy's, so the policy's ids are not what it reads: "
        "use text (or auto)"
    ]
    (tmp_path / "p.yaml").write_text(textwrap.dedent(pipeline % (policy, rm, policy, policy, "")))
    lines = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path).stdout.splitlines()
    said = [" ".join(line.split()) for line in lines if "reward_sequences" in line]
    ids = "the reward model has the policy's tokenizer and chat template: the policy's ids"
    text = (
        "the reward model's chat template differs from the policy's: each answer decoded, "
        "rendered with the reward model's chat template and tokenized with its tokenizer (as TRL)"
    )
    assert said == [
        f'reward_sequences "ids" <- rule: {ids}',
        f'reward_sequences "text" <- rule: {text}',
        f'reward_sequences "text" <- rule: {text}',
    ]


def test_a_saved_reward_model_pads_as_its_config_says_and_one_that_does_not_is_repaired(
    models: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from stages.lib.model.reward_model import (
        RewardScorer,
        reward_config,
        score_pad_id,
        tokenizer_pad,
    )
    from stages.lib.model.save import write_checkpoint

    policy, _, _ = models
    base = Path(shutil.copytree(policy, tmp_path / "base"))
    llama3 = AutoTokenizer.from_pretrained(base)
    llama3.pad_token = llama3.eos_token  # pads with its end of turn, as Llama 3 releases do
    llama3.save_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    pad = score_pad_id(llama3, model.config)  # never the closing token: bos here
    assert (pad, llama3.pad_token_id) == (llama3.bos_token_id, llama3.eos_token_id)
    token = llama3.convert_ids_to_tokens(pad)
    out = str(tmp_path / "rm")
    fields = reward_config(model, pad)
    write_checkpoint(
        model, None, str(base), out, "float32", fields, lambda d: tokenizer_pad(d, token, pad)
    )
    saved = json.loads(Path(out, "config.json").read_text())["pad_token_id"]
    assert saved == AutoTokenizer.from_pretrained(out).pad_token_id == pad

    tokenizer_pad(out, llama3.eos_token, llama3.eos_token_id)  # as saved elsewhere
    with caplog.at_level(logging.WARNING, logger="pipe.reward_model"):
        scorer = RewardScorer(out)
    assert scorer.tokenizer.pad_token_id == pad
    assert [r.getMessage() for r in caplog.records if r.name == "pipe.reward_model"] == [
        f"reward model '{out}': its tokenizer pads with '<|eos|>' (id 2) and its config.json's "
        "pad_token_id is 1 ('<|bos|>'); padding with the config's, which transformers pools "
        "the score by (a checkpoint pipe's train with algorithm rm saves has the two equal)"
    ]


def test_normalize_reward_divides_by_the_statistics_training_stored(
    models: Any, tmp_path: Path
) -> None:
    import statistics

    from stages.lib.model.reward_model import reward_stats, saved_stats

    stats = reward_stats([1.0, 3.0, 2.0, 6.0])
    assert stats == {"mean": 3.0, "std": pytest.approx(statistics.stdev([1, 3, 2, 6]))}
    assert reward_stats([2.0, 2.0])["std"] == 1e-8  # OpenRLHF's floor
    assert saved_stats({**stats, "x": 1}) == (3.0, stats["std"])
    assert saved_stats({"mean": 0.0}) is None

    policy, rm, _ = models
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl: {{kind: rl, config: {{input: d.jsonl, model: {policy}, "
        f"reward_model: {rm}, normalize_reward: true}}}}\n"
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    column = result.stderr.index("stages.rl")
    assert result.stderr[column:].rstrip() == (
        f"stages.rl.config.normalize_reward: '{rm}': its config.json holds no reward "
        "statistics ('mean' and 'std', which train with algorithm rm writes at the end of "
        "training, as OpenRLHF's does), and normalize_reward divides by them: retrain it with "
        "this version of pipe, add them to its config.json, or leave normalize_reward out"
    )
