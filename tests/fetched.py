"""Shipped pipelines whose model file is fetched separately, planned with a stand-in for it.

`pipelines/gemma3_grpo.yaml` names `models/gemma-3-270m-q4_k_m.gguf`, which `make gemma3`
fetches (253 MB, not in git; CI has none). The guards that validate and plan every shipped
pipeline plan such a one in a copy of the repository's layout, `<tmp>/pipelines/<name>`
beside `<tmp>/models/<file>`: the tiny GGUF of `tests.gguf_files` (a 2-layer Llama, written
deterministically, so the explain golden's sha256 holds). Always the stand-in, even where
the real file is there: the goldens do not depend on what a machine has fetched.
`tests/integration/test_gpu_gemma3.py` runs the real one where it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import ROOT

# pipeline file -> the files it names that a make target fetches (relative to the repository)
FETCHED = {"gemma3_grpo.yaml": ("models/gemma-3-270m-q4_k_m.gguf",)}


def planned_from(path: Path, tmp: Path) -> Path:
    """The folder to run `pipe` in for shipped pipeline `path` (`pipelines/<name>` there):
    the repository, or a stand-in layout in `tmp` (module docstring)."""
    files = FETCHED.get(path.name)
    if not files:
        return ROOT
    from tests.gguf_files import write_tiny_gguf

    (tmp / "pipelines").mkdir(parents=True, exist_ok=True)
    shutil.copy(path, tmp / "pipelines" / path.name)
    for name in files:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        if not (tmp / name).exists():
            write_tiny_gguf(tmp / name)
    return tmp
