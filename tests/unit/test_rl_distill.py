"""On-policy distillation at plan time and in its arithmetic: the `teacher` role (in the ratio,
colocated with the reference, inside the actor's ranks), `distill_coef`'s rule, the refusals
located in the file (a weight without a teacher, a teacher with another tokenizer, what the
teacher alone leaves without a verifier), and the per-token term in advantages, returns and
the step's figures (`stages.rl.algo.distill`)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stages.rl.algo.advantage import reinforce_pp_returns
from stages.rl.algo.distill import distill_terms, figures, with_terms
from stages.rl.algo.logprobs import Sample
from stages.rl.algo.ppo import token_rewards
from tests.conftest import run_cli, stub_checkpoint

PIPELINE = """\
name: p
cluster: {{gpus: 8, gpus_per_node: 8}}
resources: {resources}
stages:
  rl:
    kind: rl
    config:
      input: d.jsonl
      model: student
      chat_template: chatml
      teacher: {teacher}
{extra}"""
RATIO = "{ratio: {vllm: 2, actor: 4, ref: 1, teacher: 1}}"


def checkpoint(folder: Path, vocab: dict[str, int]) -> None:
    """A stub checkpoint with a `tokenizer.json` of `vocab` (what the plan compares)."""
    stub_checkpoint(folder)
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def plan(
    tmp_path: Path,
    extra: str = "verifier: null\nkl_coef: 0.01",
    teacher: str = "teacher",
    resources: str = RATIO,
    *args: str,
) -> Any:
    checkpoint(tmp_path / "student", {"a": 0, "b": 1})
    checkpoint(tmp_path / "teacher", {"a": 0, "b": 1})
    checkpoint(tmp_path / "other", {"a": 1, "b": 0})
    text = PIPELINE.format(
        resources=resources, teacher=teacher, extra=textwrap.indent(extra, "      ")
    )
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    return run_cli("plan", "p.yaml", "--cluster", "1x8x80GB", *args, cwd=tmp_path)


def as_json(result: Any) -> dict[str, Any]:
    assert result.exit_code == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_distillation_alone_plans_with_the_teacher_on_its_own_gpu(tmp_path: Path):
    got = as_json(
        plan(tmp_path, "verifier: null\nkl_coef: 0.01", "teacher", RATIO, "--format", "json")
    )
    assert got["roles"]["teacher"] == {"gpus": 1, "colocated_with": []}
    assert got["stages"]["rl"]["config"]["distill_coef"] == 1.0
    placed = {p["role"]: p["devices"] for p in got["placement"]["rl"]}
    assert placed == {"vllm": [0, 1], "actor": [2, 3, 4, 5], "ref": [6], "teacher": [7]}
    teacher, ref = got["memory"]["rl"]["teacher"], got["memory"]["rl"]["ref"]
    assert "inside" not in teacher and teacher["gpu_bytes"] == ref["gpu_bytes"] > 0


def test_the_teacher_colocates_with_the_reference(tmp_path: Path):
    resources = "{ratio: {vllm: 2, actor: 4, ref: 2}, colocate: [[ref, teacher]]}"
    got = as_json(
        plan(tmp_path, "verifier: null\nkl_coef: 0.01", "teacher", resources, "--format", "json")
    )
    assert got["roles"]["teacher"] == {"gpus": 2, "colocated_with": ["ref"]}
    placed = {p["role"]: p["devices"] for p in got["placement"]["rl"]}
    assert placed["teacher"] == placed["ref"] == [6, 7]


def test_a_teacher_left_out_of_the_ratio_is_counted_inside_the_actors_ranks(tmp_path: Path):
    resources = "{ratio: {vllm: 2, actor: 6}}"
    got = as_json(plan(tmp_path, "verifier: null", "teacher", resources, "--format", "json"))
    assert "teacher" not in got["roles"]
    assert got["memory"]["rl"]["teacher"]["inside"] == "actor"


def test_explain_shows_the_teacher_role_and_the_weights_rule(tmp_path: Path):
    result = plan(tmp_path, "verifier: null\nkl_coef: 0.01", "teacher", RATIO, "--explain")
    assert result.exit_code == 0, result.stderr
    lines = [x.strip() for x in result.stdout.splitlines()]
    assert "teacher  1 GPUs" in lines
    assert 'teacher                      "teacher"  <- p.yaml:11:16' in lines
    rule = "rule: a teacher is set: its per-token reverse KL at full weight"
    assert f"distill_coef                 1.0  <- {rule}" in lines
    assert "role teacher                 devices 7" in lines


def test_distill_coef_set_is_kept(tmp_path: Path):
    got = as_json(
        plan(
            tmp_path,
            "verifier: null\ndistill_coef: 0.5",
            "teacher",
            "{colocate: all}",
            "--format",
            "json",
        )
    )
    assert got["stages"]["rl"]["config"]["distill_coef"] == 0.5


@pytest.mark.parametrize(
    ("teacher", "extra", "lines"),
    [
        (
            "null",
            "verifier: {kind: regex, pattern: x}\ndistill_coef: 0.5",
            [
                "p.yaml:13:21: stages.rl.config.distill_coef: weighs a teacher's per-token "
                "reverse KL, and teacher is empty: set teacher (a checkpoint with the policy's "
                "tokenizer), or leave distill_coef out"
            ],
        ),
        (
            "other",
            "verifier: null",
            [
                "p.yaml:11:16: stages.rl.config.teacher: the teacher's tokenizer differs from "
                "the policy's (tokenizer.json): it scores the policy's token ids, which would "
                "not be the text it reads; distil from a teacher with the policy's tokenizer"
            ],
        ),
        (
            "nowhere",
            "verifier: null",
            [
                "p.yaml:11:16: stages.rl.config.teacher: no checkpoint folder 'nowhere' "
                "(relative to the pipeline's folder)"
            ],
        ),
        (
            "teacher",
            "verifier: null\ndynamic_sampling: true\neval_input: d.jsonl",
            [
                "p.yaml:13:25: stages.rl.config.dynamic_sampling: judges each group on the "
                "verifier's rewards, and there is no verifier (null): the teacher alone would "
                "leave every group's rewards equal and drop them all; name a verifier, or "
                "leave dynamic_sampling out",
                "p.yaml:14:19: stages.rl.config.eval_input: held-out accuracy is the "
                "verifier's, and there is no verifier (null): name one, or leave eval_input out",
            ],
        ),
    ],
)
def test_refusals_are_located_where_written(
    tmp_path: Path, teacher: str, extra: str, lines: list[str]
):
    resources = "{colocate: all}"
    result = plan(tmp_path, extra, teacher, resources)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == lines


def test_a_teacher_role_without_a_teacher_is_refused(tmp_path: Path):
    resources = "{ratio: {vllm: 1, actor: 1, teacher: 1}}"
    result = plan(tmp_path, "verifier: {kind: regex, pattern: x}", "null", resources)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:3:40: resources.ratio.teacher: stage 'rl' cannot use role 'teacher': it has no "
        "teacher; set teacher (a checkpoint with the policy's tokenizer, or '@stage') to bring "
        "the teacher role for on-policy distillation, or leave 'teacher' out"
    ]


def test_without_a_teacher_or_verifier_nothing_scores(tmp_path: Path):
    result = plan(tmp_path, "verifier: null", "null", "{colocate: all}")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:12:17: stages.rl.config.verifier: nothing scores the samples: with no verifier "
        "(null) set reward_model or teacher, or name a verifier"
    ]


def test_a_tokenizer_not_on_disk_at_plan_is_compared_when_the_stage_starts(tmp_path: Path):
    resources = "{ratio: {vllm: 2, actor: 4, teacher: 2}}"
    assert plan(tmp_path, "verifier: null", "teacher", resources).exit_code == 0
    text = (
        (tmp_path / "p.yaml")
        .read_text()
        .replace("model: student", "model: {hidden_size: 32, num_layers: 1, num_heads: 2}")
    )
    (tmp_path / "p.yaml").write_text(text)
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [
        "p.yaml:11:16: note: stages.rl.config.teacher: the policy has no tokenizer on disk yet: "
        "the two tokenizers are compared when the stage starts, and a teacher whose tokenizer "
        "differs fails it"
    ]


# --- the per-token term ---------------------------------------------------------------------
OLD = (-1.0, -2.0, -0.5)
TEACHER = (-1.5, -1.0, -0.5)


def test_each_tokens_term_is_minus_the_weight_times_old_less_teacher():
    assert distill_terms(OLD, TEACHER, [1.0, 1.0, 1.0], 2.0) == [-1.0, 2.0, -0.0]
    assert distill_terms(OLD, TEACHER, [1.0, 0.0, 1.0], 1.0) == [-0.5, -0.0, -0.0]


def test_group_advantages_get_the_term_per_token_unnormalised():
    s = Sample((1, 2, 3, 4), 1, OLD, advantage=0.25, teacher_logprobs=TEACHER)
    (got,) = with_terms([s], 1.0)
    assert got.advantages == (0.25 - 0.5, 0.25 + 1.0, 0.25)
    masked = Sample((1, 2, 3, 4), 1, OLD, advantage=0.0, teacher_logprobs=TEACHER, mask=(1, 0, 1))
    assert with_terms([masked], 1.0)[0].advantages == (-0.5, 0.0, 0.0)


def test_the_steps_figures_are_the_reverse_kl_per_token_and_the_teachers_mean():
    a = Sample((1, 2, 3, 4), 1, OLD, teacher_logprobs=TEACHER)
    b = Sample((1, 2, 3), 1, (-3.0, -1.0), teacher_logprobs=(-1.0, -2.0), mask=(1, 0))
    got = figures([a, b])
    # loss tokens: a's three, b's first; old - teacher: 0.5, -1.0, 0.0, -2.0
    assert got["distill_reverse_kl"] == pytest.approx(-2.5 / 4)
    assert got["teacher_logprob_mean"] == pytest.approx((-1.5 - 1.0 - 0.5 - 1.0) / 4)
    assert figures([]) == {"distill_reverse_kl": None, "teacher_logprob_mean": None}


def test_ppo_and_reinforce_pp_take_the_term_in_each_tokens_reward():
    ref = (-1.0, -1.0, -1.0)
    got = token_rewards(1.0, 3, OLD, ref, 0.1, None, TEACHER, 2.0)
    kl = [-0.1 * (o - r) for o, r in zip(OLD, ref, strict=True)]
    term = [-2.0 * (o - t) for o, t in zip(OLD, TEACHER, strict=True)]
    want = [k + d for k, d in zip(kl, term, strict=True)]
    want[-1] += 1.0
    assert got == pytest.approx(want)
    # REINFORCE++: the return sums the terms from each token on, then whitens over the batch
    returns = reinforce_pp_returns([0.0], [OLD], None, [[1.0, 1.0, 1.0]], 0.0, [TEACHER], 1.0)
    raw = [0.5, 1.0, 0.0]  # -(old - teacher) summed from each token on: -0.5+1+0, 1+0, 0
    mean = sum(raw) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3)
    assert returns[0] == pytest.approx([(x - mean) / (std + 1e-8) for x in raw])
