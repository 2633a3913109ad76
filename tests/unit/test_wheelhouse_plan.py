"""scripts/wheelhouse.py's plan without the network: what a freeze leaves out, what only torch
needs, the profiles, the platform tags, pip's errors read, and the lock (one version each).

Input: small freezes, pip reports and file lists written here. Output: assertions."""

from __future__ import annotations

import importlib.util
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
    out = wh.exclusion(pins)
    assert out("Torch") and out("numpy") and out("some_pkg") and out("local-thing")
    assert not out("pydantic") and not out("nvidia-cublas-cu12") and not out("triton")


def test_by_default_torch_triton_and_the_cuda_libraries_are_left_out():
    out = wh.exclusion(None)
    assert out("torch") and out("triton") and out("nvidia-cublas-cu12") and out("nvidia_nccl_cu12")
    assert not out("torchvision") and not out("transformers") and not out("numpy")
    more = wh.exclusion(None, ["torch", "transformers"])
    assert more("transformers") and not more("nvidia-cublas-cu12")


def _item(name, version, requires=(), extras=None):
    item = {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}
    if extras is not None:
        item["requested_extras"] = extras
    return item


REPORT = {
    "install": [
        _item("math-verify", "0.9", ["latex2sympy2_extended"]),
        _item("latex2sympy2_extended", "1.1", ["sympy"]),
        _item("sympy", "1.14", ["mpmath"]),
        _item("mpmath", "1.3"),
        _item("deepspeed-dep", "1", ["torch>=2", "einops"]),
        _item("einops", "0.8"),
        _item(
            "torch",
            "2.13.0",
            ["sympy", "networkx", "nvidia-cublas-cu12; platform_system == 'Linux'"],
        ),
        _item("networkx", "3.5"),
        _item("nvidia-cublas-cu12", "12.1"),
        _item("triton", "3.0", ["filelock"]),
        _item("filelock", "3.0"),
        _item("colorama-user", "1", ["colorama; sys_platform == 'win32'"]),
        _item("colorama", "0.4"),
        _item("with-extra", "1", ["rich; extra == 'pretty'"]),
        _item("rich", "13"),
    ]
}


def test_what_only_torch_needs_is_left_out_with_it():
    env = wh.marker_env("3.12", "manylinux_2_28_x86_64")
    versions, needs = wh.dependency_graph(REPORT, env)
    assert versions["latex2sympy2-extended"] == "1.1"
    assert needs["colorama-user"] == set()  # its only dependency is for Windows
    assert needs["with-extra"] == {"rich"}  # an extra's edge is kept: one too many is safe
    roots = ["math-verify", "deepspeed-dep", "torch", "colorama-user"]
    kept = wh.kept(roots, needs, wh.exclusion(None))
    assert kept == {
        "math-verify", "latex2sympy2-extended", "sympy", "mpmath", "deepspeed-dep", "einops",
        "colorama-user",
    }  # fmt: skip
    # networkx, filelock, nvidia-*: only torch and triton need them
    alone = wh.kept(["deepspeed-dep"], needs, wh.exclusion(None))
    assert alone == {"deepspeed-dep", "einops"}
    pinned = wh.kept(roots, needs, wh.exclusion({"sympy": "1.14"}))
    assert "sympy" not in pinned and "mpmath" not in pinned and "networkx" in pinned


def test_the_profiles():
    def names(profile, only=()):
        reqs = wh.drop_excluded(
            wh.profile_requirements(PYPROJECT, profile, only), wh.exclusion(None)
        )
        return {wh.canonical(wh.Requirement(r).name) for r in reqs}

    gpu = names("gpu")
    assert {"pydantic", "dask", "deepspeed", "transformers", "reasoning-gym", "math-verify"} <= gpu
    assert {"pytest", "pytest-timeout", "matplotlib"} <= gpu
    assert not gpu & {
        "torch",
        "ruff",
        "mypy",
        "tensorboard",
        "wandb",
        "bokeh",
        "hypothesis",
        "pyarrow",
    }
    full = names("full")
    assert {"ruff", "mypy", "tensorboard", "pyarrow", "hypothesis"} <= full and "torch" not in full
    assert "deepspeed" not in names("base") and "dask" in names("base")
    assert wh.profile_requirements(PYPROJECT, "gpu", ["Pydantic", "einops"]) == [
        "pydantic>=2.6",
        "einops",
    ]
    with pytest.raises(ValueError, match="unknown profile"):
        wh.profile_requirements(PYPROJECT, "tiny")


def test_a_manylinux_platform_takes_every_older_tag():
    tags = wh.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "linux_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert wh.platform_tags("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    args = wh.target_args("3.12", "manylinux_2_28_x86_64")
    assert args[:5] == ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    assert args.count("--platform") == len(tags)


def test_the_packages_pip_found_no_wheel_for():
    single = "ERROR: No matching distribution found for pycosat==0.6.6\n"
    assert wh.missing_wheels(single) == ["pycosat==0.6.6"]
    conflict = (
        "The conflict is caused by:\n"
        "    reasoning-gym 0.1.25 depends on cellpylib==2.4.0\n"
        "    reasoning-gym 0.1.24 depends on cellpylib==2.4.0\n\n"
        "Additionally, some packages in these conflicts have no matching distributions "
        "available for your environment:\n    cellpylib\n\nTo fix this you could try to:\n"
    )
    assert wh.missing_wheels(conflict) == ["cellpylib==2.4.0"]
    assert wh.missing_wheels("ERROR: ResolutionImpossible") == []


def test_the_lock_holds_one_version_of_each_file():
    files = [
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "ruamel_yaml-0.19.1-py3-none-any.whl",
        "deepspeed-0.19.8.tar.gz",
        "py-cpuinfo-9.0.0.tar.gz",
        "requirements.lock",
    ]
    text = wh.lock_text(files, "# header\n")
    assert text == (
        "# header\ndeepspeed==0.19.8\npy-cpuinfo==9.0.0\npydantic-core==2.50.5\nruamel-yaml==0.19.1\n"
    )
    with pytest.raises(ValueError, match="more than one version"):
        wh.lock_text([*files, "ruamel_yaml-0.18.0-py3-none-any.whl"])


def test_an_earlier_build_leaves_no_second_version(tmp_path):
    for name in ("a-1.0-py3-none-any.whl", "a-2.0-py3-none-any.whl", "b-1.0-py3-none-any.whl",
                 "c-1.tar.gz", "notes.txt"):  # fmt: skip
        (tmp_path / name).write_text("x")
    wh.prune(tmp_path, {"a": "2.0", "c": "1"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-2.0-py3-none-any.whl", "c-1.tar.gz", "notes.txt",
    ]  # fmt: skip
    lock = wh.write_lock(tmp_path)
    assert lock.read_text() == "a==2.0\nc==1\n"


def test_the_newest_glibc_a_built_wheel_asks_for(tmp_path):
    wheel = tmp_path / "x-1-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("x.cpython-312-x86_64-linux-gnu.so", b"\0GLIBC_2.2.5\0GLIBC_2.14\0GLIBC_2.3\0")
        z.writestr("x/readme.txt", b"GLIBC_2.99")
    assert wh.glibc_needed(wheel) == 14
