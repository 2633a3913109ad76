"""A stage kind's code version: the hash of the source it runs (part of its cache key).

Input: the module that defines a kind. Output: a hash of every file of its package (or the
module alone) and of every module of the same top-level package it imports, directly or
not (`stages/lib` for the built-ins), each file named by its path, and the data those
modules read from beside them: every file of a folder next to one of them that is not a
package (`stages/lib/chat/families/*.jinja`, the family chat templates), so editing a
vendored template re-runs what rendered with it. Imports are read from the source text, so
the hash needs no import of what it covers.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
from pathlib import Path

_HASHES: dict[str, str] = {}
_IMPORT = re.compile(
    r"^\s*(?:from\s+([\w.]+)\s+import\s+(\([^)]*\)|[\w., ]+)|import\s+([\w.]+))", re.M
)


def code_version(module_name: str) -> str:
    """Hash of the source a kind runs: its package (or module) and the modules of the same
    top-level package it imports (directly or not), each file named by its path."""
    if module_name in _HASHES:
        return _HASHES[module_name]
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    origin = getattr(module, "__file__", None)
    digest = hashlib.sha256()
    if not origin:
        digest.update(module_name.encode())
        _HASHES[module_name] = digest.hexdigest()[:16]
        return _HASHES[module_name]
    path = Path(origin)
    top = module_name.split(".")[0]
    root = path.parents[len(module_name.split(".")) - (0 if path.name == "__init__.py" else 1)]
    own = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    files = _with_imports(own, top, root)
    files |= _data_files(files)
    for f in sorted(files):
        digest.update(str(f.relative_to(root)).encode())
        digest.update(f.read_bytes())
    _HASHES[module_name] = digest.hexdigest()[:16]
    return _HASHES[module_name]


def _with_imports(files: list[Path], top: str, root: Path) -> set[Path]:
    """`files` and every module file of package `top` (under `root`) they import, transitively."""
    seen: set[Path] = set()
    todo = list(files)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for match in _IMPORT.finditer(f.read_text(encoding="utf-8")):
            base, names, plain = match.groups()
            targets = [plain] if plain else [base, *(f"{base}.{n.strip()}" for n in _names(names))]
            for target in targets:
                if target and target.split(".")[0] == top:
                    todo.extend(_module_files(target, root))
    return seen


def _data_files(modules: set[Path]) -> set[Path]:
    """Every file under the folders beside `modules` that are not packages (no __init__.py):
    the templates and other data the code reads by path."""
    out: set[Path] = set()
    for folder in {m.parent for m in modules}:
        for sub in folder.iterdir():
            if sub.is_dir() and sub.name != "__pycache__" and not (sub / "__init__.py").exists():
                out.update(
                    f for f in sub.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                )
    return out


def _names(text: str) -> list[str]:
    return [n.split(" as ")[0].strip() for n in text.strip("() ").split(",") if n.strip()]


def _module_files(dotted: str, root: Path) -> list[Path]:
    """The file of module `dotted` and the `__init__.py` of each package on its way."""
    parts = dotted.split(".")
    out = [root.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts) + 1)]
    out.append(root.joinpath(*parts).with_suffix(".py"))
    return [p for p in out if p.is_file()]


def forget_code_versions() -> None:
    _HASHES.clear()
