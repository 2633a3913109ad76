"""The field's corrections for the engine's mismatch with the actor (issue 56), by hand: the
weights and masks of every `tis_mode`, the mismatch figures as verl defines them, the rules
that give each mode its thresholds, and the plan's refusals of a bad combination."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.rl import RLConfig  # noqa: E402
from stages.rl.algo.correction import correct  # noqa: E402
from stages.rl.algo.mismatch import Gap  # noqa: E402
from stages.rl.algo.options import Correction, correction_of  # noqa: E402

# one sequence, three tokens: pi_old - mu = log 1, log 3, log 0.25
PI_OLD = torch.log(torch.tensor([0.5, 0.6, 0.1]))
MU = torch.log(torch.tensor([0.5, 0.2, 0.4]))
ONES = torch.ones(3)


def test_token_truncate_weighs_each_token_by_its_ratio_capped() -> None:
    w, keep, raw = correct(PI_OLD, MU, ONES, [3], Correction("token_truncate", 2.0, None))
    assert raw.tolist() == pytest.approx([1.0, 3.0, 0.25])
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.25])
    assert keep.tolist() == [1.0, 1.0, 1.0]
    assert not w.requires_grad


def test_token_mask_keeps_a_tokens_ratio_within_its_bounds_and_drops_the_rest() -> None:
    """ICE-POP / slime's MIS mask: weight r inside [floor, cap], the token out otherwise
    (above the cap and under the floor alike)."""
    w, keep, _ = correct(PI_OLD, MU, ONES, [3], Correction("token_mask", 2.0, 0.5))
    assert keep.tolist() == [1.0, 0.0, 0.0]
    assert w.tolist() == pytest.approx([1.0, 0.0, 0.0])
    w, keep, _ = correct(PI_OLD, MU, ONES, [3], Correction("token_mask", 4.0, 0.2))
    assert keep.tolist() == [1.0, 1.0, 1.0]
    assert w.tolist() == pytest.approx([1.0, 3.0, 0.25])  # the ratio itself, untruncated


# two sequences: [0.2, 0.4] (mean log-ratio 0.3) and [0.1, -0.1, 3.0] whose last token is an
# observation's (mask 0): its mean over the loss tokens is 0, the observation left out
SEQ_LOG_RATIO = torch.tensor([0.2, 0.4, 0.1, -0.1, 3.0])
SEQ_MASK = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])


def test_sequence_modes_give_each_token_its_sequences_geometric_mean() -> None:
    g = math.exp(0.3)  # 1.3499
    truncate = Correction("sequence_truncate", 1.2, None)
    w, keep, raw = correct(SEQ_LOG_RATIO, torch.zeros(5), SEQ_MASK, [2, 3], truncate)
    assert raw.tolist() == pytest.approx([g, g, 1.0, 1.0, 1.0])
    assert w.tolist() == pytest.approx([1.2, 1.2, 1.0, 1.0, 1.0])
    assert keep.tolist() == [1.0] * 5
    mask = Correction("sequence_mask", 1.2, 1 / 1.2)
    w, keep, _ = correct(SEQ_LOG_RATIO, torch.zeros(5), SEQ_MASK, [2, 3], mask)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]  # the first sequence out, whole
    assert w.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.0])


def test_the_mismatch_figures_as_verl_defines_them() -> None:
    """r = exp(actor - engine) per token: 2, 1 | 0.5 (and an observation's token, ignored).
    k3 = mean(r - 1 - log r); chi2_token = mean(r^2) - 1; chi2_seq = mean over sequences
    of (prod r)^2 - 1; ppl ratio = mean over sequences of exp(mean(engine) - mean(actor))."""
    ln2 = math.log(2.0)
    new = torch.tensor([ln2, 0.0, -ln2, 5.0]) - 1.0
    old = torch.full((4,), -1.0)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    gap = Gap()
    gap.add(new, old, mask, [2, 2])
    gap.mask_out(torch.tensor([1.0, 0.0, 1.0, 0.0]), mask, [2, 2])
    figures = gap.figures()
    k3 = ((2 - 1 - ln2) + 0.0 + (0.5 - 1 + ln2)) / 3  # = 0.5 / 3
    assert figures["mismatch_k3"] == pytest.approx(k3) == pytest.approx(0.5 / 3)
    assert figures["mismatch_chi2_token"] == pytest.approx((4 + 1 + 0.25) / 3 - 1)
    assert figures["mismatch_chi2_seq"] == pytest.approx((4 + 0.25) / 2 - 1)
    assert figures["mismatch_ppl_ratio"] == pytest.approx((2**-0.5 + 2.0) / 2)
    assert figures["mismatch_masked_token_frac"] == pytest.approx(1 / 3)
    assert figures["mismatch_masked_seq_frac"] == pytest.approx(1 / 2)
    assert figures["logprob_diff_mean"] == pytest.approx(2 * ln2 / 3)
    assert figures["logprob_diff_max"] == pytest.approx(ln2)


def test_the_figures_add_up_over_micro_batches_as_over_the_whole() -> None:
    new = torch.tensor([-0.5, -1.0, -2.0, -0.1, -3.0])
    old = torch.tensor([-0.7, -0.9, -2.5, -0.1, -2.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    whole, parts = Gap(), Gap()
    whole.add(new, old, mask, [3, 2])
    parts.add(new[:3], old[:3], mask[:3], [3])
    parts.add(new[3:], old[3:], mask[3:], [2])
    assert parts.figures() == pytest.approx(whole.figures())
    back = Gap.of(whole.as_sums(), whole.max)  # as the ranks' reduction builds it
    assert back.figures() == whole.figures()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"tis_cap": 1.5}, Correction("token_truncate", 1.5, None)),  # as before tis_mode
        ({"tis_mode": "token_truncate"}, Correction("token_truncate", 2.0, None)),
        ({"tis_mode": "token_mask"}, Correction("token_mask", 2.0, 0.5)),
        (
            {"tis_mode": "token_mask", "tis_cap": 5.0, "tis_floor": 0.5},
            Correction("token_mask", 5.0, 0.5),
        ),
        ({"tis_mode": "sequence_truncate"}, Correction("sequence_truncate", 1.001, None)),
        ({"tis_mode": "sequence_mask"}, Correction("sequence_mask", 1.001, 1 / 1.001)),
    ],
)
def test_each_mode_takes_its_thresholds(
    fields: dict[str, Any], expected: Correction | None
) -> None:
    assert correction_of(RLConfig(input="x.jsonl", **fields)) == expected


def _pipeline(tmp_path: Path, config: str) -> None:
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl:\n    kind: rl\n    config: {{input: d.jsonl, {config}}}\n"
    )


def test_plan_explains_the_thresholds_a_mode_takes(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    _pipeline(tmp_path, "tis_mode: token_mask")
    out = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert lines["tis_mode"].split(None, 2)[1:] == ['"token_mask"', "<- p.yaml:5:40"]
    assert lines["tis_cap"].split(None, 2)[1:] == [
        "2.0",
        "<- rule: token_mask: 2.0, verl's rollout_is_threshold and slime's tis_upper_bound",
    ]
    assert lines["tis_floor"].split(None, 2)[1:] == [
        "0.5",
        "<- rule: token_mask: 1 / tis_cap, as verl's rollout_rs_threshold_lower and slime's "
        "tis_lower_bound",
    ]
    _pipeline(tmp_path, "tis_cap: 2.0")  # an existing config: token_truncate, as before
    out = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert lines["tis_mode"].split(None, 2)[1].strip('"') == "token_truncate"
    assert "<- rule: tis_cap set alone" in lines["tis_mode"]
    assert lines["tis_floor"].split()[1] == "null"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "tis_floor: 0.5",
            "p.yaml:5:41: stages.rl.config.tis_floor: acts with tis_mode token_mask or "
            "sequence_mask only; tis_mode is off (kind default)",
        ),
        (
            "tis_cap: 2.0, tis_floor: 0.5",
            "stages.rl.config.tis_floor: acts with tis_mode token_mask or sequence_mask only; "
            "tis_mode is token_truncate",
        ),
        (
            "tis_mode: token_mask, tis_cap: 2.0, tis_floor: 3.0",
            "p.yaml:5:77: stages.rl.config.tis_floor: token_mask keeps the tokens whose ratio "
            "is within [tis_floor, tis_cap]: tis_floor 3 (p.yaml:5:77) is not below tis_cap 2.0 "
            "(p.yaml:5:61), so every token would leave the loss",
        ),
        (
            "tis_mode: sequence_mask, tis_cap: 0.9",
            "p.yaml:5:64: stages.rl.config.tis_cap: sequence_mask keeps the sequences whose "
            "ratio is within [tis_floor, tis_cap]: tis_floor 1.11111 (rule: sequence_mask: 1 / "
            "tis_cap, as verl's rollout_rs_threshold_lower and slime's tis_lower_bound) is not "
            "below tis_cap 0.9 (p.yaml:5:64)",
        ),
        (
            "tis_mode: token_clip",
            "p.yaml:5:40: stages.rl.config.tis_mode: expected 'token_truncate', 'token_mask', "
            "'sequence_truncate' or 'sequence_mask', found 'token_clip'",
        ),
    ],
)
def test_validate_refuses_a_bad_combination_located(
    tmp_path: Path, config: str, message: str
) -> None:
    from tests.conftest import run_cli

    _pipeline(tmp_path, config)
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 2, out.stdout
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_validate_warns_on_a_sequence_cap_that_seldom_binds(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    _pipeline(tmp_path, "tis_mode: sequence_truncate, tis_cap: 2.0")
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    assert "warning: stages.rl.config.tis_cap: sequence_truncate: a sequence's ratio" in out.stderr
