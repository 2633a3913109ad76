"""rl's episodes played by NeMo Gym's own servers (`stages.rl.rollout.agent_play`), unchanged
(`.venv-gym/`, `make install-gym`; skipped without it): example_single_tool_call started
against the endpoint that serves the rl engine, its `vllm_model_for_training` model server
sending each turn's ids back, and every episode read as the ids the engine saw and wrote.

The rl engine is scripted at the edge (a hermes call of the tool, then a sentence, as token
ids: a random model writes no call, and no second turn); everything between it and the
trace is the stage's own code and NeMo Gym's.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stages.lib.env.field import EnvironmentConfig
from stages.rl.rollout.agent_play import play_agent, start_agent
from stages.rl.rollout.token_play import PlaySettings
from tests.integration.test_nemo_gym_env import ENV, left_in, rows
from tests.integration.test_nemo_gym_policy import GYM, Scripted

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gym,
    pytest.mark.skipif(
        not (GYM / "bin" / "ng_run").exists(), reason="no .venv-gym/ (make install-gym)"
    ),
]


class ScriptedEngine:
    """The rl engine's interface (`generate(prompts, num_samples, ...)`) over `Scripted`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.script = tokenizer, Scripted(tokenizer)
        self.asked: list[tuple[int, ...]] = []

    def generate(self, prompts: list[Any], *, num_samples: int, **_: Any) -> list[list[Any]]:
        self.asked += [tuple(p.ids) for p in prompts]
        return [[g] * num_samples for g in self.script(prompts, None)]


def test_rl_reads_nemo_gyms_turns_as_one_contiguous_sequence(tmp_path, family_checkpoint):
    from transformers import AutoTokenizer

    from stages.lib.io.jsonl import read_jsonl

    tok = AutoTokenizer.from_pretrained(family_checkpoint("chatml"))
    engine = ScriptedEngine(tok)
    cfg = SimpleNamespace(
        environment=EnvironmentConfig.model_validate(ENV),
        max_output_tokens=64,
        max_length=2048,
        seed=0,
    )
    work = tmp_path / "rl"
    work.mkdir()
    settings = PlaySettings(2, 1.0, 64, 2048, 0, 8, 1, 120.0, 8)
    player = start_agent(engine, cfg, str(work), 8)
    try:
        groups = play_agent(player, list(read_jsonl(rows(tmp_path, 3))), settings)
    finally:
        player.close()
    assert [len(g) for g in groups] == [2, 2, 2]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for t in (t for g in groups for t in g):
        assert t.episode.error is None, t.episode.error
        assert (t.episode.total, t.episode.turns) == (1.0, 2)
        # opening | the call (trained) | the tool's answer (not) | the sentence (trained)
        runs = [(m, len(list(g))) for m, g in itertools.groupby(t.mask)]
        assert [m for m, _ in runs] == [1, 0, 1]
        call, observation, answer = (n for _, n in runs)
        assert t.ids[t.prompt_len + call - 1] == end and t.ids[-1] == end
        seen = str(tok.decode(t.ids[t.prompt_len + call : t.prompt_len + call + observation]))
        assert "<tool_response>" in seen and seen.rstrip().endswith("assistant")
        assert t.logprobs == [-0.25] * call + [0.0] * observation + [-0.25] * answer
        # the second turn was asked from exactly these ids (token in, token out)
        assert tuple(t.ids[: t.prompt_len + call + observation]) in engine.asked
    assert left_in(Path(work)) == []


PIPELINE = """\
    name: gymrl
    cluster: {{scheduler: local, workers: 1}}
    stages:
      grpo:
        kind: rl
        config:
          input: {rows}
          model: {model}
          environment: &gym
            kind: nemo_gym
            config_paths: [{config}]
            agent: {agent}
          num_repeats: 2
          rollout_batch_size: 2
          train_batch_size: 4
          micro_train_batch_size: 2
          max_steps: 2
          max_length: 1024                # the row's prompt with its tool: 665 tokens here
          max_output_tokens: 16
      evaluate:
        kind: evaluate
        needs: [grpo]
        config:
          input: {rows}
          checkpoints: [{model}, "@grpo"]
          environment: *gym
          max_output_tokens: 16
"""


def test_the_rl_stage_trains_on_gym_and_evaluate_starts_gym_once_per_checkpoint(
    tmp_path, family_checkpoint
):
    """The whole stage through `pipe run`: rl's controller starts NeMo Gym against its engine,
    plays two steps (a random model: one text turn, reward 0, episodes neither failed nor
    masked), stops it; evaluate starts Gym again for each of its two checkpoints, in the same
    folder (each start reads only its own output)."""
    import json

    from tests.cluster import pipe_run
    from tests.integration.test_nemo_gym_env import AGENT, CONFIG

    text = PIPELINE.format(
        rows=rows(tmp_path, 2), model=family_checkpoint("chatml"), config=CONFIG, agent=AGENT
    )
    proc = pipe_run(tmp_path, text, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stage = tmp_path / "runs/gymrl/grpo"
    steps = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["episodes_failed"] == 0 and s["turns_mean"] == 1.0 for s in steps), steps
    settings = json.loads((stage / "settings.json").read_text())
    assert "agent plays" in settings["environment"]["how"]
    report = json.loads((tmp_path / "runs/gymrl/evaluate/metrics.json").read_text())
    assert [r["failed_episodes"] for r in report["results"]] == [0, 0]
    log = (tmp_path / "runs/gymrl/evaluate/nemo_gym.log").read_bytes()
    assert log.count(b"servers ready!") == 2
    for folder in (stage, tmp_path / "runs/gymrl/evaluate"):
        assert left_in(folder) == []
