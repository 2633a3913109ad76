"""A stage kind from another distribution, found through the `pipe.stages` entry point.

A throwaway distribution is built and installed with pip into a temporary folder; its kind
has a check and a derived value of its own. `pipe stages`, `pipe validate`, `pipe plan
--explain` and `pipe run` see it, with no edit to the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

PLUGIN = '''
"""echo: a plugin kind that writes its message, louder when repeated often."""

from pydantic import Field

from engine.stage import Derived, ResolveContext, StageConfig, stage


class EchoConfig(StageConfig):
    """Write a message some number of times."""

    OUTPUTS = ("output",)
    INPUT_OPTIONAL = True

    message: str = Field("hello", description="What to write.")
    repeats: int = Field(1, gt=0, description="How many times.")
    shout: bool = Field(False, description="Upper-case the message.")
    output: str = Field("echo.txt", description="File written.")

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        return {"shout": Derived(True, "repeats > 2")} if self.repeats > 2 else {}

    def check(self, ctx: ResolveContext):
        if self.repeats > 10:
            return [ctx.error("repeats", f"{self.repeats} repeats is too many; use at most 10")]
        return []


stage("echo", config=EchoConfig, run="pipe_echo.run:echo")
'''

BODY = """
def echo(cfg, ctx):
    text = cfg.message.upper() if cfg.shout else cfg.message
    with open(cfg.output, "w") as f:
        f.write((text + "\\n") * cfg.repeats)
    return {"lines": cfg.repeats}
"""

SETUP = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "pipe-echo"
version = "0.1"

[project.entry-points."pipe.stages"]
echo = "pipe_echo"

[tool.setuptools]
packages = ["pipe_echo"]
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    (src / "pipe_echo").mkdir()
    (src / "pipe_echo" / "__init__.py").write_text(PLUGIN)
    (src / "pipe_echo" / "run.py").write_text(BODY)
    (src / "pyproject.toml").write_text(SETUP)
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    return target


def pipe(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def write(tmp_path: Path, repeats: int) -> None:
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            f"""\
            name: p
            cluster: {{workers: 1}}
            stages:
              e:
                kind: echo
                config:
                  message: hi
                  repeats: {repeats}
            """
        )
    )


def test_a_plugin_kind_is_listed_checked_derived_and_run(site: Path, tmp_path: Path):
    listed = pipe(site, tmp_path, "stages")
    assert listed.returncode == 0, listed.stderr
    assert (
        "echo       pipe_echo                Write a message some number of times." in listed.stdout
    )

    write(tmp_path, 11)
    bad = pipe(site, tmp_path, "validate", "p.yaml")
    assert bad.returncode == 2
    assert bad.stderr == (
        "p.yaml:8:16: stages.e.config.repeats: 11 repeats is too many; use at most 10\n"
    )

    write(tmp_path, 3)
    explained = pipe(site, tmp_path, "plan", "p.yaml", "--explain")
    assert explained.returncode == 0, explained.stderr
    assert "  shout    true  <- rule: repeats > 2\n" in explained.stdout

    ran = pipe(site, tmp_path, "run", "p.yaml")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert (tmp_path / "runs/p/e/echo.txt").read_text() == "HI\n" * 3
    report = json.loads((tmp_path / "runs/p/report.json").read_text())
    metrics = report["stages"]["e"]["metrics"]
    assert metrics["lines"] == 3 and set(metrics) == {"lines", "usage"}  # what it used, added


def test_a_kind_missing_on_the_worker_fails_its_stage_instead_of_hanging(
    site: Path, tmp_path: Path
):
    from tests.cluster import SimWorker, dask_cluster

    write(tmp_path, 1)
    with dask_cluster([SimWorker()], tmp_path) as address:  # the worker lacks pipe_echo
        ran = pipe(site, tmp_path, "run", "p.yaml", "--scheduler", address)
    assert ran.returncode == 1, ran.stderr[-2000:]
    record = json.loads((tmp_path / "runs/p/report.json").read_text())["stages"]["e"]
    assert record["status"] == "failed"
    assert record["error"].startswith(
        "RuntimeError: the stage cannot be loaded on tcp://127.0.0.1:"
    )
    assert "ModuleNotFoundError: No module named 'pipe_echo'" in record["error"]
