"""Reward models without processes: the pair shapes read, the sequence scored, the loss with
its margin, filter's pairs from rollouts, dataset pairs, and evaluate's reward-model score."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from engine.stage import StageContext, get_kind
from stages.filter import FilterConfig
from stages.lib.io.preference import PairError, check_pair_rows, pair_prompt_key
from stages.train.data import DataError

HH = {  # Anthropic HH: two whole texts, the prompt implicit
    "chosen": "\n\nHuman: 2 + 2?\n\nAssistant: 4",
    "rejected": "\n\nHuman: 2 + 2?\n\nAssistant: 5",
}
UF = {  # UltraFeedback-binarized: a prompt, and each response the whole conversation
    "prompt": "2 + 2?",
    "chosen": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
    "rejected": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "5"}],
    "score_chosen": 9.0,
    "score_rejected": 2.0,
}
EXPLICIT = {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("transformers")
    from stages.lib.builders.tiny import train_tokenizer

    texts = [
        "Human: 2 + 2? Assistant: 4 5",
        *(f"{a} + {b} = {a + b}" for a in range(50) for b in (3, 7)),
    ]
    return train_tokenizer(texts, 300)


def test_the_pair_shapes_of_hh_ultrafeedback_and_explicit_prompts_are_read() -> None:
    assert check_pair_rows([HH, UF, EXPLICIT], "p") == 3
    # a rollout that stopped at once is an answer (an empty one) to its prompt: filter's pairs
    assert check_pair_rows([{**EXPLICIT, "rejected": ""}], "p") == 1
    assert pair_prompt_key(HH) == "\n\nHuman: 2 + 2?\n\nAssistant: "
    assert pair_prompt_key(UF) == pair_prompt_key(EXPLICIT) == "2 + 2?"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"prompt": "q", "chosen": "a"},
            "p: row 2 has no 'rejected' (a preference pair needs 'chosen' and 'rejected', each "
            "text or messages; 'prompt' optional)",
        ),
        (
            {"chosen": "a", "rejected": ""},
            "p: row 2 'rejected' is empty (and there is no 'prompt' it answers)",
        ),
        (
            {"chosen": "a", "rejected": 3},
            "p: row 2 'rejected' is int, not text or a list of messages",
        ),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": "b"},
            "p: row 2 'chosen' does not end with an assistant message (found 'user')",
        ),
    ],
)
def test_a_row_that_is_no_pair_is_named_by_its_number(row: dict[str, Any], message: str) -> None:
    with pytest.raises(PairError) as e:
        check_pair_rows([EXPLICIT, row], "p")
    assert str(e.value) == message


def test_the_sequence_scored_is_what_training_on_rollouts_sees(tokenizer: Any) -> None:
    from stages.lib.chat.prompt import prompt_ids
    from stages.lib.chat.tokens import answer_end
    from stages.lib.model.reward_model import score_ids

    end = list(answer_end(tokenizer).ids)
    answer = tokenizer("4", add_special_tokens=False)["input_ids"]
    explicit = score_ids(tokenizer, "2 + 2?", "4")
    assert explicit == prompt_ids(tokenizer, "2 + 2?") + answer + end
    # an empty answer (a rollout that stopped at once) is the prompt and the end
    assert score_ids(tokenizer, "2 + 2?", "") == prompt_ids(tokenizer, "2 + 2?") + end
    # a conversation that holds its prompt is the same sequence; the row's prompt is not repeated
    assert score_ids(tokenizer, UF["prompt"], UF["chosen"]) == explicit
    assert score_ids(tokenizer, "2 + 2?", [{"role": "assistant", "content": "4"}]) == explicit
    # a whole text is tokenized as it is, the end appended; a cut keeps the end
    hh = score_ids(tokenizer, None, HH["chosen"])
    assert hh[-len(end) :] == end and len(hh) > 10
    cut = score_ids(tokenizer, None, HH["chosen"], max_length=6)
    assert len(cut) == 6 and cut[: 6 - len(end)] == hh[: 6 - len(end)] and cut[-len(end) :] == end


def test_the_pad_id_is_never_the_token_the_score_reads(tokenizer: Any) -> None:
    from stages.lib.chat.tokens import answer_end, pad_id
    from stages.lib.model.reward_model import score_pad_id

    stop = answer_end(tokenizer).stop_id
    assert score_pad_id(tokenizer) == tokenizer.pad_token_id != stop

    class SameAsStop:  # a checkpoint whose pad is its end-of-turn token (Llama 3 style)
        pad_token_id = stop

    # its tokenizer pads with that token too, or has no pad and the config's is read: either
    # way the next candidate (unk, then bos) pads, never the token the score reads
    llama3 = copy.deepcopy(tokenizer)
    llama3.pad_token = llama3.convert_ids_to_tokens(stop)
    assert (llama3.pad_token_id, llama3.unk_token_id) == (stop, None)
    assert score_pad_id(llama3, SameAsStop()) == tokenizer.bos_token_id != stop
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    assert pad_id(no_pad, SameAsStop()) == stop  # the config is read
    assert score_pad_id(no_pad, SameAsStop()) == tokenizer.bos_token_id


def test_the_margin_moves_the_loss_as_defined() -> None:
    torch = pytest.importorskip("torch")
    from stages.train.loss import reward_terms

    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    loss, gap = reward_terms(chosen, rejected, torch.zeros(3))
    assert gap.tolist() == [1.0, -0.5, 0.0]
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-g)) for g in (1.0, -0.5, 0.0)])
    with_margin, _ = reward_terms(chosen, rejected, torch.tensor([0.5, 0.5, 1.0]))
    expected = [math.log1p(math.exp(-(g - m))) for g, m in ((1.0, 0.5), (-0.5, 0.5), (0.0, 1.0))]
    assert with_margin.tolist() == pytest.approx(expected)
    assert all(a > b for a, b in zip(with_margin.tolist(), loss.tolist(), strict=True))


def test_rm_reads_pair_rows_with_their_margins_and_rollouts_paired_by_reward() -> None:
    from stages.train.pairwise import preference_pairs

    rows = [{**EXPLICIT, "margin": 2}, {**HH, "margin": 0.5}]
    assert preference_pairs(rows, "margin") == [
        ("2 + 2?", "4", "5", 2.0),
        (None, HH["chosen"], HH["rejected"], 0.5),
    ]
    with pytest.raises(DataError) as e:
        preference_pairs([EXPLICIT], "margin", "pairs.jsonl")
    assert str(e.value) == "pairs.jsonl: row 1 has no numeric 'margin' (margin: margin)"
    rollouts = [
        {"prompt": "q", "prompt_idx": 0, "sample_idx": s, "completion": c, "reward": r}
        for s, (c, r) in enumerate((("bad", 0.0), ("good", 1.0)))
    ]
    assert preference_pairs(rollouts, 0.25) == [("q", "good", "bad", 0.25)]
    with pytest.raises(DataError) as e:
        preference_pairs([{"prompt": "q", "completion": "x"}], 0.0, "r.jsonl")
    assert str(e.value) == "r.jsonl: row 1 has no numeric 'reward' (algorithm: rm)"


# --- filter pairs: true -------------------------------------------------------------------


def rollout(p: int, s: int, reward: float, completion: str) -> dict[str, Any]:
    return {
        "prompt": f"q{p}",
        "answer": "4",
        "prompt_idx": p,
        "sample_idx": s,
        "completion": completion,
        "reward": reward,
    }


def run_filter(tmp_path: Path, rows: list[dict[str, Any]], **config: Any) -> tuple[list[Any], Any]:
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage_dir = tmp_path / "filter"
    stage_dir.mkdir(exist_ok=True)
    cfg = FilterConfig(input=str(src), output=str(stage_dir / "pairs.jsonl"), **config)
    ctx = StageContext("filter", "filter", str(stage_dir), str(tmp_path), str(tmp_path))
    kind = get_kind("filter")
    assert kind is not None
    report = kind.call(cfg, ctx)
    out = [json.loads(line) for line in (stage_dir / "pairs.jsonl").read_text().splitlines()]
    return out, report


def test_filter_pairs_a_high_scored_rollout_against_a_low_one_per_prompt(tmp_path: Path) -> None:
    rows = [
        rollout(0, 0, 0.0, "5"),
        rollout(0, 1, 1.0, "4"),
        rollout(0, 2, 0.0, "6"),
        rollout(0, 3, 1.0, "4 "),
        rollout(1, 0, 1.0, "4"),  # every sample right: no pair
        rollout(1, 1, 1.0, "4"),
        rollout(2, 0, 0.0, "1"),  # every sample wrong: no pair
        rollout(2, 1, 0.0, "2"),
        rollout(3, 0, 0.2, "a"),
        rollout(3, 1, 0.7, "b"),
        rollout(3, 2, 0.5, "c"),
    ]
    pairs, report = run_filter(tmp_path, rows, pairs=True, pairs_per_prompt=2)
    assert pairs == [
        {
            "prompt_idx": 0,
            "prompt": "q0",
            "chosen": "4",
            "rejected": "5",
            "chosen_reward": 1.0,
            "rejected_reward": 0.0,
            "chosen_sample_idx": 1,
            "rejected_sample_idx": 0,
            "answer": "4",
        },
        {
            "prompt_idx": 0,
            "prompt": "q0",
            "chosen": "4 ",
            "rejected": "6",
            "chosen_reward": 1.0,
            "rejected_reward": 0.0,
            "chosen_sample_idx": 3,
            "rejected_sample_idx": 2,
            "answer": "4",
        },
        {
            "prompt_idx": 3,
            "prompt": "q3",
            "chosen": "b",
            "rejected": "a",
            "chosen_reward": 0.7,
            "rejected_reward": 0.2,
            "chosen_sample_idx": 1,
            "rejected_sample_idx": 0,
            "answer": "4",
        },
    ]
    assert (report["pairs"], report["rows_kept"]) == (3, 11)
    assert check_pair_rows(pairs, "pairs") == 3
    one, report = run_filter(tmp_path, rows, pairs=True)  # pairs_per_prompt: 1
    assert [(p["prompt_idx"], p["chosen"], p["rejected"]) for p in one] == [
        (0, "4", "5"),
        (3, "b", "a"),
    ]
    assert get_kind("filter").config.headline(report) == [  # type: ignore[union-attr]
        "kept 11 of 11 rows; dropped: none; 2 pairs written"
    ]


# --- dataset pairs: true ------------------------------------------------------------------


def run_dataset(tmp_path: Path, **fields: Any) -> tuple[list[Any], list[Any]]:
    from stages.dataset import DatasetConfig
    from stages.dataset.run import run_dataset as body

    ctx = StageContext("data", "dataset", str(tmp_path), str(tmp_path.parent), str(tmp_path))
    cfg = DatasetConfig(
        output=ctx.path("train.jsonl"),
        test_output=ctx.path("test.jsonl"),
        val_output=ctx.path("val.jsonl"),
        pairs=True,
        **fields,
    )
    body(cfg, ctx)
    read = [
        [json.loads(line) for line in Path(ctx.path(n)).read_text().splitlines()]
        for n in ("train.jsonl", "test.jsonl")
    ]
    return read[0], read[1]


def hh_row(i: int) -> dict[str, Any]:
    q = f"\n\nHuman: {i} + 1?\n\nAssistant:"
    return {"chosen": f"{q} {i + 1}", "rejected": f"{q} {i + 2}"}


def test_dataset_reads_hh_pairs_from_jsonl_and_holds_out_whole_prompts(tmp_path: Path) -> None:
    src = tmp_path / "hh.jsonl"
    rows = [hh_row(i) for i in range(10)] + [hh_row(3)]  # prompt 3 twice
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, test = run_dataset(
        tmp_path / "out", source="jsonl", path=str(src), size=100, test_size=3
    )
    assert len(test) == 3 and len(train) + len(test) in (10, 11)
    held = {pair_prompt_key(r) for r in test}
    assert not any(pair_prompt_key(r) in held for r in train)
    assert all(r in rows for r in train + test)


def test_dataset_reads_ultrafeedback_pairs_from_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{**UF, "prompt": f"{i} + 2?"} for i in range(6)]
    for i, r in enumerate(rows):
        r["chosen"] = [
            {"role": "user", "content": f"{i} + 2?"},
            {"role": "assistant", "content": "x"},
        ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "uf.parquet")
    train, test = run_dataset(
        tmp_path / "out", source="parquet", path=str(tmp_path / "uf.parquet"), size=10, test_size=2
    )
    assert sorted(r["prompt"] for r in train + test) == [r["prompt"] for r in rows]
    assert check_pair_rows(train + test, "uf") == 6
    assert {r["score_chosen"] for r in train} == {9.0}


def test_a_source_row_that_is_no_pair_fails_the_stage_naming_its_row(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(hh_row(0)) + "\n" + json.dumps({"chosen": "a"}) + "\n")
    with pytest.raises(ValueError) as e:
        run_dataset(tmp_path / "out", source="jsonl", path=str(src))
    assert str(e.value) == (
        f"{src} row 2 has no 'rejected' (a preference pair needs 'chosen' and 'rejected', each "
        "text or messages; 'prompt' optional)"
    )


# --- refusals at validate -------------------------------------------------------------------


def test_settings_and_files_a_reward_model_cannot_use_are_refused_at_validate(
    tmp_path: Path,
) -> None:
    from tests.conftest import run_cli

    (tmp_path / "pairs.jsonl").write_text(
        json.dumps(EXPLICIT) + "\n" + '{"prompt": "q", "chosen": "a"}\n'
    )
    for name, config in (
        ("lm", {"architectures": ["LlamaForCausalLM"]}),
        ("two", {"architectures": ["LlamaForSequenceClassification"]}),  # 2 labels by default
        ("rm", {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "L"}}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    (tmp_path / "p.yaml").write_text(
        """\
name: p
stages:
  d: {kind: dataset, config: {source: jsonl, path: pairs.jsonl, pairs: true}}
  g: {kind: dataset, config: {source: reasoning_gym, task: chain_sum, pairs: true}}
  t: {kind: train, config: {algorithm: rm, input: pairs.jsonl, target: answer, beta: 0.2}}
  s: {kind: train, config: {input: x.jsonl, margin: 1.0}}
  f: {kind: filter, config: {input: x.jsonl, pairs_per_prompt: 2}}
  e: {kind: evaluate, config: {input: x.jsonl, checkpoints: [lm], reward_model: lm}}
  h: {kind: evaluate, config: {input: x.jsonl, checkpoints: [lm], reward_model: two}}
  k: {kind: evaluate, config: {input: x.jsonl, checkpoints: [rm]}}
  ok: {kind: evaluate, config: {input: x.jsonl, checkpoints: [two], reward_model: rm}}
  c: {kind: evaluate, config: {input: x.jsonl, checkpoints: [two], reward_model: lm}}
  l: {kind: train, config: {algorithm: rm, input: x.jsonl, lora: {rank: 4}}}
"""
    )
    result = run_cli("validate", str(tmp_path / "p.yaml"))
    assert result.exit_code == 2
    where, pairs = str(tmp_path / "p.yaml"), str(tmp_path / "pairs.jsonl")
    no_rejected = (
        "row 2 has no 'rejected' (a preference pair needs 'chosen' and 'rejected', each text or "
        "messages; 'prompt' optional)"
    )
    assert result.stderr.splitlines() == [
        f"{where}:3:52: stages.d.config.path: '{pairs}': {no_rejected}",
        f"{where}:4:78: stages.g.config.pairs: reasoning_gym makes prompts, not preference "
        "pairs: read pairs from a jsonl, parquet or huggingface source, or make them from "
        "rollouts with the filter stage's 'pairs: true'",
        f"{where}:5:51: stages.t.config.input: '{pairs}': {no_rejected}",
        f"{where}:5:72: stages.t.config.target: acts on nothing with algorithm rm (a reward "
        "model scores whole responses (chosen and rejected), so there is no target to pick): "
        "leave it out",
        f"{where}:5:86: stages.t.config.beta: acts on nothing with algorithm rm (beta is dpo's "
        "KL strength): leave it out",
        f"{where}:6:53: stages.s.config.margin: acts in the reward model's loss only (algorithm "
        "rm); algorithm is sft: leave it out",
        f"{where}:7:64: stages.f.config.pairs_per_prompt: acts with 'pairs: true' only: set "
        "pairs, or leave it out",
        f"{where}:8:61: stages.e.config.checkpoints: '{tmp_path}/lm' is the reward_model: a "
        "reward model scores answers and generates none; list the checkpoints to evaluate "
        "without it",
        f"{where}:9:81: stages.h.config.reward_model: '{tmp_path}/two' is no reward model: its "
        "head has 2 labels; a reward model scores with one (num_labels 1)",
        f"{where}:12:82: stages.c.config.reward_model: '{tmp_path}/lm' is no reward model: its "
        "config.json names no sequence-classification head (architectures "
        "['LlamaForCausalLM']; a reward model's ends with 'ForSequenceClassification', as "
        "train with algorithm rm writes)",
        f"{where}:13:73: stages.l.config.lora.rank: a reward model trains its new scalar head whole, "
        "and LoRA here adapts causal-LM checkpoints only: leave lora out with algorithm rm",
    ]
