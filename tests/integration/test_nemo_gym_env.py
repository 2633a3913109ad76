"""Environments of kind nemo_gym against NeMo Gym's own servers, unchanged (`.venv-gym/`,
`make install-gym`; skipped without it).

- collect, `local` backend: the tiny ChatML checkpoint served by pipe (`open_endpoint`),
  NeMo Gym's example_single_tool_call started by the stage (`ng_run`, its `vllm_model` model
  server for training pointed at pipe's endpoint), every row sent to the agent's `/run`: one
  episode line per pair, the token ids NeMo Gym returns, and every process the stage started
  gone after it.
- evaluate, `openai` backend: a policy scripted at the edge (a hermes call of the tool, then
  a sentence: a random model writes no call) behind pipe's policy endpoint; the agent's
  reward decides accuracy: 1.0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect
from stages.evaluate import EvaluateConfig
from stages.evaluate.run import run_evaluate
from stages.lib.serve.policy import PolicyServer
from tests.integration.test_nemo_gym_policy import GYM, SITE, Scripted

CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"
ENV = {"kind": "nemo_gym", "config_paths": [CONFIG], "agent": AGENT}

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gym,
    pytest.mark.skipif(
        not (GYM / "bin" / "ng_run").exists(), reason="no .venv-gym/ (make install-gym)"
    ),
]


def rows(tmp_path: Path, n: int) -> str:
    source = SITE / "resources_servers/example_single_tool_call/data/example.jsonl"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return str(path)


def ctx(tmp_path: Path, name: str) -> StageContext:
    folder = tmp_path / name
    folder.mkdir()
    return StageContext(name, name, str(folder), str(tmp_path), str(folder))


def left_in(folder: Path) -> list[str]:
    """Processes still working in `folder` (the stage's servers start there)."""
    out = []
    for p in psutil.process_iter(["pid", "cwd", "name"]):
        if p.info["cwd"] and Path(p.info["cwd"]).is_relative_to(folder):
            out.append(f"{p.info['pid']} {p.info['name']}")
    return out


def test_collect_plays_nemo_gyms_agent_against_the_local_backend(tmp_path, family_checkpoint):
    cfg = CollectConfig.model_validate(
        {
            "input": rows(tmp_path, 3),
            "output": str(tmp_path / "episodes.jsonl"),
            "backend": {"kind": "local", "model": str(family_checkpoint("chatml"))},
            "environment": ENV,
            "max_output_tokens": 16,
            "num_repeats": 2,
        },
        strict=False,
    )
    stage = ctx(tmp_path, "collect")
    metrics = run_collect(cfg, stage)
    lines = [json.loads(x) for x in Path(cfg.output).read_text().splitlines()]
    assert [(x["prompt_idx"], x["sample_idx"]) for x in lines] == [
        (i, s) for i in range(3) for s in range(2)
    ]
    for line in lines:  # a random model: no call, one text turn, reward 0 from /verify
        assert line["messages"][:2] == [
            {"role": "system", "content": line["messages"][0]["content"]},
            {"role": "user", "content": line["messages"][1]["content"]},
        ]
        assert line["messages"][-1]["role"] == "assistant" and line["end"] == "done"
        assert line["tools"][0]["function"]["name"] == "get_weather"
        assert line["usage"]["completion_tokens"] > 0
    assert metrics["written"] == 6 and metrics["episodes"]["failed"] == 0
    assert b"servers ready!" in (Path(stage.stage_dir) / "nemo_gym.log").read_bytes()
    assert left_in(Path(stage.stage_dir)) == []


def test_evaluate_scores_with_the_agents_reward(tmp_path, family_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_checkpoint("chatml"))
    with PolicyServer(Scripted(tok), tok, name="scripted") as server:
        cfg = EvaluateConfig.model_validate(
            {
                "input": rows(tmp_path, 3),
                "backend": {"kind": "openai", "base_url": server.base_url, "model": "scripted"},
                "environment": ENV,
                "temperature": 0.0,
                "output": str(tmp_path / "report.json"),
            },
            strict=False,
        )
        stage = ctx(tmp_path, "evaluate")
        report: dict[str, Any] = run_evaluate(cfg, stage)
    (result,) = report["results"]
    assert (result["accuracy"], result["mean_turns"], result["failed_episodes"]) == (1.0, 2.0, 0)
    assert left_in(Path(stage.stage_dir)) == []


class Oracle:
    """A policy at the edge that answers each question it finds in its prompt with the text
    given for it (right for some rows, wrong for others)."""

    def __init__(self, tokenizer: Any, answers: dict[str, str]) -> None:
        self.tok, self.answers = tokenizer, answers
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts: list[Any], sampling: Any) -> list[Any]:
        from stages.lib.model.generate import Generation

        out = []
        for p in prompts:
            seen = self.tok.decode(p.ids)
            text = next((a for q, a in self.answers.items() if q in seen), "no idea")
            ids = [*self.tok.encode(text, add_special_tokens=False), self.end]
            lps = (-0.5,) * len(ids)
            out.append(Generation(text, "stop", len(p.ids), len(ids), tuple(ids), lps, p.ids))
        return out


def math_rows() -> list[tuple[dict[str, Any], str, float]]:
    """math_with_judge's own example rows (its judge off: math-verify decides): the boxed
    answer for even rows, a wrong one for odd rows."""
    path = SITE / "resources_servers/math_with_judge/data/example.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()[:4]]
    out = []
    for i, row in enumerate(rows):
        right = i % 2 == 0
        answer = row["expected_answer"] if right else "-12345"
        out.append((row, f"The answer is \\boxed{{{answer}}}.", float(right)))
    return out


def chain_sum_rows() -> list[tuple[dict[str, Any], str, float]]:
    """reasoning_gym's chain_sum, generated here as its create_dataset script does."""
    import reasoning_gym

    out = []
    for i, entry in enumerate(reasoning_gym.create_dataset("chain_sum", size=4, seed=3)):
        question = entry["question"]
        row = {
            "responses_create_params": {"input": [{"role": "user", "content": question}]},
            "question": question,
            "answer": entry["answer"],
            "metadata": entry["metadata"],
        }
        answer = entry["answer"] if i % 2 == 0 else str(int(entry["answer"]) + 1)
        out.append((row, f"<answer>{answer}</answer>", float(i % 2 == 0)))
    return out


@pytest.mark.parametrize(
    ("server", "made"),
    [("math_with_judge", math_rows), ("reasoning_gym", chain_sum_rows)],
)
def test_nemo_gyms_verifiers_score_the_episodes(tmp_path, family_checkpoint, server, made):
    from transformers import AutoTokenizer

    needs = {"math_with_judge": "math_verify", "reasoning_gym": "reasoning_gym"}[server]
    if not (SITE / needs).exists():
        pytest.skip(f"{needs} not in .venv-gym (make install-gym installs it)")
    cases = made()
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _, _ in cases))
    tok = AutoTokenizer.from_pretrained(family_checkpoint("chatml"))
    answers = {r["responses_create_params"]["input"][-1]["content"][-60:]: a for r, a, _ in cases}
    environment = {
        "kind": "nemo_gym",
        "config_paths": [f"resources_servers/{server}/configs/{server}.yaml"],
        "agent": f"{server}_simple_agent",
    }
    with PolicyServer(Oracle(tok, answers), tok, name="oracle") as policy:
        cfg = EvaluateConfig.model_validate(
            {
                "input": str(tmp_path / "rows.jsonl"),
                "backend": {"kind": "openai", "base_url": policy.base_url, "model": "oracle"},
                "environment": environment,
                "temperature": 0.0,
                "output": str(tmp_path / "report.json"),
            },
            strict=False,
        )
        report = run_evaluate(cfg, ctx(tmp_path, "evaluate"))
    (result,) = report["results"]
    assert result["accuracy"] == sum(s for _, _, s in cases) / len(cases) == 0.5
    generations = tmp_path / "generations.jsonl"
    rewards = [json.loads(x)["total_reward"] for x in generations.read_text().splitlines()]
    assert rewards == [s for _, _, s in cases]
