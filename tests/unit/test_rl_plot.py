"""The rl stage's `rl.png`: reward and held-out accuracy against step; with a reward model,
its mean score on a second axis beside the verifier's accuracy (per step and held out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stages.rl.controller.records import figure, plot

pytest.importorskip("matplotlib")


def rows(scored: bool) -> list[dict[str, Any]]:
    out = []
    for step in (1, 2, 3):
        out.append(
            {
                "step": step,
                "reward_mean": 0.1 * step,
                "accuracy": 0.2 * step,
                "rm_score_mean": 1.5 * step if scored else None,
                "eval_accuracy": 0.25 * step if step != 2 else None,
            }
        )
    return out


def series(fig: Any) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in fig.axes
        for line in ax.get_lines()
    }


def test_with_a_reward_model_its_score_is_plotted_beside_the_verifiers_accuracy(tmp_path: Path):
    fig = figure(rows(scored=True), "t")
    got = series(fig)
    assert got["reward model score (mean)"] == ([1, 2, 3], [1.5, 3.0, 4.5])
    assert got["held-out accuracy"] == ([1, 3], [0.25, 0.75])
    assert got["accuracy (the step's samples)"] == ([1, 2, 3], pytest.approx([0.2, 0.4, 0.6]))
    assert "reward mean" not in got
    assert len(fig.axes) == 2 and fig.axes[0].get_ylim() == (0, 1)  # the score on its own axis
    assert fig.axes[1].get_ylabel() == "reward model score"
    path = tmp_path / "rl.png"
    assert plot(rows(scored=True), str(path), "t") == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_one_the_reward_mean_and_held_out_accuracy_share_one_axis():
    got = series(fig := figure(rows(scored=False), "t"))
    assert set(got) == {"reward mean", "held-out accuracy"}
    assert got["reward mean"][1] == pytest.approx([0.1, 0.2, 0.3])
    assert len(fig.axes) == 1


def test_the_held_out_accuracy_before_training_is_its_first_point():
    got = series(figure(rows(scored=True), "t", start=0.1))
    assert got["held-out accuracy"] == ([0, 1, 3], [0.1, 0.25, 0.75])
