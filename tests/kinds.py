"""Toy stage kinds for engine tests (like distributed's inc / slowinc / throws).

They are importable (`tests.kinds`), so Dask workers started with the repo on
PYTHONPATH can unpickle them; `register()` adds them to the registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from pydantic import Field

from engine.stage import StageConfig, StageContext, StageKind, register_kind


class ToyConfig(StageConfig):
    """A toy stage: copies its inputs' text plus a value into its output."""

    INPUTS = ("input",)
    OUTPUTS = ("output",)
    INPUT_OPTIONAL = True

    input: str | None = Field(None, description="Upstream file, or a folder of files.")
    output: str = Field("out.txt", description="File written.")
    value: str = Field("x", description="Text appended.")
    sleep_s: float = Field(0.0, ge=0, description="Seconds to sleep.")
    fail_times: int = Field(0, ge=0, description="Fail this many attempts before succeeding.")
    always_fail: bool = Field(False, description="Fail every attempt.")
    pid_file: str | None = Field(None, description="Write the worker's PID here, then sleep.")
    record_devices: bool = Field(
        False,
        description="Sleep in a child process started with the stage's device environment; it "
        "writes what it was given to devices.json in the stage's folder.",
    )
    env_probe: list[str] = Field(
        default_factory=list, description="Report which of these variables the worker has."
    )


def toy(cfg: ToyConfig, ctx: StageContext) -> dict[str, Any]:
    if cfg.pid_file:
        with open(cfg.pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")
    if cfg.always_fail:
        raise RuntimeError(f"{ctx.name} always fails")
    if ctx.attempt <= cfg.fail_times:
        raise RuntimeError(f"{ctx.name} fails on attempt {ctx.attempt}")
    start = time.time()
    if cfg.record_devices:
        _child_records_devices(ctx, cfg.sleep_s)
    else:
        time.sleep(cfg.sleep_s)
    text = ""
    for path in _files(cfg.input) if cfg.input else []:
        with open(path) as f:
            text += f.read()
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
        "env": {name: name in os.environ for name in cfg.env_probe},
    }


def _files(path: str) -> list[str]:
    """`path`, or the files of a folder (a checkpoint) by name."""
    if not os.path.isdir(path):
        return [path]
    return [os.path.join(path, n) for n in sorted(os.listdir(path))]


CHILD = """
import json, os, sys, time
start = time.time()
time.sleep(float(sys.argv[2]))
record = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
          "start": start, "end": time.time()}
with open(sys.argv[1], "w") as f:
    json.dump(record, f)
"""


def _child_records_devices(ctx: StageContext, sleep_s: float) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(ctx.device_env())
    subprocess.run(
        [sys.executable, "-c", CHILD, ctx.path("devices.json"), str(sleep_s)], env=env, check=True
    )


class SpreadConfig(ToyConfig):
    """A toy stage that runs as one task per worker of its placement."""

    SPANS_NODES = True

    fail_node: int | None = Field(None, description="The task of this rank fails at once.")


def spread(cfg: SpreadConfig, ctx: StageContext) -> dict[str, Any]:
    """Task `fail_node` fails; every other task waits for a value nobody publishes."""
    assert ctx.link is not None
    ctx.link.publish(f"started-{ctx.node_rank}", str(os.getpid()))
    if ctx.node_rank == cfg.fail_node:
        raise RuntimeError(f"task {ctx.node_rank} fails on attempt {ctx.attempt}")
    ctx.link.lookup("never", timeout_s=120)
    return {"node_rank": ctx.node_rank}


def register() -> None:
    register_kind(StageKind("toy", ToyConfig, toy, __name__))
    register_kind(StageKind("spread", SpreadConfig, spread, __name__))
