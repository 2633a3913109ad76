"""A backend registered from this test module, with no other file changed: its block is
validated, planned (its own check, derived setting and preset settings) and collect and
evaluate run through it: the server it starts for each block answers, and is stopped after.

The toy backend serves bench/collect/fake_server.py (an OpenAI-compatible server at the edge
of the world: deterministic `<answer>N</answer>` answers) from its `open_endpoint`, as vLLM's
backend serves its servers.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, ResolveContext, StageContext
from stages.lib.backends.endpoint import Endpoint, Serving
from stages.lib.backends.protocol import BackendConfig
from stages.lib.backends.registered import register_backend, unregister_backend
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "collect"))
from fake_server import expected_answer, start_in_thread

STARTED: list[str] = []  # the URL of every server the toy started
STOPPED: list[str] = []


class ToyBackend(BackendConfig):
    """A toy server started for each block, answering every prompt deterministically."""

    kind: Literal["toy"] = Field(description="A toy server the stage starts and stops.")
    model: str = Field("toy", description="The name it answers as.")
    capacity: int = Field(4, gt=0, description="Requests it serves at once.")
    vllm_gpu_memory_utilization: float = Field(0.9, description="Taken from the presets.")
    echo: bool = Field(False, description="Derived: true when prompts repeat.")

    SERVES_OWN_MODEL = True
    VLLM_SAMPLING = False

    @classmethod
    def takes_preset(cls, key: str) -> bool:
        return key == "vllm_gpu_memory_utilization"

    def derive(self, ctx: ResolveContext, num_repeats: int) -> dict[str, Derived]:
        return {"backend.echo": Derived(True, "prompts repeat")} if num_repeats > 1 else {}

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        if self.capacity > 64:
            return [ctx.error("backend.capacity", f"{self.capacity} is too many; at most 64")]
        return []

    @contextmanager
    def open_endpoint(self, serving: Serving) -> Iterator[Endpoint]:
        handle = start_in_thread(capacity=self.capacity)
        STARTED.append(handle.url)
        try:
            yield Endpoint(handle.url, self.model, "chat")
        finally:
            handle.stop()
            STOPPED.append(handle.url)


@pytest.fixture(autouse=True)
def toy() -> Iterator[None]:
    register_backend(ToyBackend)
    STARTED.clear()
    STOPPED.clear()
    yield
    unregister_backend("toy")


ROWS = [{"prompt": f"question {i}"} for i in range(6)]


def _rows(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    rows = [{**r, "answer": expected_answer(r["prompt"])} for r in ROWS]
    rows[0]["answer"] = "wrong"  # one answer the verifier refuses
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _pipeline(tmp_path: Path, capacity: int) -> Path:
    _rows(tmp_path)
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            name: toy
            profile: high-performance
            stages:
              collect:
                kind: collect
                config:
                  input: prompts.jsonl
                  num_repeats: 2
                  backend: {{kind: toy, capacity: {capacity}}}
                  verifier: {{kind: exact_match}}
              evaluate:
                kind: evaluate
                config:
                  input: prompts.jsonl
                  backend: {{kind: toy}}
                  verifier: {{kind: exact_match}}
            """
        )
    )
    return path


def test_a_registered_backend_is_validated_checked_and_derived(tmp_path: Path) -> None:
    from engine.errors import PipeError
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve

    with pytest.raises(PipeError) as err:
        plan(resolve(load_pipeline(_pipeline(tmp_path, capacity=65))))
    assert "stages.collect.config.backend.capacity: 65 is too many; at most 64" in str(err.value)

    resolved = resolve(load_pipeline(_pipeline(tmp_path, capacity=8)))
    plan(resolved)
    collect = resolved.stages["collect"]
    assert collect.config.backend == ToyBackend(  # type: ignore[attr-defined]
        kind="toy", capacity=8, vllm_gpu_memory_utilization=0.5, echo=True
    )
    assert collect.source("backend.echo").render() == "rule: prompts repeat"
    assert collect.source("backend.vllm_gpu_memory_utilization").label == (
        "profile high-performance"
    )

    (tmp_path / "typo.yaml").write_text(
        _pipeline(tmp_path, 8).read_text().replace("capacity: 8", "capacty: 8")
    )
    with pytest.raises(PipeError) as typo:
        load_pipeline(tmp_path / "typo.yaml")
    assert "unknown field 'capacty'; did you mean 'capacity'?" in str(typo.value)


def test_collect_and_evaluate_run_through_a_registered_backend(tmp_path: Path) -> None:
    from stages.collect import CollectConfig
    from stages.collect.run import run_collect
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import run_evaluate
    from stages.lib.config import Verifier

    data = _rows(tmp_path)
    exact = Verifier(kind="exact_match")
    backend = {"kind": "toy", "capacity": 2}
    (tmp_path / "collect").mkdir()
    collect = CollectConfig.model_validate(
        {
            "input": str(data),
            "output": str(tmp_path / "collect" / "rollouts.jsonl"),
            "num_repeats": 2,
            "backend": backend,
            "verifier": exact,
        }
    )
    ctx = StageContext("collect", "collect", str(tmp_path / "collect"), str(tmp_path), "")
    metrics = run_collect(collect, ctx)
    rollouts = [json.loads(line) for line in Path(collect.output).read_text().splitlines()]
    assert metrics["rows"] == len(rollouts) == 12
    assert sorted((r["prompt_idx"], r["reward"]) for r in rollouts) == [
        (i, 0.0 if i == 0 else 1.0) for i in range(6) for _ in range(2)
    ]
    assert metrics["sampling"]["top_p"] == 1.0 and "top_k" not in metrics["sampling"]

    (tmp_path / "evaluate").mkdir()
    evaluate = EvaluateConfig.model_validate(
        {
            "input": str(data),
            "output": str(tmp_path / "evaluate" / "report.json"),
            "backend": backend,
            "verifier": exact,
        }
    )
    ctx = StageContext("evaluate", "evaluate", str(tmp_path / "evaluate"), str(tmp_path), "")
    (result,) = run_evaluate(evaluate, ctx)["results"]
    assert result["checkpoint"] == "toy" and result["n"] == 6
    assert result["accuracy"] == pytest.approx(5 / 6)
    assert len(STARTED) == 2 and STOPPED == STARTED  # one server a block, each stopped


def test_an_unknown_backend_names_the_registered_ones(tmp_path: Path) -> None:
    from engine.errors import PipeError
    from engine.load.load import load_pipeline

    path = _pipeline(tmp_path, 8)
    path.write_text(path.read_text().replace("{kind: toy}", "{kind: tyo}"))
    with pytest.raises(PipeError) as err:
        load_pipeline(path)
    assert (
        "stages.evaluate.config.backend.kind: expected 'openai', 'vllm', 'local' or "
        "'toy', found 'tyo'; did you mean 'toy'?"
    ) in str(err.value)
