"""`pipe tune`'s logic against a deterministic model of a capacity-limited server."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stages.collect.tune.cli import _run, render_sweep, sweep_json, tune_command
from stages.collect.tune.sweep import Level, diagnose, find_knee, recommend, sweep
from stages.collect.tune.target import requests_for


@dataclass(frozen=True)
class Lv:
    parallelism: int
    rollouts_per_s: float
    p50_s: float
    p95_s: float
    errors: int = 0
    timeouts: int = 0
    verify_s: float = 0.0
    wall_s: float = 1.0


def server(capacity: int, latency_s: float, fail_above: int | None = None) -> Callable[[int], Lv]:
    """At most `capacity` requests served at once, each `latency_s`; the rest queue."""

    def measure(p: int) -> Lv:
        latency = latency_s * max(1.0, p / capacity)
        errors = p if fail_above is not None and p > fail_above else 0
        return Lv(p, min(p, capacity) / latency_s, latency, 1.5 * latency, errors)

    return measure


def table(rates: dict[int, float]) -> Callable[[int], Lv]:
    return lambda p: Lv(p, rates[p], 0.1, 0.2)


def parallelisms(levels: tuple[Level, ...]) -> list[int]:
    return [lv.parallelism for lv in levels]


def test_capacity_64_knee_is_64_and_recommendation_51() -> None:
    result = sweep(server(64, 0.1), start=8)
    assert parallelisms(result.levels) == [8, 16, 32, 64, 128]
    assert (result.knee, result.recommended) == (64, 51)
    assert result.stopped == "throughput changed +0% from parallelism 64 to 128 (less than +10%)"


def test_capacity_between_levels_takes_the_first_level_past_it() -> None:
    result = sweep(server(100, 0.1), start=8)
    assert parallelisms(result.levels) == [8, 16, 32, 64, 128, 256]
    assert (result.knee, result.recommended) == (128, 102)


def test_the_nemo_gym_table_flattens_at_64() -> None:
    result = sweep(table({8: 2.1, 16: 4.0, 32: 7.2, 64: 8.1, 128: 8.3}), start=8)
    assert parallelisms(result.levels) == [8, 16, 32, 64, 128]
    assert (result.knee, result.recommended) == (64, 51)


def test_falling_throughput_stops_the_sweep() -> None:
    result = sweep(table({8: 10.0, 16: 20.0, 32: 15.0}), start=8)
    assert parallelisms(result.levels) == [8, 16, 32]
    assert (result.knee, result.recommended) == (16, 13)
    assert result.stopped == "throughput changed -25% from parallelism 16 to 32 (less than +10%)"


def test_errors_stop_the_sweep_and_the_level_does_not_count() -> None:
    result = sweep(server(1000, 0.1, fail_above=50), start=8)
    assert parallelisms(result.levels) == [8, 16, 32, 64]
    assert (result.knee, result.recommended) == (32, 26)
    assert result.stopped == "64 errors or timeouts at parallelism 64"


def test_errors_at_the_first_level_give_no_knee() -> None:
    result = sweep(server(64, 0.1, fail_above=1), start=8)
    assert parallelisms(result.levels) == [8]
    assert (result.knee, result.recommended) == (None, None)
    assert render_sweep(result).splitlines()[-1] == (
        "knee: none (every level had errors); check the backend, or lower --start"
    )


def test_max_levels_caps_the_sweep() -> None:
    result = sweep(server(10_000, 0.1), start=8, max_levels=4)
    assert parallelisms(result.levels) == [8, 16, 32, 64]
    assert (result.knee, result.recommended) == (64, 51)
    assert result.stopped.startswith("reached 4 levels while throughput still rose")


def test_knee_and_recommendation_rules() -> None:
    assert find_knee([]) is None
    assert find_knee([Lv(8, 100.0, 0.1, 0.1), Lv(16, 91.0, 0.1, 0.1)]) == 8
    assert find_knee([Lv(8, 100.0, 0.1, 0.1), Lv(16, 112.0, 0.1, 0.1)]) == 16
    assert [recommend(k) for k in (1, 2, 3, 5, 10, 15, 64, 128)] == [1, 2, 2, 4, 8, 12, 51, 102]


def test_requests_per_level_default_to_four_waves_and_two_seconds() -> None:
    assert requests_for(8, None) == 100
    assert requests_for(64, None) == 256
    assert requests_for(64, None, last_rate=400.0) == 800
    assert requests_for(64, 50, last_rate=400.0) == 50


def test_json_document_has_exactly_the_contract_keys() -> None:
    assert sweep_json(sweep(server(64, 0.1), start=32)) == {
        "levels": [
            {"parallelism": 32, "rollouts_per_s": 320.0, "p50_s": 0.1, "p95_s": 0.15, "errors": 0},
            {"parallelism": 64, "rollouts_per_s": 640.0, "p50_s": 0.1, "p95_s": 0.15, "errors": 0},
            {"parallelism": 128, "rollouts_per_s": 640.0, "p50_s": 0.2, "p95_s": 0.3, "errors": 0},
        ],
        "knee": 64,
        "recommended": 51,
    }


def test_text_report() -> None:
    assert render_sweep(sweep(server(64, 0.1), start=16)) == "\n".join(
        [
            "parallelism  rollouts/s    p50 s    p95 s  errors",
            "         16       160.0    0.100    0.150       0",
            "         32       320.0    0.100    0.150       0",
            "         64       640.0    0.100    0.150       0",
            "        128       640.0    0.200    0.300       0",
            "stopped: throughput changed +0% from parallelism 64 to 128 (less than +10%)",
            "knee: 64 (the lowest parallelism within 10% of the best, 640.0 rollouts/s)",
            "recommended: num_samples_in_parallel: 51 (80% of the knee, for headroom)",
        ]
    )


@pytest.mark.parametrize(
    ("low", "high", "verdict", "reason"),
    [
        (
            Lv(5, 50.0, 0.1, 0.1),
            Lv(20, 195.0, 0.1, 0.1),
            "parallelism",
            "throughput scaled 3.9x from parallelism 5 to 20 (ideal 4x)",
        ),
        (
            Lv(5, 50.0, 0.1, 0.1),
            Lv(20, 55.0, 0.36, 0.5),
            "backend",
            "throughput scaled 1.1x from parallelism 5 to 20 (ideal 4x) while p50 latency rose "
            "3.6x: requests queue in the backend",
        ),
        (
            Lv(5, 50.0, 0.1, 0.1),
            Lv(20, 52.0, 0.1, 0.1, verify_s=0.8, wall_s=1.0),
            "verification",
            "throughput scaled 1.0x from parallelism 5 to 20 (ideal 4x), and the verifier took "
            "80% of the wall time",
        ),
        (
            Lv(5, 50.0, 0.1, 0.1),
            Lv(20, 50.0, 0.1, 0.1),
            "client",
            "throughput scaled 1.0x from parallelism 5 to 20 (ideal 4x) while p50 latency stayed "
            "flat (1.0x): requests are not really concurrent",
        ),
        (
            Lv(5, 50.0, 0.1, 0.1),
            Lv(20, 10.0, 0.1, 0.1, errors=7, timeouts=7),
            "backend",
            "7 errors or timeouts at parallelism 20, none at 5: the backend is overloaded",
        ),
    ],
)
def test_diagnose(low: Lv, high: Lv, verdict: str, reason: str) -> None:
    result = diagnose(low, high)
    assert (result.verdict, result.reason) == (verdict, reason)


PIPELINE = """\
# Tune me.
name: tuned
stages:
  collect:
    kind: collect
    config:
      input: prompts.jsonl      # the prompts
      num_samples_in_parallel: 32   # requests in flight
      backend: {kind: openai, base_url: "http://127.0.0.1:9/v1", model: fake}
      verifier: {kind: exact_match}
  filter:
    kind: filter
    needs: [collect]
    config: {min_reward: 1.0}
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(20))
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def opts(**over: Any) -> dict[str, Any]:
    base = {
        "overrides": (),
        "requests": None,
        "plot": None,
        "diagnose": False,
        "start": 8,
        "max_levels": 8,
        "fmt": "text",
        "write": False,
    }
    return {**base, **over}


def test_tune_writes_the_recommendation_changing_one_line(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[int, int]] = []

    def factory(target: Any, requests: int | None) -> Callable[[int], Lv]:
        assert [r["prompt"] for r in target.rows] == [f"q{i}" for i in range(20)]
        model = server(64, 0.1)

        def measure(p: int) -> Lv:
            seen.append((p, requests or 0))
            return model(p)

        return measure

    code = _run("p.yaml", "collect", opts(write=True, fmt="json", requests=50), factory)
    assert code == 0
    assert seen == [(8, 50), (16, 50), (32, 50), (64, 50), (128, 50)]
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert (doc["knee"], doc["recommended"]) == (64, 51)
    assert captured.err.splitlines() == [
        f"plot: {Path('p.tune-collect.png')}",
        "wrote p.yaml: stages.collect.config.num_samples_in_parallel: 51",
    ]
    diff = list(
        difflib.unified_diff(
            PIPELINE.splitlines(), (project / "p.yaml").read_text().splitlines(), n=0, lineterm=""
        )
    )
    assert diff[2:] == [
        "@@ -8 +8 @@",
        "-      num_samples_in_parallel: 32   # requests in flight",
        "+      num_samples_in_parallel: 51   # requests in flight",
    ]
    assert (project / "p.tune-collect.png").read_bytes()[:4] == b"\x89PNG"


def test_diagnose_as_json(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _run("p.yaml", "collect", opts(diagnose=True, fmt="json"), lambda t, n: server(10, 0.1))
    assert code == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "levels": [
            {"parallelism": 5, "rollouts_per_s": 50.0, "p50_s": 0.1, "p95_s": 0.15, "errors": 0},
            {"parallelism": 20, "rollouts_per_s": 100.0, "p50_s": 0.2, "p95_s": 0.3, "errors": 0},
        ],
        "verdict": "parallelism",
        "reason": "throughput scaled 2.0x from parallelism 5 to 20 (ideal 4x)",
        "next_step": "raise num_samples_in_parallel: run `pipe tune` to find the knee, with --write to keep it",
    }
    assert captured.err == f"plot: {Path('p.diagnose-collect.png')}\n"


def test_diagnose_prints_the_verdict(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _run(
        "p.yaml", "collect", opts(diagnose=True, plot="d.png"), lambda t, n: server(64, 0.1)
    )
    assert code == 0
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "verdict: parallelism is the limit",
        "why: throughput scaled 4.0x from parallelism 5 to 20 (ideal 4x)",
        "next step: raise num_samples_in_parallel: run `pipe tune` to find the knee, with --write "
        "to keep it",
    ]
    assert (project / "d.png").exists()
    assert (project / "p.yaml").read_text() == PIPELINE


def test_diagnose_says_when_the_stages_gpus_were_under_the_guides_80_percent(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stage_dir = project / "runs" / "tuned" / "collect"  # where `pipe run` kept its last run
    stage_dir.mkdir(parents=True)
    usage = {"cpu_util_mean": 90.0, "gpu_util_mean": 42.4, "gpu_util_peak": 97.0}
    (stage_dir / "metrics.json").write_text(json.dumps({"rows": 20, "usage": usage}))
    server64 = server(64, 0.1)
    code = _run("p.yaml", "collect", opts(diagnose=True, plot="d.png"), lambda t, n: server64)
    assert code == 0
    assert capsys.readouterr().out.splitlines()[-4:] == [
        "GPU utilisation 42% < 80% (the tuning guide's target)",
        "  - increase batch sizes (micro_rollout_batch_size, micro_train_batch_size, "
        "num_samples_in_parallel)",
        "  - enable the hybrid engine (profile: high-performance colocates all models)",
        "  - reduce vLLM's tensor parallel size (vllm_tensor_parallel_size: more engines instead)",
    ]
    usage["gpu_util_mean"] = 85.0
    (stage_dir / "metrics.json").write_text(json.dumps({"usage": usage}))
    _run("p.yaml", "collect", opts(diagnose=True, fmt="json", plot="d.png"), lambda t, n: server64)
    doc = json.loads(capsys.readouterr().out)
    assert (doc["gpu_util"], doc["gpu_advice"]) == (85.0, [])


def invoke(*args: str) -> Any:
    return CliRunner().invoke(tune_command, list(args), catch_exceptions=False)


def test_unknown_stage_points_at_the_option(project: Path) -> None:
    result = invoke("p.yaml", "--stage", "colect")
    assert result.exit_code == 2
    assert result.stderr == "--stage: no stage named 'colect' in p.yaml; did you mean 'collect'?\n"


def test_a_stage_of_another_kind_points_at_its_kind(project: Path) -> None:
    result = invoke("p.yaml", "--stage", "filter")
    assert result.exit_code == 2
    assert result.stderr == (
        "p.yaml:12:11: stages.filter.kind: pipe tune measures a collect stage, found kind 'filter';"
        " collect stages: 'collect'\n"
    )


def test_a_missing_prompts_file_points_at_the_input(project: Path) -> None:
    (project / "prompts.jsonl").unlink()
    result = invoke("p.yaml", "--stage", "collect")
    assert result.exit_code == 2
    assert result.stderr == (
        f"p.yaml:7:14: stages.collect.config.input: no such file '{Path('prompts.jsonl')}'\n"
    )


def test_an_invalid_pipeline_is_reported_like_validate(project: Path) -> None:
    (project / "p.yaml").write_text(PIPELINE.replace("verifier:", "verifyer:"))
    result = invoke("p.yaml", "--stage", "collect")
    assert result.exit_code == 2
    assert result.stderr == (
        "p.yaml:10:7: stages.collect.config.verifyer: unknown field 'verifyer'; did you mean "
        "'verifier'?\n"
    )


def test_write_and_diagnose_do_not_mix(project: Path) -> None:
    result = invoke("p.yaml", "--stage", "collect", "--write", "--diagnose")
    assert result.exit_code == 2
    assert "--write needs a sweep; drop --diagnose" in result.stderr
