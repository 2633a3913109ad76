"""scripts/wheelhouse.py without the network: what a freeze and --target-has leave out, the
profiles, the file chosen of each package, the checks on a wheel built here, and a whole build
and hash-checked install from a tiny index served on localhost, with the real uv and pip.

Input: small freezes, pylock entries, and wheels and sdists written here. Output: assertions."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import io
import subprocess
import tarfile
import threading
import venv
import zipfile

import pytest
import tomllib

from tests.conftest import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wh = _load()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

FREEZE = """\
# a target's pip freeze
torch==2.11.0+cu130
transformers==5.17.0
Numpy==2.3.1
-e git+https://example.org/x.git@abc#egg=local_thing
some.pkg @ file:///tmp/some_pkg-1.0-py3-none-any.whl
--extra-index-url https://example.org
"""


def test_a_freeze_leaves_out_exactly_what_it_pins():
    pins = wh.read_freeze(FREEZE)
    assert pins == {
        "torch": "2.11.0+cu130",
        "transformers": "5.17.0",
        "numpy": "2.3.1",
        "local-thing": None,
        "some-pkg": None,
    }
    has = wh.has_matcher(pins)
    assert has("Torch") and has("numpy") and has("some_pkg") and has("local-thing")
    assert not has("pydantic") and not has("nvidia-cublas-cu12") and not has("triton")
    # what an index holds constrains uv; what none builds (a CUDA torch, a local checkout) is
    # taken out of its graph, with what only it needs
    assert wh.public_pins(pins) == {"transformers": "5.17.0", "numpy": "2.3.1"}
    assert wh.removals(pins, wh.TARGET_HAS) == {"torch", "local-thing", "some-pkg"}


def test_by_default_torch_triton_and_the_cuda_libraries_are_left_out():
    has = wh.has_matcher(wh.TARGET_HAS)
    assert has("torch") and has("triton") and has("nvidia-cublas-cu12") and has("nvidia_nccl_cu12")
    assert not has("torchvision") and not has("transformers") and not has("numpy")
    assert wh.removals(None, wh.TARGET_HAS) == {"torch", "triton"}  # nvidia-* once uv names them
    more = wh.has_matcher(["torch", "transformers"])
    assert more("transformers") and not more("nvidia-cublas-cu12")


def test_the_profiles():
    def names(profile):
        return {wh.req_name(r) for r in wh.profile_requirements(PYPROJECT, profile)}

    gpu = names("gpu")
    assert {"pydantic", "dask", "deepspeed", "transformers", "reasoning-gym", "math-verify"} <= gpu
    assert {"pytest", "pytest-timeout", "matplotlib", "torch"} <= gpu  # torch: left out later
    assert not gpu & {"ruff", "mypy", "tensorboard", "wandb", "bokeh", "hypothesis", "pyarrow"}
    full = names("full")
    assert {"ruff", "mypy", "tensorboard", "pyarrow", "hypothesis", "uv"} <= full
    assert "deepspeed" not in names("base") and "ruamel-yaml-clib" in names("base")
    with pytest.raises(ValueError, match="unknown profile 'tiny'; one of gpu, full, base"):
        wh.profile_requirements(PYPROJECT, "tiny")


def test_the_file_the_target_installs_is_the_one_uv_chose():
    def entry(file):
        return {"url": f"https://files.example/{file}", "hashes": {"sha256": file[:3] * 8}}

    fonttools = {
        "name": "FontTools",
        "version": "4.68.0",
        "sdist": entry("fonttools-4.68.0.tar.gz"),
        "wheels": [
            entry("fonttools-4.68.0-py3-none-any.whl"),
            entry("fonttools-4.68.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"),
        ],
    }
    assert wh.chosen(fonttools) == {
        "name": "fonttools",
        "version": "4.68.0",
        "url": "https://files.example/fonttools-4.68.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "sha256": "fonfonfonfonfonfonfonfon",
        "file": "fonttools-4.68.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    }
    pycosat = {"name": "pycosat", "version": "0.6.6", "sdist": entry("pycosat-0.6.6.tar.gz")}
    assert wh.chosen(pycosat)["file"] == "pycosat-0.6.6.tar.gz"
    assert wh.uv_platform("manylinux_2_28_x86_64") == "x86_64-manylinux_2_28"
    assert wh.uv_platform("manylinux2014_aarch64") == "aarch64-manylinux2014"
    with pytest.raises(SystemExit, match="expected a manylinux tag"):
        wh.uv_platform("win_amd64")


def _zip(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_a_wheel_built_here_must_suit_the_target(tmp_path):
    so = {
        "x.cpython-312-x86_64-linux-gnu.so": b"\0GLIBC_2.2.5\0GLIBC_2.34\0",
        "x/r.txt": b"GLIBC_2.99",
    }
    wheel = _zip(tmp_path / "x-1-cp312-cp312-linux_x86_64.whl", so)
    assert wh.glibc_needed(wheel) == 34
    wh.check_built(wheel, "3.12", "manylinux_2_34_x86_64")
    with pytest.raises(SystemExit, match=r"needs glibc 2\.34, newer than manylinux_2_28_x86_64"):
        wh.check_built(wheel, "3.12", "manylinux_2_28_x86_64")
    with pytest.raises(SystemExit, match=r"compiled for another Python than 3\.11; pass --build"):
        wh.check_built(wheel, "3.11", "manylinux_2_34_x86_64")
    wh.check_built(_zip(tmp_path / "y-1-py3-none-any.whl", {}), "3.11", "manylinux_2_5_x86_64")


def test_the_install_checks_every_hash_and_adds_no_package_to_the_project(tmp_path):
    steps = dict(wh.install_steps("py", tmp_path, tmp_path / "tools.lock", ["-e", "."]))
    assert list(steps) == ["build tools", "locked packages", "the project"]
    for name in ("build tools", "locked packages"):
        assert {"--no-index", "--require-hashes", "--find-links"} <= set(steps[name])
    assert steps["locked packages"][-2:] == ["-r", str(tmp_path / "requirements.lock")]
    assert "--find-links" not in steps["the project"] and "--no-index" in steps["the project"]
    with pytest.raises(ValueError, match="more than one file of a"):
        wh.lock_text([("a", "1", tmp_path / "tools.lock"), ("a", "2", tmp_path / "tools.lock")])


# --- a whole build and install, from a tiny index on localhost ---------------------------------

BACKEND = """\
import os, zipfile
DIST = {dist!r}
FILES = {{
    DIST + ".dist-info/METADATA": "Metadata-Version: 2.1\\nName: {name}\\nVersion: 1.0\\n",
    DIST + ".dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    DIST + ".dist-info/RECORD": "",
}}
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with zipfile.ZipFile(os.path.join(wheel_directory, DIST + "-py3-none-any.whl"), "w") as z:
        for path, text in FILES.items():
            z.writestr(path, text)
    return DIST + "-py3-none-any.whl"
"""


def _wheel(index, name, requires=()):
    """A pure wheel of `name` 1.0 in index/<name>/, needing `requires`."""
    dist = f"{name.replace('-', '_')}-1.0"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel = "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    info = f"{dist}.dist-info"
    files = {f"{info}/METADATA": meta, f"{info}/WHEEL": wheel, f"{info}/RECORD": ""}
    (index / name).mkdir(parents=True)
    _zip(index / name / f"{dist}-py3-none-any.whl", files)


def _sdist(index, name):
    """An sdist of `name` 1.0 (no wheel) in index/<name>/, built by an in-tree backend that
    needs nothing from an index."""
    dist = f"{name.replace('-', '_')}-1.0"
    files = {
        "PKG-INFO": f"Metadata-Version: 2.2\nName: {name}\nVersion: 1.0\n",
        "pyproject.toml": (
            f'[project]\nname = "{name}"\nversion = "1.0"\ndependencies = []\n'
            '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        ),
        "backend.py": BACKEND.format(dist=dist, name=name),
    }
    (index / name).mkdir(parents=True)
    with tarfile.open(index / name / f"{dist}.tar.gz", "w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(f"{dist}/{path}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A simple index on localhost, and a project that needs app, torchy, built-here and
    kept-sdist: app needs torchy, nvidia-lib and shared; torchy alone needs
    torchy-only, nvidia-lib alone needs cudart; built-here and kept-sdist ship sdists only."""
    root = tmp_path / "index"
    _wheel(root, "app", ["torchy", "nvidia-lib", "shared>=1"])
    _wheel(root, "torchy", ["shared", "torchy-only"])
    _wheel(root, "nvidia-lib", ["cudart"])
    for name in ("shared", "torchy-only", "cudart"):
        _wheel(root, name)
    for name in ("built-here", "kept-sdist"):
        _sdist(root, name)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("UV_DEFAULT_INDEX", f"http://127.0.0.1:{server.server_port}/")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_NO_CONFIG", "1")
    project = tmp_path / "project"
    project.mkdir()
    deps = '["app", "torchy>=1", "built-here", "kept-sdist"]'
    (project / "pyproject.toml").write_text(f'[project]\nname = "p"\ndependencies = {deps}\n')
    monkeypatch.setattr(wh, "ROOT", project)
    monkeypatch.setattr(wh, "BUILD_TOOLS", ())
    monkeypatch.setattr(wh, "SDIST_KEPT", ("kept-sdist",))
    yield root
    server.shutdown()


def _lock(house):
    lines = (house / "requirements.lock").read_text().splitlines()
    return [ln for ln in lines if not ln.startswith("#")], [ln for ln in lines if ln[:1] == "#"]


@pytest.mark.slow
def test_a_build_locks_each_file_by_hash_and_the_install_checks_them(index, tmp_path):
    house = tmp_path / "house"
    target = ["--platform", "manylinux_2_28_x86_64", "--target-has", "torchy", "nvidia-*"]
    assert wh.main(["build", "--profile", "base", "--out", str(house), *target]) == 0
    pins, header = _lock(house)
    # torchy and nvidia-lib are the target's, and so is what only they need
    names = [p.split("==")[0] for p in pins]
    assert names == ["app", "built-here", "kept-sdist", "shared"]
    files = {p.name: wh.sha256(p) for p in house.iterdir() if p.name != "requirements.lock"}
    assert sorted(files) == [
        "app-1.0-py3-none-any.whl", "built_here-1.0-py3-none-any.whl", "kept_sdist-1.0.tar.gz",
        "shared-1.0-py3-none-any.whl",
    ]  # fmt: skip
    assert sorted(p.split("sha256:")[1] for p in pins) == sorted(files.values())
    # the index's hash for what was fetched, the file's own for the wheel built here
    index_sdist = wh.sha256(index / "built-here" / "built_here-1.0.tar.gz")
    assert f"#   built-here 1.0 from built_here-1.0.tar.gz sha256:{index_sdist}" in header
    assert (
        wh.sha256(index / "app" / "app-1.0-py3-none-any.whl") == files["app-1.0-py3-none-any.whl"]
    )

    # the target: a fresh venv that has torchy and nvidia-lib, and what they need
    env = tmp_path / "target"
    venv.EnvBuilder(with_pip=True).create(env)
    python = str(env / "bin" / "python")
    has = [
        str(next((index / n).glob("*.whl")))
        for n in ("torchy", "torchy-only", "nvidia-lib", "cudart")
    ]
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *has], check=True
    )
    assert wh.main(["install", "--python", python, "--wheelhouse", str(house)]) == 0
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "freeze"], capture_output=True, text=True
    )
    assert {"app==1.0", "built-here==1.0", "kept-sdist==1.0", "shared==1.0"} <= set(
        listed.stdout.split()
    )

    # a valid wheel of the same name and version, changed on the way to the target
    with zipfile.ZipFile(house / "shared-1.0-py3-none-any.whl", "a") as z:
        z.writestr("shared_extra.py", "print('not what was locked')\n")
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "shared"], check=True)
    with pytest.raises(SystemExit, match="DO NOT MATCH THE HASHES"):
        wh.main(["install", "--python", python, "--wheelhouse", str(house)])


@pytest.mark.slow
def test_a_freeze_pin_the_roots_cannot_use_fails_the_build(index, tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torchy==1.0+cu130\nshared==0.5\n")
    args = ["build", "--profile", "base", "--out", str(tmp_path / "house")]
    with pytest.raises(
        SystemExit,
        match=r"(?s)No solution found when resolving.*app depend on shared>=1 and shared==0\.5",
    ):
        wh.main([*args, "--platform", "manylinux_2_28_x86_64", "--target-freeze", str(freeze)])
