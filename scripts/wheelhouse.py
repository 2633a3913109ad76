"""Build a wheelhouse for an offline machine, and install from one with every hash checked.

Input: the project's pyproject.toml, a profile (`gpu`: what `pytest -m gpu` and the GRPO
quickstart need; `full`: base + train + tasks + dev + tracking; `base`: the project's own
dependencies), the target's Python version and platform (defaults: this machine's), and what
the target already has: a `pip freeze` of it (`--target-freeze`), or names and `prefix*`
patterns (`--target-has`, default torch triton nvidia-*). Output: `wheelhouse/`, one file per
package (a wheel, or DeepSpeed's sdist: it is built on the target against the target's torch),
and `wheelhouse/requirements.lock`, one `name==version --hash=sha256:...` line per file.

    python scripts/wheelhouse.py build [--python-version 3.12] [--platform manylinux_2_28_x86_64]
    python scripts/wheelhouse.py install --python .venv-gpu/bin/python [--project . --editable]

Every step is a tool's: `uv pip compile --python-platform --python-version --format
pylock.toml` resolves for the target and names the one file the target installs of each
package, with its URL and sha256; `pip download --require-hashes` fetches those files and checks
them; `pip wheel --no-deps` builds a wheel of each sdist the index has no wheel for (but
DeepSpeed's); `pip install --no-index --require-hashes` installs. Building needs uv (the `dev`
extra); installing needs only pip and the standard library.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
LOCK = "requirements.lock"
CARRY_LIMIT = 64 * 2**20  # what one device call carries of ignored paths
TARGET_HAS = ("torch", "triton", "nvidia-*")  # a CUDA build of torch with its own libraries
# for the --no-build-isolation builds on the target; setuptools below 82: torch 2.11 (the CUDA
# build on the lent GPU machines) requires it, and torch is left out of the resolution
BUILD_TOOLS = ("setuptools>=77.0.3,<82", "wheel")
SDIST_KEPT = ("deepspeed",)  # built on the target against its torch: the sdist is carried
GPU_DEV = ("pytest", "pytest-timeout")  # what `pytest -m gpu` needs of the dev extra
GPU_SKIP = ("pyarrow",)  # only the `parquet` dataset source reads it
PROFILES = ("gpu", "full", "base")
NEVER = "sys_platform == 'never'"  # an override with this marker takes a package out of uv's graph


def canonical(name: str) -> str:
    """PEP 503's normalized name: `ruamel.yaml.clib` -> `ruamel-yaml-clib`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    """The canonical name a requirement line starts with: `transformers>=4.57` -> `transformers`."""
    return canonical(re.split(r"[\s\[<>=!~;@(]", req.strip(), maxsplit=1)[0])


# --- what to resolve ---------------------------------------------------------------------------


def profile_requirements(pyproject: dict, profile: str) -> list[str]:
    """A parsed pyproject.toml and a profile -> its root requirements, as pyproject writes them."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    reqs = list(project["dependencies"])
    if profile == "full":
        for group in ("train", "tasks", "dev", "tracking"):
            reqs += extras.get(group, [])
    elif profile == "gpu":
        reqs += extras.get("train", []) + extras.get("tasks", [])
        reqs += [r for r in extras.get("dev", []) if req_name(r) in GPU_DEV]
        reqs = [r for r in reqs if req_name(r) not in GPU_SKIP]
    return reqs


def read_freeze(text: str) -> dict[str, str | None]:
    """A `pip freeze` -> name: pinned version (None for `name @ url` and editable lines)."""
    pins: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.strip()
        egg = re.search(r"#egg=([A-Za-z0-9_.\-]+)", line)
        if line.startswith("-e") and egg:
            pins[canonical(egg.group(1))] = None
        elif line.startswith(("#", "-")) or not line:
            continue
        elif " @ " in line:
            pins[req_name(line)] = None
        elif "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.split(";")[0].split(" #")[0].strip()
    return pins


def has_matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    """Names and `prefix*` patterns of what the target has -> whether it has a package."""
    normal = [canonical(p) for p in patterns]
    return lambda name: any(fnmatch.fnmatchcase(canonical(name), p) for p in normal)


def target_has(args: argparse.Namespace) -> Callable[[str], bool]:
    """Whether the target has a package: the freeze's names when one was given, else
    --target-has."""
    return has_matcher(args.freeze if args.freeze is not None else args.target_has)


def public_pins(freeze: dict[str, str | None] | None) -> dict[str, str]:
    """A freeze's pins an index can hold: not `+cu130` builds, `@ url` or editable lines."""
    return {n: v for n, v in (freeze or {}).items() if v and "+" not in v}


def removals(freeze: dict[str, str | None] | None, has: Iterable[str]) -> set[str]:
    """What uv must leave out of its graph, with what only it needs: the freeze's packages no
    index builds (torch+cu130 and so its CUDA libraries), else the exact names in `has`."""
    if freeze is not None:
        return set(freeze) - set(public_pins(freeze))
    return {canonical(h) for h in has if "*" not in h}


# --- build -------------------------------------------------------------------------------------


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run a tool -> its stdout; SystemExit with all it printed when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    return done.stdout


def uv() -> list[str]:
    """The command that runs uv: this interpreter's `python -m uv`, else `uv` on PATH."""
    if importlib.util.find_spec("uv"):
        return [sys.executable, "-m", "uv"]
    if shutil.which("uv"):
        return ["uv"]
    raise SystemExit("building a wheelhouse needs uv: pip install uv (it is in the dev extra)")


def uv_platform(plat: str) -> str:
    """pip's platform tag -> uv's target: `manylinux_2_28_x86_64` -> `x86_64-manylinux_2_28`."""
    m = re.fullmatch(r"(manylinux_\d+_\d+|manylinux\d+)_(\w+)", plat)
    if not m:
        raise SystemExit(f"--platform {plat}: expected a manylinux tag, e.g. manylinux_2_28_x86_64")
    return f"{m.group(2)}-{m.group(1)}"


def this_platform() -> str:
    """This machine's manylinux tag, e.g. `manylinux_2_36_x86_64`."""
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        raise SystemExit("no glibc here: pass --platform (e.g. manylinux_2_28_x86_64)")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def compile_lock(
    work: Path, roots: list[str], overrides: set[str], args: argparse.Namespace
) -> list[dict]:
    """uv pip compile for the target -> pylock.toml's packages, each with the files the target
    can install. `overrides` are replaced by a never-true marker: gone, and what only they need."""
    (work / "requirements.in").write_text("".join(r + "\n" for r in roots))
    (work / "overrides.txt").write_text("".join(f"{n} ; {NEVER}\n" for n in sorted(overrides)))
    pins = public_pins(args.freeze)
    (work / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    run(
        [
            *uv(),
            "pip",
            "compile",
            "--quiet",
            str(work / "requirements.in"),
            "--override",
            str(work / "overrides.txt"),
            "-c",
            str(work / "constraints.txt"),
            "--python-platform",
            uv_platform(args.platform),
            "--python-version",
            args.python_version,
            "--python",
            sys.executable,
            "--format",
            "pylock.toml",
            "-o",
            str(work / "pylock.toml"),
        ]
    )
    return tomllib.loads((work / "pylock.toml").read_text())["packages"]


def resolve(work: Path, roots: list[str], args: argparse.Namespace) -> list[dict]:
    """The roots -> pylock packages the wheelhouse must hold: none the target has. A package
    matching a `prefix*` of --target-has that turns up is overridden too and uv run again, so
    what only it needs goes with it. A freeze's public pins stay in the graph as constraints:
    a root that needs another version of what the target has fails here, not on the target."""
    has = target_has(args)
    overrides = removals(args.freeze, args.target_has)
    for _ in range(5):
        packages = compile_lock(work, roots, overrides, args)
        found = {canonical(p["name"]) for p in packages if has(p["name"])}
        more = found - overrides - set(public_pins(args.freeze))
        if not more:
            return [p for p in packages if not has(p["name"])]
        overrides |= more
    raise SystemExit(f"still resolving what the target has after 5 tries: {sorted(more)}")


def chosen(package: dict) -> dict:
    """A pylock package -> the file the target installs: `name`, `version`, `url`, `sha256`,
    `file`. A platform wheel before a pure one; the sdist when no wheel fits the target."""
    wheels = sorted(package.get("wheels", []), key=lambda w: w["url"].endswith("-any.whl"))
    file = wheels[0] if wheels else package["sdist"]
    url = file["url"]
    return {
        "name": canonical(package["name"]),
        "version": package["version"],
        "url": url,
        "sha256": file["hashes"]["sha256"],
        "file": unquote(url.rsplit("/", 1)[1]),
    }


def fetch(files: list[dict], dest: Path, python_version: str, work: Path) -> None:
    """Download the chosen files into dest, each checked against its sha256 (pip download
    --require-hashes; a file already there is checked, not fetched again). pip checks a wheel
    named by URL against the target's tags too: those are the tags of the wheels uv chose."""
    reqs = work / "files.txt"
    reqs.write_text(
        "".join(f"{f['name']} @ {f['url']} --hash=sha256:{f['sha256']}\n" for f in files)
    )
    wheels = [f["file"][:-4] for f in files if f["file"].endswith(".whl")]
    tags = sorted({t for w in wheels for t in w.rsplit("-", 1)[1].split(".")} - {"any"})
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--require-hashes",
            "-d",
            str(dest),
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *[arg for t in tags for arg in ("--platform", t)],
            "-r",
            str(reqs),
        ]
    )


def build_python(version: str, given: str | None) -> str:
    """The interpreter that builds sdists into wheels: --build-python, else this one when it is
    the target's version, else a python{version} that uv finds or pyenv holds, else this one
    (then only pure sdists build: `check_built` refuses a compiled wheel for another Python)."""
    if given:
        return given
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        return sys.executable
    found = subprocess.run([*uv(), "python", "find", version], capture_output=True, text=True)
    if found.returncode == 0:
        return found.stdout.strip()
    pyenv = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    return str(pyenv[-1]) if pyenv else sys.executable


def glibc_needed(wheel: Path) -> int:
    """A wheel -> the newest glibc 2.N its shared libraries ask for (0 when none)."""
    newest = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".so" in name.rsplit("/", 1)[-1]:
                for minor in re.findall(rb"GLIBC_2\.(\d+)", z.read(name)):
                    newest = max(newest, int(minor))
    return newest


def check_built(wheel: Path, python_version: str, plat: str) -> None:
    """SystemExit unless a wheel built here installs and loads on the target: pure, or built
    for the target's Python and asking for no newer glibc than its platform tag allows."""
    py, _, tag = wheel.name[:-4].split("-")[-3:]
    if tag == "any":
        return
    if py != "cp" + python_version.replace(".", ""):
        raise SystemExit(
            f"{wheel.name}: compiled for another Python than {python_version}; pass "
            f"--build-python (make: BUILD_PYTHON=) a python{python_version}"
        )
    allowed = re.match(r"manylinux_2_(\d+)_", plat)
    if allowed and glibc_needed(wheel) > int(allowed.group(1)):
        raise SystemExit(f"{wheel.name} needs glibc 2.{glibc_needed(wheel)}, newer than {plat}")


def build_wheel(sdist: Path, python: str, args: argparse.Namespace) -> Path:
    """An sdist in the wheelhouse -> a wheel of it beside it (pip wheel --no-deps), checked to
    suit the target; the sdist removed."""
    with tempfile.TemporaryDirectory(prefix="wheel-") as tmp:
        run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(sdist)])
        built = next(Path(tmp).glob("*.whl"))
        check_built(built, args.python_version, args.platform)
        wheel = Path(shutil.move(built, sdist.parent / built.name))
    sdist.unlink()
    print(f"built {wheel.name} from {sdist.name} (the index has no wheel for the target)")
    return wheel


def sha256(path: Path) -> str:
    """A file -> its sha256, in hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock_text(entries: list[tuple[str, str, Path]], header: str = "") -> str:
    """(name, version, file) of every file in the wheelhouse -> requirements.lock's text: one
    `name==version --hash=sha256:<the file's>` line each, sorted. A downloaded file's hash is
    the index's (pip download checked it against uv's lock). A wheel built here from an sdist
    cannot have one (the index holds no such file), so its own hash is recorded: the header
    names each such build and the index hash of the sdist it came from."""
    names = [n for n, _, _ in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"more than one file of {', '.join(twice)}")
    lines = [f"{n}=={v} --hash=sha256:{sha256(p)}" for n, v, p in sorted(entries)]
    return header + "".join(line + "\n" for line in lines)


def prune(wheelhouse: Path, keep: set[str]) -> None:
    """Remove the files an earlier build left that this one does not hold."""
    for path in wheelhouse.iterdir():
        if path.is_file() and path.name not in keep:
            print(f"removed {path.name} (not in this build)")
            path.unlink()


def header(args: argparse.Namespace, built: list[dict]) -> str:
    """The lock's comment lines: the target, what was left out, the builds done here."""
    left_out = args.target_freeze or " ".join(args.target_has) + " and what only they need"
    lines = [
        f"pipe wheelhouse: profile {args.profile}, Python {args.python_version}, {args.platform}",
        f"left out (the target has them): {left_out}",
        f"install: python scripts/wheelhouse.py install --python PYTHON --wheelhouse {args.out}",
        "hashes: the index's (pip download checked each file against it)",
    ]
    if built:
        lines.append(
            "but for wheels built here, which have their own: each from an sdist of the index"
        )
        lines += [
            f"  {f['name']} {f['version']} from {f['file']} sha256:{f['sha256']}" for f in built
        ]
    return "".join(f"# {line}\n" for line in lines)


def build(args: argparse.Namespace) -> int:
    """Resolve, fetch, build and lock the wheelhouse; print its file count, size and time."""
    start = time.monotonic()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    args.freeze = read_freeze(Path(args.target_freeze).read_text()) if args.target_freeze else None
    roots = [*profile_requirements(pyproject, args.profile), *BUILD_TOOLS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        files = [chosen(p) for p in resolve(Path(tmp), roots, args)]
        fetch(files, out, args.python_version, Path(tmp))
    sdists = [f for f in files if not f["file"].endswith(".whl") and f["name"] not in SDIST_KEPT]
    python = build_python(args.python_version, args.build_python) if sdists else sys.executable
    wheels = {f["name"]: build_wheel(out / f["file"], python, args) for f in sdists}
    entries = [(f["name"], f["version"], wheels.get(f["name"], out / f["file"])) for f in files]
    lock = out / LOCK
    lock.write_text(lock_text(entries, header(args, sdists)))
    prune(out, {p.name for _, _, p in entries} | {LOCK})
    size = sum(p.stat().st_size for _, _, p in entries)
    print(
        f"wheelhouse: {out}/ {len(entries)} files, {size / 2**20:.1f} MiB, "
        f"{time.monotonic() - start:.0f} s; lock: {lock}"
    )
    if size > CARRY_LIMIT:
        print(
            f"note: over the {CARRY_LIMIT // 2**20} MiB a device call carries: carry it in parts "
            "or leave out what the GPU machine has (TARGET_FREEZE, or TARGET_HAS='torch triton "
            "nvidia-* transformers numpy tokenizers huggingface-hub safetensors')"
        )
    return 0


# --- install -----------------------------------------------------------------------------------


def offline_env() -> dict[str, str]:
    """The environment for pip with no source but the wheelhouse: no config file's find-links
    or extra index."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def install_steps(
    python: str, house: Path, tools: Path, project: list[str]
) -> list[tuple[str, list[str]]]:
    """The pip commands of an offline install -> (name, command) each: the build tools alone
    (--no-deps: what they need comes with the rest), then every locked package, each file
    checked against the lock's sha256 (--require-hashes); then the project, with no source at
    all: what it needs must be installed by then."""
    pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation"]
    hashed = [*pip, "--find-links", str(house), "--require-hashes"]
    steps = [
        ("build tools", [*hashed, "--no-deps", "-r", str(tools)]),
        ("locked packages", [*hashed, "-r", str(house / LOCK)]),
    ]
    return steps + ([("the project", [*pip, *project])] if project else [])


def install(args: argparse.Namespace) -> int:
    """Install offline from a wheelhouse into `--python`'s environment, then `--project`;
    DeepSpeed's sdist is built there against what is installed. Each step's time printed."""
    house = Path(args.wheelhouse).resolve()
    pins = (house / LOCK).read_text().splitlines()
    project = []
    if args.project:
        project = ["-e", args.project] if args.editable else [args.project]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        tools = Path(tmp) / "build-tools.lock"
        tools.write_text("".join(p + "\n" for p in pins if req_name(p) in ("setuptools", "wheel")))
        for name, cmd in install_steps(args.python, house, tools, project):
            start = time.monotonic()
            run(cmd, env=offline_env())
            print(f"installed {name} in {time.monotonic() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="resolve, fetch, build and lock the wheelhouse")
    b.add_argument("--profile", default="gpu", choices=PROFILES)
    b.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    b.add_argument("--platform", help="e.g. manylinux_2_28_x86_64 (default: this machine's)")
    b.add_argument("--target-freeze", help="`pip freeze` of the target: leave out what it pins")
    b.add_argument(
        "--target-has",
        nargs="*",
        default=list(TARGET_HAS),
        help="without a freeze: what the target has (names, `prefix*`); "
        "default torch triton nvidia-*",
    )
    b.add_argument("--build-python", help="a python of the target's version for compiled sdists")
    b.add_argument("--out", default=str(ROOT / "wheelhouse"))
    i = sub.add_parser("install", help="install offline from a wheelhouse, hashes checked")
    i.add_argument("--python", required=True, help="the interpreter whose environment receives it")
    i.add_argument("--wheelhouse", default=str(ROOT / "wheelhouse"))
    i.add_argument("--project", help="the checkout to install after the packages")
    i.add_argument("--editable", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        args.platform = args.platform or this_platform()
        return build(args)
    return install(args)


if __name__ == "__main__":
    sys.exit(main())
