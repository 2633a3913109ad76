"""Shared fixtures: paths, and a CLI runner that behaves like the real `pipe`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.families import family_checkpoint  # noqa: F401  (a fixture, for every test)

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_cli(*args: str, cwd: Path | None = None) -> Result:
    """Run `pipe ARGS` in-process; stdout and stderr kept apart."""
    from engine.cli import main

    runner = CliRunner()
    old = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return runner.invoke(main, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)


@pytest.fixture
def pipe_cli():
    return run_cli


@pytest.fixture
def fresh_kinds():
    """The kind registry emptied before and after the test: the next `kinds()` reads the
    entry points again (for tests that register kinds of their own)."""
    from engine.stage import reset_registry

    reset_registry()
    yield
    reset_registry()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu`-marked tests skip where no CUDA device is visible (nvidia-smi, no torch import)."""
    from engine.cluster.connect import visible_gpus

    gpus = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if gpus is None:
            gpus = visible_gpus()
        need = int(item.get_closest_marker("gpu").kwargs.get("count", 1))  # type: ignore[union-attr]
        if gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s); {gpus} visible"))


def stub_checkpoint(folder: Path) -> Path:
    """A checkpoint folder as `pipe validate` checks it (a `config.json`, a tiny Llama's shape),
    for tests that plan a pipeline without running it."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 512,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def stub_weights(path: Path, shapes: dict[str, list[int]] | None = None) -> Path:
    """A `.safetensors` file of float32 zeros, one tensor per name in `shapes` (default: an
    embedding), written without torch: its header is what plan-time checks read."""
    import json
    import math
    import struct

    shapes = shapes or {"model.embed_tokens.weight": [2, 2]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    return path


def toy_payload(tmp_path: Path, body: Any, module: str, **extra: Any) -> Any:
    """A `StagePayload` of a toy kind (defined in `module`) whose run is `body(cfg, ctx)`,
    its stage folder `<tmp>/s`."""
    from engine.run.task import StagePayload
    from engine.stage import StageConfig, StageKind

    return StagePayload(
        name="s",
        kind=StageKind("toy", StageConfig, body, module),
        config=StageConfig(),
        stage_dir=str(tmp_path / "s"),
        run_dir=str(tmp_path),
        pipeline_dir=str(tmp_path),
        key="k",
        attempt=1,
        gpus=0,
        workers=1,
        **extra,
    )
