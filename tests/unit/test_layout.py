"""The layout as a contract: one package per kind, no import cycles, an engine that names no
kind, short files, and code versions that follow every file a kind runs."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

KINDS = ("dataset", "collect", "filter", "train", "evaluate", "rl")
# one internal file (not the light __init__.py) of each built-in kind
INTERNAL = {
    "dataset": "stages/dataset/run.py",
    "collect": "stages/collect/collector.py",
    "filter": "stages/filter/rules.py",
    "train": "stages/train/loop.py",
    "evaluate": "stages/evaluate/run.py",
    "rl": "stages/rl/algo/loss.py",
}


def test_no_module_imports_a_module_that_imports_it_back():
    import grimp
    import networkx as nx

    # an import for type annotations only is no run-time import (as `make lint` counts them)
    graph = grimp.build_graph("engine", "stages", exclude_type_checking_imports=True)
    edges = nx.DiGraph()
    for module in graph.modules:
        edges.add_edges_from((module, m) for m in graph.find_modules_directly_imported_by(module))
    cycles = [sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1]
    assert cycles == []


def test_the_engine_names_no_kind_and_no_kinds_field():
    hits = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        text = path.read_text()
        for needle in ("kind ==", *(f'"{k}"' for k in KINDS), '"backend', "num_repeats"):
            if needle in text:
                hits.append(f"{path.relative_to(ROOT)}: {needle}")
    assert hits == []


def test_every_kind_is_a_package_and_no_source_file_is_over_400_lines():
    for kind in KINDS:
        assert (ROOT / "stages" / kind / "__init__.py").is_file(), kind
    loose = sorted(p.name for p in (ROOT / "stages").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for top in ("engine", "stages")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert long == []


PHASES = (
    "engine/load",
    "engine/resolve",
    "engine/plan",
    "engine/cluster",
    "engine/run",
    "engine/run/tracking",
)
RL_ROLES = ("algo", "roles", "rollout", "sync", "controller")


def test_the_engine_is_cut_by_phase_and_rl_by_role_each_part_stating_its_input_and_output():
    parts = [*PHASES, *(f"stages/rl/{r}" for r in RL_ROLES)]
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    # beside the phases: what they share, the edges of the world (files; the model hub; a
    # checkpoint folder and a GGUF file's header read light, which stages read the same way;
    # what a model's snapshot in the hub cache must hold)
    assert loose == [
        "__init__.py",
        "checkpoint.py",
        "codeversion.py",
        "errors.py",
        "fsio.py",
        "gguf_header.py",
        "hub.py",
        "hub_files.py",
    ]
    loose_rl = sorted(p.name for p in (ROOT / "stages/rl").glob("*.py"))
    assert loose_rl == ["__init__.py", "run.py"]
    for part in parts:
        doc = (ROOT / part / "__init__.py").read_text()
        assert doc.startswith('"""') and "Input:" in doc and "Output:" in doc, part


VERSIONS = """
import json
from engine.stage import kinds
print(json.dumps({name: k.code_version() for name, k in sorted(kinds().items())}))
"""


def _versions(root: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", VERSIONS],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    versions: dict[str, str] = json.loads(out.stdout)
    return versions


@pytest.mark.slow
def test_editing_an_internal_file_changes_that_kinds_code_version_only(tmp_path: Path):
    copy = tmp_path / "project"
    for top in ("engine", "stages"):
        shutil.copytree(ROOT / top, copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    before = _versions(copy)
    assert set(KINDS) <= set(before)
    for kind, rel in INTERNAL.items():
        with open(copy / rel, "a") as f:
            f.write(f"\n# edited for the {kind} test\n")
        after = _versions(copy)
        changed = sorted(k for k in KINDS if after[k] != before[k])
        assert changed == [kind], rel
        before = after
    # shared code: every kind that imports it changes, the others do not; and the data read
    # beside the code: a vendored chat template re-runs every kind that renders prompts
    verifying = ["collect", "evaluate", "filter", "rl", "train"]  # filter's verifier rescores
    for rel, kinds_changed in (
        ("stages/lib/verify.py", verifying),
        # HTTP backends, and a judge (any verifier: train's held-out one, filter's too)
        ("stages/lib/api/client.py", verifying),
        # every kind that renders prompts, and filter: a local judge renders its own
        ("stages/lib/chat/families/gemma.jinja", verifying),
    ):
        with open(copy / rel, "a") as f:
            f.write("\n")
        after = _versions(copy)
        assert sorted(k for k in KINDS if after[k] != before[k]) == kinds_changed, rel
        before = after


LIB_PACKAGES = (
    "api",
    "backends",
    "builders",
    "chat",
    "distributed",
    "env",
    "io",
    "judge",
    "model",
    "serve",
)
# file names every kind (or every role) has by design: the same job in each package
PER_PACKAGE = {"__init__.py", "run.py", "brief.py", "cli.py"}
# file names two packages share because they are the two sides of one concept; each
# docstring names the other file. Every other module name is unique across engine/ and stages/
TWO_SIDES = {
    "slurm.py": ("engine/load/slurm.py", "engine/cluster/slurm.py"),
    "headline.py": ("engine/run/headline.py", "stages/evaluate/headline.py"),
    "local.py": ("stages/lib/backends/local.py", "stages/rl/rollout/local.py"),
    "multiturn.py": ("stages/collect/multiturn.py", "stages/evaluate/multiturn.py"),
    "loss.py": ("stages/train/loss.py", "stages/rl/algo/loss.py"),
    "loop.py": ("stages/train/loop.py", "stages/rl/controller/loop.py"),
    "vllm.py": ("stages/rl/rollout/vllm.py", "stages/rl/sync/vllm.py"),
}


def test_shared_stage_code_is_grouped_by_concern_each_package_stating_its_input_and_output():
    lib = ROOT / "stages/lib"
    loose = sorted(p.name for p in lib.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose
    packages = sorted(p.name for p in lib.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(LIB_PACKAGES)
    for name in ("", *LIB_PACKAGES):
        doc = (lib / name / "__init__.py").read_text()
        assert doc.startswith('"""') and "Input:" in doc and "Output:" in doc, name


def test_one_name_one_meaning_no_two_modules_share_a_file_name():
    seen: dict[str, list[str]] = {}
    for top in ("engine", "stages"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if p.name not in PER_PACKAGE:
                seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    shared = {name: tuple(sorted(paths)) for name, paths in seen.items() if len(paths) > 1}
    assert shared == {name: tuple(sorted(pair)) for name, pair in TWO_SIDES.items()}
    for a, b in TWO_SIDES.values():
        for this, other in ((a, b), (b, a)):
            doc = ast.get_docstring(ast.parse((ROOT / this).read_text())) or ""
            assert "two sides of one concept" in doc and other in doc.replace("\n", " "), this
