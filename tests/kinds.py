"""Toy stage kinds for engine tests (like distributed's inc / slowinc / throws).

They are importable (`tests.kinds`), so Dask workers started with the repo on
PYTHONPATH can unpickle them; `register()` adds them to the registry.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from pydantic import Field

from engine.stage import StageConfig, StageContext, StageKind, register_kind


class ToyConfig(StageConfig):
    """A toy stage: copies its inputs' text plus a value into its output."""

    INPUTS = ("input",)
    OUTPUTS = ("output",)
    INPUT_OPTIONAL = True

    input: str | None = Field(None, description="Upstream file.")
    output: str = Field("out.txt", description="File written.")
    value: str = Field("x", description="Text appended.")
    sleep_s: float = Field(0.0, ge=0, description="Seconds to sleep.")
    fail_times: int = Field(0, ge=0, description="Fail this many attempts before succeeding.")
    always_fail: bool = Field(False, description="Fail every attempt.")
    pid_file: str | None = Field(None, description="Write the worker's PID here, then sleep.")


def toy(cfg: ToyConfig, ctx: StageContext) -> dict[str, Any]:
    if cfg.pid_file:
        with open(cfg.pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")
    if cfg.always_fail:
        raise RuntimeError(f"{ctx.name} always fails")
    if ctx.attempt <= cfg.fail_times:
        raise RuntimeError(f"{ctx.name} fails on attempt {ctx.attempt}")
    start = time.time()
    time.sleep(cfg.sleep_s)
    text = ""
    if cfg.input:
        with open(cfg.input) as f:
            text = f.read()
    tmp = cfg.output + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + cfg.value + "\n")
    os.replace(tmp, cfg.output)
    ctx.log.info("wrote %s", cfg.output)
    return {
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
        "attempt": ctx.attempt,
        "dump": json.dumps(ctx.gpus),
    }


def register() -> None:
    register_kind(StageKind("toy", ToyConfig, toy, __name__))
