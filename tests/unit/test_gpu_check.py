"""scripts/gpu_check.sh as a lent machine runs it, without a GPU: its exit status, and the
packages of a base interpreter that is itself a venv seen inside `.venv-gpu`.

Input: a copy of scripts/ in a temporary folder, an empty wheelhouse lock, interpreters on
PATH. Output: assertions on the exit status, steps.tsv and what `.venv-gpu` imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from tests.conftest import ROOT


def _check(tmp_path: Path, path_first: str, **env: str) -> subprocess.CompletedProcess[str]:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts", dirs_exist_ok=True)
    (tmp_path / "wheelhouse").mkdir(exist_ok=True)
    (tmp_path / "wheelhouse" / "requirements.lock").write_text("# nothing locked\n")
    full = {
        **os.environ,
        "PATH": f"{path_first}:{os.environ['PATH']}",
        "GPU_CHECK_OUT": str(tmp_path / "out"),
        "GPU_CHECK_TESTS": "0",
        "GPU_CHECK_QUICKSTART": "0",
        "GPU_CHECK_INSTALL_TIMEOUT": "120",
        **env,
    }
    return subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gpu_check.sh")],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _steps(tmp_path: Path) -> dict[str, str]:
    rows = (tmp_path / "out" / "steps.tsv").read_text().splitlines()
    return {row.split("\t")[0]: row.split("\t")[1] for row in rows}


def test_the_exit_status_is_0_when_every_step_that_ran_passed(tmp_path: Path):
    done = _check(tmp_path, str(Path(sys.executable).parent), GPU_CHECK_PYTHON=sys.executable)
    assert _steps(tmp_path) == {
        "install": "skipped",
        "machine": "ok",
        "gpu-tests": "skipped",
        "quickstart": "skipped",
        "gemma3": "skipped",  # no models/gemma-3-270m-q4_k_m.gguf in the copy
    }
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_failed_install_fails_the_check_and_the_base_venvs_packages_are_seen(tmp_path: Path):
    base = tmp_path / "base"
    venv.create(base, with_pip=False)
    site = subprocess.run(
        [
            str(base / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "marker_of_the_base_venv.py").write_text("X = 1\n")
    done = _check(tmp_path, str(base / "bin"))
    # nothing locked, no setuptools in the wheelhouse: the install fails, and so does the check
    assert _steps(tmp_path)["install"] == "failed"
    assert done.returncode == 1, done.stdout + done.stderr
    seen = subprocess.run(
        [str(tmp_path / ".venv-gpu" / "bin" / "python"), "-c", "import marker_of_the_base_venv"],
        capture_output=True,
        text=True,
    )
    assert seen.returncode == 0, seen.stderr
