"""The rl stage's algorithm settings through `pipe run`: REINFORCE++ with its KL in the
reward (the reference inside the actor's ranks), GSPO's sequence ratio with clip-higher and
per-sequence loss over several updates a step, DAPO's dynamic sampling and overlong shaping;
each run records every setting applied or skipped, and its per-step figures."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_rl import PIPELINE, metrics, pipe

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def pipeline(extra: str, prompts: int) -> str:
    """test_rl's tiny GRPO pipeline, 3 steps of `prompts` x 4, with `extra` config lines."""
    text = textwrap.dedent(PIPELINE.format(steps=3, profile="default", memory="default"))
    text = text.replace("rollout_batch_size: 8", f"rollout_batch_size: {prompts}")
    text = text.replace("\n      train_batch_size: 32", "").replace(
        "eval_every: 2", "eval_every: 3"
    )
    text = text.replace("save_steps: 2", "save_steps: 3")
    return text + "".join(f"      {line.strip()}\n" for line in extra.splitlines())


ARMS = {
    # the defaults otherwise: dynamic sampling off (the default, issue 45), every group trains
    "reinforce_pp": "advantage: reinforce_pp\n          kl_coef: 0.05\n          train_batch_size: 16",
    # dynamic sampling too: this untrained model's groups seldom carry a signal
    # GSPO as users get it: its clip range and loss_agg resolve from ratio_level (issue 45)
    "gspo": "ratio_level: sequence\n          train_batch_size: 8\n          dynamic_sampling: true",
    "dapo": "dynamic_sampling: true\n          overlong_buffer: 2\n          train_batch_size: 16",
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_each_algorithm_runs_and_records_how_its_settings_acted(tmp_path: Path, arm: str):
    (tmp_path / "p.yaml").write_text(pipeline(ARMS[arm], 8 if arm == "gspo" else 4))
    result = pipe(tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [r for r in rows if r["updates"]]
    assert trained and all(math.isfinite(r["loss"]) for r in trained)
    settings = json.loads((tmp_path / "runs/rl/rl/settings.json").read_text())
    how = {k: (v["status"], v["how"]) for k, v in settings.items()}
    if arm == "reinforce_pp":
        assert how["advantage"] == (
            "applied",
            "REINFORCE++: per-token returns (KL in the reward), normalised over the batch",
        )
        assert how["kl_coef"][1].startswith("KL to a frozen reference in every token's reward")
        assert how["std_normalize"][0] == "skipped"
        assert how["dynamic_sampling"][1].startswith("off: every group trains")
        assert all(r["groups_kept"] == 4 for r in rows)  # every group trains
        assert all(r["kl"] == 0.0 for r in trained)  # the KL is not also in the loss
    if arm == "gspo":
        assert how["ratio_level"][1].startswith("GSPO: one ratio per sequence")
        assert "seldom binds" not in how["eps_clip_high"][1]  # 4 updates a step
        assert any(r["updates"] >= 2 for r in trained)  # 8 samples an update
        assert any(r["clip_frac"] > 0 for r in trained)  # later updates move the ratio
    if arm == "dapo":
        assert how["dynamic_sampling"][1].startswith("groups whose verifier rewards all agree")
        assert "judged on the verifier's rewards" in how["dynamic_sampling"][1]
        for r in rows:
            assert 1 <= r["gen_rounds"] <= 3
            assert r["prompts_drawn"] <= 4 * r["gen_rounds"]  # a refill: 4 prompts at most
            assert (r["prompts_drawn"] > 4) == (r["gen_rounds"] > 1)
            # the cost: every answer drawn, dropped groups' included (4 samples a prompt)
            assert r["tokens_generated"] >= 4 * r["prompts_drawn"]
            assert r["groups_kept"] <= 4
            assert r["overlong_penalty_mean"] is not None and r["overlong_penalty_mean"] <= 0
