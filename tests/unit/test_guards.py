"""Standing guards: example pipelines, the committed schema, and a light `pipe validate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.load.jsonschema import schema_text
from engine.load.load import load_pipeline
from engine.load.source import load_document
from tests.conftest import ROOT, run_cli
from tests.fetched import planned_from

PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


def test_there_are_example_pipelines():
    assert any(p.name == "quickstart.yaml" for p in PIPELINES)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_header_names_its_command_and_schema(path: Path):
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert any(f"pipe run pipelines/{path.name}" in line for line in header), header
    assert "# yaml-language-server: $schema=../schemas/pipeline.schema.json" in header


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_validates(path: Path, tmp_path: Path):
    cwd = planned_from(path, tmp_path)  # a fetched model file: its stand-in
    result = run_cli("validate", f"pipelines/{path.name}", cwd=cwd)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip().endswith("stages)")


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_matches_json_schema(path: Path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas" / "pipeline.schema.json").read_text())
    jsonschema.validate(load_document(path).data, schema)


def test_json_schema_rejects_what_the_loader_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas" / "pipeline.schema.json").read_text())
    data = load_document(ROOT / "tests" / "data" / "valid.yaml").data
    data["stages"]["filter"]["config"]["max_lenght"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)


def test_committed_schema_is_current():
    committed = (ROOT / "schemas" / "pipeline.schema.json").read_text()
    assert committed == schema_text(), "schemas/ drifted: run `make schemas` and commit"


def test_every_schema_field_has_a_description():
    schema = json.loads(schema_text())
    missing = []
    for name, definition in schema["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{name}.{field}")
    assert missing == []


def test_validate_imports_no_heavy_library():
    code = (
        "import sys\n"
        "from engine.cli import main\n"
        "tracked = ['--set', 'tracking.tensorboard.dir=tb', '--set', "
        "'tracking.mlflow.experiment=x',\n"
        "           '--set', 'tracking.wandb.mode=offline']\n"  # trackers named: found, not imported
        "for args in (['pipelines/quickstart.yaml', *tracked],\n"
        "             ['pipelines/grpo_quickstart.yaml', '--cluster', '1x8x80GB']):\n"
        "    try:\n"
        "        main(['validate', *args])\n"  # --cluster: placement and the memory model too
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'vllm', 'tensorboard',\n"
        "                     'mlflow', 'wandb', 'bokeh') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "stages.collect.config.num_repeats=zero",
            "stages.collect.config.num_repeats: expected an integer, found 'zero'",
        ),
        # a typo in the stage's name makes a new stage without a kind: the error names the
        # --set that made it, not the `stages:` line of the file
        ("stages.colect.config.num_repeats=8", "stages.colect: missing required field 'kind'"),
    ],
)
def test_set_override_is_validated_and_named(override: str, message: str):
    result = run_cli("validate", str(ROOT / "pipelines" / "quickstart.yaml"), "--set", override)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"--set {override}: {message}"


def test_set_override_applies():
    loaded = load_pipeline(
        ROOT / "pipelines" / "quickstart.yaml", ["stages.collect.config.num_repeats=8"]
    )
    assert loaded.spec.stages["collect"].config["num_repeats"] == 8


def test_malformed_override_is_usage_error():
    result = run_cli(
        "validate", str(ROOT / "pipelines" / "quickstart.yaml"), "--set", "no-equals-sign"
    )
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        == "--set no-equals-sign: expected PATH=VALUE, e.g. stages.collect.config.limit=100"
    )


def test_graph_text():
    result = run_cli("graph", str(ROOT / "pipelines" / "quickstart.yaml"), "--format", "text")
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        "data (dataset)",
        "warmup (train) <- data",
        "collect (collect) <- data, warmup",
        "filter (filter) <- collect",
        "rft (train) <- filter, warmup",
        "evaluate (evaluate) <- data, warmup, rft",
    ]


def test_graph_dot_and_mermaid():
    dot = run_cli("graph", str(ROOT / "pipelines" / "quickstart.yaml"), "--format", "dot").stdout
    assert '"collect" -> "filter";' in dot and dot.startswith('digraph "quickstart" {')
    mermaid = run_cli(
        "graph", str(ROOT / "pipelines" / "quickstart.yaml"), "--format", "mermaid"
    ).stdout
    assert "  collect --> filter" in mermaid.splitlines()


def test_stages_lists_builtin_kinds():
    out = run_cli("stages").stdout
    assert [line.split()[0] for line in out.splitlines()] == [
        "collect",
        "dataset",
        "evaluate",
        "filter",
        "rl",
        "train",
    ]
