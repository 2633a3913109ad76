"""`make wheelhouse` and the offline install from it, on this machine's Python.

Input: the registries (for the build only) and this checkout. Output: a wheelhouse of the
`base` profile (the project's own dependencies) built into tmp, each file locked by its hash,
installed into a fresh venv with every network route refused and every hash checked, the
project installed from a copy of the checkout, and `pipe validate` run there."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REFUSED = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/",
    "https_proxy": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "PIP_CONFIG_FILE": os.devnull,  # no configured find-links or local index either
}


def _run(*cmd, env=None, cwd=None):
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    return done


def test_a_wheelhouse_installs_the_project_offline(tmp_path):
    house = tmp_path / "wheelhouse"
    script = str(ROOT / "scripts" / "wheelhouse.py")
    built = _run(sys.executable, script, "build", "--profile", "base", "--out", str(house))
    assert built.returncode == 0, built.stderr[-3000:]
    lock = (house / "requirements.lock").read_text().splitlines()
    pins = [ln for ln in lock if ln and not ln.startswith("#")]
    names = [p.split("==")[0] for p in pins]
    assert len(names) == len(set(names))
    assert {"pydantic", "dask", "distributed", "ruamel-yaml", "setuptools", "wheel"} <= set(names)
    assert not {"torch", "triton", "deepspeed"} & set(names)
    files = [p for p in house.iterdir() if p.name != "requirements.lock"]
    assert len(files) == len(pins)
    # each line locks one file by its sha256, which the offline install checks
    hashes = {hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert {p.split(" --hash=sha256:")[1] for p in pins} == hashes

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    offline = {
        k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"
    }
    offline.update(REFUSED)
    # the routes are closed: a package from nowhere but the index fails to install
    probe = _run(
        python, "-m", "pip", "install", "--retries", "0", "--timeout", "2", "six", env=offline
    )
    assert probe.returncode != 0

    project = tmp_path / "checkout"
    project.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / part, project / part)
    for part in ("engine", "stages"):
        shutil.copytree(ROOT / part, project / part, ignore=shutil.ignore_patterns("__pycache__"))
    installed = _run(
        sys.executable, script, "install", "--python", python, "--wheelhouse", str(house),
        "--project", str(project), env=offline,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]

    imports = "import engine, pydantic, ruamel.yaml, dask, distributed; print(engine.__file__)"
    where = _run(python, "-c", imports, env=offline, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(env_dir))
    pipe = str(env_dir / "bin" / "pipe")
    checked = _run(
        pipe, "validate", str(ROOT / "pipelines" / "quickstart.yaml"), env=offline, cwd=tmp_path
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
