"""Build a wheelhouse for an offline machine, and install from one.

Input: the project's pyproject.toml, a profile (`gpu`: what `pytest -m gpu` and the GRPO
quickstart need; `full`: base + train + tasks + dev + tracking; `base`: the project's own
dependencies), a target Python version and platform (defaults: this machine's), and
optionally a `pip freeze` of the target (`--target-freeze`). Output: `wheelhouse/` holding
one wheel per package (one version each), DeepSpeed's sdist beside them, and
`wheelhouse/requirements.lock` (`name==version` for every file). What the target already
has is left out: exactly what its freeze pins, or by default torch, triton, the nvidia-*
CUDA libraries and whatever only they need.

    python scripts/wheelhouse.py build [--python-version 3.12] [--platform manylinux_2_28_x86_64]
    python scripts/wheelhouse.py install --python .venv-gpu/bin/python [--project . --editable]

Only the standard library and pip are needed (pip's vendored `packaging` stands in when
`packaging` is not installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from email.parser import HeaderParser
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

log = logging.getLogger("wheelhouse")

ROOT = Path(__file__).resolve().parent.parent
LOCK = "requirements.lock"
CARRY_LIMIT = 64 * 2**20  # what one device call carries of ignored paths
# left out by default: the target has a CUDA build of torch with its own libraries
DEFAULT_EXCLUDED = ("torch", "triton", "nvidia-*")
# always in the wheelhouse: the --no-build-isolation builds (DeepSpeed's sdist, the project)
BUILD_TOOLS = ("setuptools>=68", "wheel")
SDIST_ONLY = ("deepspeed",)  # ships no wheel: its sdist goes beside the wheels
# what `pytest -m gpu` and the GRPO quickstart import beyond base + train + tasks
GPU_DEV = ("pytest", "pytest-timeout")
GPU_SKIP = ("pyarrow",)  # only the `parquet` dataset source reads it
PROFILES = ("gpu", "full", "base")


def canonical(name: str) -> str:
    """PEP 503's normalized name: `ruamel.yaml.clib` -> `ruamel-yaml-clib`."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- what to fetch -----------------------------------------------------------------------------


def profile_requirements(pyproject: dict, profile: str, only: Iterable[str] = ()) -> list[str]:
    """The root requirements of a profile, as written in pyproject.toml. With `only`, just the
    requirements of those names (as pyproject writes them, else the name as given)."""
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    every = list(project["dependencies"])
    for group in ("train", "tasks", "dev", "tracking"):
        every += extras.get(group, [])
    only = [canonical(n) for n in only]
    if only:
        written = {canonical(Requirement(r).name): r for r in every}
        return [written.get(n, n) for n in only]
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
    reqs = list(project["dependencies"])
    if profile == "full":
        for group in ("train", "tasks", "dev", "tracking"):
            reqs += extras.get(group, [])
    elif profile == "gpu":
        reqs += extras.get("train", []) + extras.get("tasks", [])
        reqs += [r for r in extras.get("dev", []) if canonical(Requirement(r).name) in GPU_DEV]
        reqs = [r for r in reqs if canonical(Requirement(r).name) not in GPU_SKIP]
    return reqs


def read_freeze(text: str) -> dict[str, str | None]:
    """Name -> pinned version (None for `name @ url` and editable lines) of a `pip freeze`."""
    pins: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("-e"):
            egg = re.search(r"#egg=([A-Za-z0-9_.\-]+)", line)
            if egg:
                pins[canonical(egg.group(1))] = None
        elif not line or line.startswith(("#", "-")):
            continue
        elif " @ " in line:
            pins[canonical(line.split(" @ ", 1)[0])] = None
        elif "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.split(";")[0].split(" #")[0].strip()
    return pins


def exclusion(
    freeze: dict[str, str | None] | None, has: Iterable[str] = DEFAULT_EXCLUDED
) -> Callable[[str], bool]:
    """Whether a package is left out: pinned by the target's freeze, else named by `has`
    (names, or prefixes ending in `*`; by default torch, triton and nvidia-*)."""
    if freeze is not None:
        names = set(freeze)
        return lambda name: canonical(name) in names
    patterns = [canonical(p[:-1]) + "*" if p.endswith("*") else canonical(p) for p in has]

    def named(name: str) -> bool:
        n = canonical(name)
        return any(n == p or (p.endswith("*") and n.startswith(p[:-1])) for p in patterns)

    return named


def drop_excluded(reqs: Iterable[str], excluded: Callable[[str], bool]) -> list[str]:
    """The requirements whose package the target does not already have."""
    return [r for r in reqs if not excluded(Requirement(r).name)]


def marker_env(python_version: str, plat: str) -> dict[str, str]:
    """PEP 508 marker variables of the target (a Linux CPython by its platform tag)."""
    machine = plat.split("_", 3)[-1] if plat.startswith("manylinux_") else plat.split("_", 1)[-1]
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "implementation_version": f"{python_version}.0",
        "extra": "",
    }


def applies(marker: Marker | None, env: dict[str, str], extras: Iterable[str]) -> bool:
    """Whether a dependency's marker holds on the target for any of the requested extras.
    A marker that names an extra counts as holding: one edge too many keeps a package,
    one too few would leave a needed one out."""
    if marker is None:
        return True
    if "extra" in str(marker):
        return True
    return any(marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def dependency_graph(
    report: dict, env: dict[str, str]
) -> tuple[dict[str, str], dict[str, set[str]]]:
    """From pip's install report: name -> version, and name -> the resolved names it needs."""
    versions = {
        canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]
    }
    needs: dict[str, set[str]] = {}
    for item in report["install"]:
        name = canonical(item["metadata"]["name"])
        extras = item.get("requested_extras") or []
        deps = set()
        for spec in item["metadata"].get("requires_dist") or []:
            req = Requirement(spec)
            dep = canonical(req.name)
            if dep in versions and dep != name and applies(req.marker, env, extras):
                deps.add(dep)
        needs[name] = deps
    return versions, needs


def kept(
    roots: Iterable[str], needs: dict[str, set[str]], excluded: Callable[[str], bool]
) -> set[str]:
    """What the roots need, never walking through a left-out package: what only torch needs
    (sympy for torch alone, say) is left out with it."""
    seen: set[str] = set()
    todo = [canonical(r) for r in roots if not excluded(r)]
    while todo:
        name = todo.pop()
        if name in seen or excluded(name):
            continue
        seen.add(name)
        todo += sorted(needs.get(name, ()))
    return seen


# --- the platform ------------------------------------------------------------------------------


def this_platform() -> str:
    """This machine's manylinux tag, e.g. `manylinux_2_36_x86_64`."""
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        raise SystemExit("no glibc here: pass --platform (e.g. manylinux_2_28_x86_64)")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def platform_tags(plat: str) -> list[str]:
    """Every platform tag a manylinux_2_N machine installs, newest first (pip does not expand
    `manylinux_2_28` to the older tags by itself): manylinux_2_N ... manylinux_2_5 and the
    legacy aliases manylinux2014 (2_17), manylinux2010 (2_12), manylinux1 (2_5), and last
    `linux_ARCH`: PyPI holds none, so it matches only the wheels built here (`build_wheel`)."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", plat)
    legacy = re.fullmatch(r"manylinux(2014|2010|1)_(\w+)", plat)
    if legacy:
        glibc = {"2014": 17, "2010": 12, "1": 5}[legacy.group(1)]
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", f"manylinux_2_{glibc}_{legacy.group(2)}")
    if not m or m.group(1) != "2":
        return [plat]
    top, arch = int(m.group(2)), m.group(3)
    tags = []
    for minor in range(top, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        alias = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(minor)
        if alias and (
            minor != 17 or arch in ("x86_64", "i686", "aarch64", "ppc64le", "s390x", "armv7l")
        ):
            tags.append(f"{alias}_{arch}")
    return [*tags, f"linux_{arch}"]


def target_args(python_version: str, plat: str) -> list[str]:
    """pip's flags that fetch wheels for another Python and platform."""
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for tag in platform_tags(plat):
        args += ["--platform", tag]
    return args


# --- the lock ----------------------------------------------------------------------------------


def name_version(filename: str) -> tuple[str, str] | None:
    """(canonical name, version) of a wheel's or sdist's file name; None for other files."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return (canonical(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip"):
        if filename.endswith(ext):
            name, _, version = filename[: -len(ext)].rpartition("-")
            return (canonical(name), version) if name else None
    return None


def lock_text(filenames: Iterable[str], header: str = "") -> str:
    """`name==version` for every package file, sorted; raises when a package has two versions."""
    found: dict[str, set[str]] = {}
    for f in filenames:
        nv = name_version(f)
        if nv:
            found.setdefault(nv[0], set()).add(nv[1])
    twice = {n: sorted(v) for n, v in found.items() if len(v) > 1}
    if twice:
        raise ValueError(f"more than one version in the wheelhouse: {twice}")
    lines = [f"{n}=={next(iter(v))}" for n, v in sorted(found.items())]
    return header + "\n".join(lines) + "\n"


def write_lock(wheelhouse: Path, header: str = "") -> Path:
    """Write `requirements.lock` from the files in the wheelhouse."""
    path = wheelhouse / LOCK
    path.write_text(lock_text(sorted(p.name for p in wheelhouse.iterdir()), header))
    return path


def stale(filename: str, expected: dict[str, str]) -> bool:
    """Whether a package file is not the expected version of an expected package."""
    nv = name_version(filename)
    if nv is None:
        return False
    return nv[0] not in expected or Version(nv[1]) != Version(expected[nv[0]])


def prune(wheelhouse: Path, expected: dict[str, str]) -> None:
    """Remove what an earlier build left that this one does not want: one version each."""
    for path in wheelhouse.iterdir():
        if stale(path.name, expected):
            log.info("removed %s (not in this build)", path.name)
            path.unlink()


def size_of(wheelhouse: Path) -> int:
    return sum(p.stat().st_size for p in wheelhouse.iterdir() if p.is_file())


# --- pip ---------------------------------------------------------------------------------------


def pip(*args: str, env: dict[str, str] | None = None, python: str = sys.executable) -> str:
    """Run pip; its output on failure, raised."""
    cmd = [python, "-m", "pip", *args]
    log.debug("%s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise PipError(done.stdout + done.stderr)
    return done.stdout


class PipError(RuntimeError):
    pass


def fetch_sdist(spec: str, dest: Path, constraints: list[str]) -> Path:
    """Download one package's sdist (no dependencies) into dest; its path."""
    before = set(dest.iterdir())
    pip("download", "-q", "--no-binary", ":all:", "--no-deps", "-d", str(dest), *constraints, spec)
    new = [p for p in dest.iterdir() if p not in before] or sorted(
        dest.glob(f"{canonical(Requirement(spec).name).replace('-', '?')}-*.tar.gz")
    )
    return new[-1]


def sdist_requirements(sdist: Path) -> list[str]:
    """The Requires-Dist of an sdist's PKG-INFO, those without an extra."""
    with tarfile.open(sdist) as tar:
        member = next(
            m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        )
        text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    reqs = HeaderParser().parsestr(text).get_all("Requires-Dist") or []
    return [r for r in reqs if "extra ==" not in r.replace("extra==", "extra ==")]


def interpreter_for(python_version: str) -> str | None:
    """A local interpreter of the target's Python version (on PATH, or pyenv's), or None."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == python_version:
        return sys.executable
    pyenv = sorted(
        Path.home().glob(f".pyenv/versions/{python_version}.*/bin/python{python_version}")
    )
    for candidate in [*map(str, reversed(pyenv)), shutil.which(f"python{python_version}")]:
        runs = candidate and subprocess.run([candidate, "-c", ""], capture_output=True)
        if runs and runs.returncode == 0:
            return candidate
    return None


def glibc_needed(wheel: Path) -> int:
    """The newest glibc 2.N its shared libraries ask for (0 when none)."""
    newest = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".so" in name.rsplit("/", 1)[-1]:
                for minor in re.findall(rb"GLIBC_2\.(\d+)", z.read(name)):
                    newest = max(newest, int(minor))
    return newest


def build_wheel(spec: str, dest: Path, python_version: str, plat: str) -> Path:
    """Build a wheel of a package that ships only an sdist: a pure one (tag none-any) with
    this Python, a compiled one with a local interpreter of the target's version, checked to
    ask for no newer glibc than the target's platform tag allows."""
    for python in dict.fromkeys([sys.executable, interpreter_for(python_version)]):
        if python is None:
            break
        before = set(dest.iterdir())
        pip(
            "wheel", "-q", "--no-deps", "--no-binary", ":all:", "-w", str(dest), spec, python=python
        )
        wheel = next(p for p in dest.iterdir() if p not in before)
        tag = f"cp{python_version.replace('.', '')}-"
        if wheel.name.endswith("-none-any.whl") or tag in wheel.name:
            break
        wheel.unlink()
    else:
        python = None
    if python is None:
        raise SystemExit(
            f"{spec} ships only an sdist with compiled code and no python{python_version} is "
            "here to build it: install one (pyenv) or build the wheel on the target"
        )
    allowed = re.match(r"manylinux_2_(\d+)_", platform_tags(plat)[0])
    if allowed and glibc_needed(wheel) > int(allowed.group(1)):
        raise SystemExit(f"{wheel.name} needs glibc 2.{glibc_needed(wheel)}, newer than {plat}")
    log.info("built %s from its sdist (no wheel on the index)", wheel.name)
    return wheel


def missing_wheels(pip_output: str) -> list[str]:
    """The requirements pip found no wheel for, from its error: `No matching distribution
    found for X==1`, or a conflict's `no matching distributions available for your
    environment:` list, each with the pin a dependent asked for (`A depends on X==1`)."""
    found = re.findall(r"No matching distribution found for (\S+)", pip_output)
    block = re.search(
        r"no matching distributions available for your environment:\n((?:[ \t]+\S+\n?)+)",
        pip_output,
    )
    asked = re.findall(r"depends on (\S+)", pip_output)
    for name in block.group(1).split() if block else []:
        specs = [a for a in asked if canonical(Requirement(a).name) == canonical(name)]
        found.append(specs[0] if specs else name)
    return list(dict.fromkeys(found))


def conflicting(pip_output: str) -> list[str]:
    """The pins a conflict names (`A depends on X==1`), once each."""
    return list(dict.fromkeys(re.findall(r"depends on (\S+)", pip_output)))


def no_wheel(specs: list[str], args: argparse.Namespace, built: Path) -> list[str]:
    """Those of the specs with no wheel for the target (older pips do not name them)."""
    missing = []
    with tempfile.TemporaryDirectory() as probe:
        for spec in specs:
            try:
                pip(
                    "download",
                    "-q",
                    "--no-deps",
                    "-d",
                    probe,
                    "--find-links",
                    str(built),
                    *target_args(args.python_version, args.platform),
                    spec,
                )
            except PipError as e:
                if "No matching distribution" in str(e):
                    missing.append(spec)
    return missing


def resolve(
    reqs: list[str], args: argparse.Namespace, constraints: list[str], built: Path, report: Path
) -> dict:
    """pip's resolution for the target, without installing. A dependency that ships only an
    sdist (pip cannot build one for another platform) is built here (`build_wheel`) and the
    resolution tried again."""
    for _ in range(20):
        try:
            pip(
                "install",
                "--dry-run",
                "--ignore-installed",
                "--target",  # older pips take --platform with --dry-run only so
                str(report.parent / "target"),
                "--report",
                str(report),
                *target_args(args.python_version, args.platform),
                "--find-links",
                str(built),
                *constraints,
                *reqs,
            )
            return json.loads(report.read_text())
        except PipError as e:
            have = {name_version(p.name)[0] for p in built.iterdir()}  # type: ignore[index]
            todo = missing_wheels(str(e)) or no_wheel(conflicting(str(e)), args, built)
            todo = [m for m in todo if canonical(Requirement(m).name) not in have]
            if not todo:
                raise
            for spec in todo:
                build_wheel(spec, built, args.python_version, args.platform)
    raise SystemExit("gave up: too many sdist-only dependencies")


# --- build -------------------------------------------------------------------------------------


def left_out(args: argparse.Namespace) -> str:
    if args.target_freeze:
        return f"what {args.target_freeze} pins"
    return f"{', '.join(args.target_has)} and what only they need"


def build(args: argparse.Namespace) -> int:
    """Resolve, download and lock the wheelhouse; print its size."""
    start = time.monotonic()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    freeze = read_freeze(Path(args.target_freeze).read_text()) if args.target_freeze else None
    excluded = exclusion(freeze, args.target_has)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = drop_excluded(profile_requirements(pyproject, args.profile, args.only), excluded)
    reqs += list(BUILD_TOOLS)
    constraints: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="wheelhouse-"))
    built = work / "built"
    built.mkdir()
    if freeze:
        pinned = work / "constraints.txt"
        pinned.write_text("".join(f"{n}=={v}\n" for n, v in freeze.items() if v and "+" not in v))
        constraints = ["-c", str(pinned)]
    sdists = []
    for name in SDIST_ONLY:
        wanted = [r for r in reqs if canonical(Requirement(r).name) == name]
        if not wanted:
            continue
        reqs.remove(wanted[0])
        sdists.append(fetch_sdist(wanted[0], work, constraints))
        reqs += drop_excluded(sdist_requirements(sdists[-1]), excluded)
        log.info("%s: its dependencies resolved as wheels", sdists[-1].name)
    target = target_args(args.python_version, args.platform)
    report = resolve(reqs, args, constraints, built, work / "report.json")
    versions, needs = dependency_graph(report, marker_env(args.python_version, args.platform))
    names = kept([Requirement(r).name for r in reqs], needs, excluded)
    pins = sorted(f"{n}=={versions[n]}" for n in names)
    pip("download", "-q", "--no-deps", "-d", str(out), *target, "--find-links", str(built), *pins)
    for sdist in sdists:
        shutil.copy2(sdist, out / sdist.name)
    expected = {n: versions[n] for n in names}
    expected.update(name_version(s.name) for s in sdists)  # type: ignore[misc]
    prune(out, expected)
    header = (
        f"# pipe wheelhouse: profile {args.profile}, Python {args.python_version}, {args.platform}\n"
        f"# left out: {left_out(args)}\n"
        f"# install: python scripts/wheelhouse.py install --python PYTHON --wheelhouse {out}\n"
    )
    lock = write_lock(out, header)
    shutil.rmtree(work, ignore_errors=True)
    size = size_of(out)
    count = len(lock.read_text().splitlines()) - header.count("\n")
    print(
        f"wheelhouse: {out}/ {count} packages, {size / 2**20:.1f} MiB, {time.monotonic() - start:.0f} s"
    )
    print(f"lock: {lock}")
    if size > CARRY_LIMIT:
        print(
            f"note: over the {CARRY_LIMIT // 2**20} MiB a device call carries: carry it in parts "
            "or leave out what the GPU machine has (TARGET_FREEZE, or TARGET_HAS="
            "'torch triton nvidia-* transformers numpy tokenizers huggingface-hub safetensors')"
        )
    return 0


# --- install -----------------------------------------------------------------------------------


def offline_env() -> dict[str, str]:
    """The environment for pip with no source but the wheelhouse: no config file's
    find-links or extra index."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def install(args: argparse.Namespace) -> int:
    """Install offline from a wheelhouse: the build tools, then every locked package (the
    sdists built against what is installed), then the project."""
    house = Path(args.wheelhouse).resolve()
    lock = house / LOCK
    pins = [ln for ln in lock.read_text().splitlines() if ln and not ln.startswith("#")]
    tools = [p for p in pins if p.split("==")[0] in ("setuptools", "wheel")]
    offline = ["install", "-q", "--no-index", "--find-links", str(house)]
    env = offline_env()
    for step, extra in (("build tools", tools), ("locked packages", ["-r", str(lock)])):
        start = time.monotonic()
        pip(*offline, "--no-build-isolation", *extra, env=env, python=args.python)
        print(f"installed {step} in {time.monotonic() - start:.0f} s")
    if args.project:
        start = time.monotonic()
        project = ["-e", args.project] if args.editable else [args.project]
        pip(*offline, "--no-build-isolation", *project, env=env, python=args.python)
        print(f"installed the project in {time.monotonic() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="resolve, download and lock the wheelhouse")
    b.add_argument("--profile", default="gpu", choices=PROFILES)
    b.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    b.add_argument(
        "--platform", default=None, help="e.g. manylinux_2_28_x86_64 (default: this machine's)"
    )
    b.add_argument(
        "--target-freeze", default=None, help="`pip freeze` of the target: leave out what it pins"
    )
    b.add_argument(
        "--target-has",
        nargs="*",
        default=list(DEFAULT_EXCLUDED),
        help="without a freeze: what the target has (names, `prefix*`); default torch triton nvidia-*",
    )
    b.add_argument("--only", nargs="*", default=(), help="just these packages (and what they need)")
    b.add_argument("--out", default=str(ROOT / "wheelhouse"))
    i = sub.add_parser("install", help="install offline from a wheelhouse")
    i.add_argument("--python", required=True, help="the interpreter whose environment receives it")
    i.add_argument("--wheelhouse", default=str(ROOT / "wheelhouse"))
    i.add_argument("--project", default=None, help="the checkout to install after the packages")
    i.add_argument("--editable", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        args.platform = args.platform or this_platform()
        return build(args)
    return install(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipError as e:
        sys.exit(f"pip failed:\n{e}")
