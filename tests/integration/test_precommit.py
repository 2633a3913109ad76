"""The pre-commit hooks of this repository (`.pre-commit-hooks.yaml`), run as a user's CI
would: `pre-commit try-repo` of this checkout inside a scratch git repository.

`pipe-validate` fails on a pipeline with a mistake, printing its located error, and
passes once it is fixed; `pipe-schema` fails while the committed JSON Schema is stale.
The hooks run the `pipe` on PATH (`language: unsupported`): here a shim that runs this
checkout's CLI, so nothing is installed and nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration]

GOOD = """\
name: good
stages:
  data:
    kind: dataset
    config: {source: reasoning_gym, task: chain_sum, size: 10, test_size: 2}
"""
BAD = GOOD.replace("name: good", "name: bad") + "  filter:\n    kind: filter\n    needs: [dta]\n"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_hooks_fail_on_a_bad_pipeline_until_it_is_fixed(tmp_path: Path):
    repo, shims = tmp_path / "repo", tmp_path / "bin"
    (repo / "pipelines").mkdir(parents=True)
    shims.mkdir()
    pipe = shims / "pipe"
    pipe.write_text(f'#!/bin/sh\nexec {sys.executable} -m engine.cli "$@"\n')
    pipe.chmod(0o755)
    (repo / "pipelines" / "good.yaml").write_text(GOOD)
    (repo / "pipelines" / "bad.yaml").write_text(BAD)
    (repo / "README.md").write_text("not a pipeline\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "pipelines")
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "OMP_NUM_THREADS": "1",
    }

    def hook(name: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pre_commit", "try-repo", str(ROOT), name, "--all-files"]
        return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)

    failed = hook("pipe-validate")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    lines = failed.stdout.splitlines()
    assert (
        "pipelines/bad.yaml:8:13: stages.filter.needs[0]: no stage named 'dta'; did you mean "
        "'data'?" in lines
    )
    assert "pipelines/good.yaml: ok (1 stages)" in lines
    assert not any("README" in line for line in lines)  # only pipeline files are passed

    (repo / "pipelines" / "bad.yaml").write_text(BAD.replace("[dta]", "[data]"))
    _git(repo, "add", ".")
    fixed = hook("pipe-validate")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "Passed" in fixed.stdout

    (repo / "schemas").mkdir()
    schema = repo / "schemas" / "pipeline.schema.json"
    schema.write_text((ROOT / "schemas" / "pipeline.schema.json").read_text())
    assert hook("pipe-schema").returncode == 0
    schema.write_text("{}\n")
    stale = hook("pipe-schema")
    assert stale.returncode == 1
    assert (
        "schemas/pipeline.schema.json: out of date; run `pipe schema --out schemas`" in stale.stdout
    )
