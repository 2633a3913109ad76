"""The train stage's body: prepare, launch one process per rank, report.

Input: the resolved `TrainConfig` (absolute `input` JSONL, `model` a tiny
model spec or a checkpoint directory, absolute `output`) and the
`StageContext`.
Output: the Hugging Face checkpoint at `cfg.output`, and in the stage folder
`ds_config.json` (when DeepSpeed trains), `loss.jsonl`, `loss.png`,
`train_log.txt` (every rank's output) and `checkpoints/`; returns the
metrics dict the engine writes to `metrics.json`.

The stage process itself never trains: it checks the data (so a bad row fails
before any process starts), builds the tiny model when the config asks for
one (`<stage_dir>/init_model`), decides whether an earlier interrupted run can
be resumed (same config, inputs and world size: its fingerprint), writes the
worker spec and launches `stages.train.worker` once per rank: on CPU
`num_processes` ranks over gloo, on GPU one per GPU of the stage over NCCL.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Literal

from stages.lib.ds_config import build_ds_config
from stages.lib.jsonl import write_json
from stages.lib.launch import launch
from stages.train import ckpt as train_ckpt
from stages.train.data import dpo_pairs, read_rows, samples_of
from stages.train.spec import WorkerSpec

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.train import TrainConfig

UNHASHED = ("logging_steps", "save_steps", "num_threads")


def trainer_kind(cfg: TrainConfig) -> Literal["deepspeed", "torch"]:
    """deepspeed or torch: what `cfg.trainer` means on this machine."""
    has_ds = importlib.util.find_spec("deepspeed") is not None
    if cfg.trainer == "deepspeed" and not has_ds:
        raise RuntimeError("trainer 'deepspeed' asked for, but deepspeed is not installed")
    if cfg.trainer == "auto":
        return "deepspeed" if has_ds else "torch"
    return cfg.trainer


def threads_per_rank(cfg: TrainConfig, world: int) -> int:
    """`num_threads`, or with auto the most a rank may use: the cores shared among the ranks,
    1 to 2 each (the rank then measures which of 1 and that count is faster: train_threads)."""
    if cfg.num_threads != "auto":
        return int(cfg.num_threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2, (cores or 1) // world))


def _texts(rows: list[dict[str, Any]], cfg: TrainConfig) -> list[str]:
    """Prompts and targets as plain text, to train a fresh tokenizer on."""
    out = []
    for s in samples_of(rows, cfg.target if cfg.algorithm == "sft" else "completion"):
        prompt = s.prompt if isinstance(s.prompt, str) else [m["content"] for m in s.prompt]
        out.extend([prompt] if isinstance(prompt, str) else prompt)
        out.append(s.target)
    return out


def _fingerprint(cfg: TrainConfig, world: int, trainer: str, device: str) -> str:
    """What a checkpoint must match to be resumed: config, inputs' versions, world size."""
    config = cfg.model_dump(mode="json", exclude=set(UNHASHED))
    stamps = {}
    for path in (cfg.input, cfg.model if isinstance(cfg.model, str) else None):
        if path and os.path.exists(path):
            st = os.stat(path)
            stamps[path] = (st.st_size, st.st_mtime_ns)
    blob = json.dumps([config, stamps, world, trainer, device], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _resume_point(stage_dir: str, fingerprint: str, ctx: StageContext) -> int | None:
    """The step an earlier run of this stage can resume from, or None (stale files cleared)."""
    root = f"{stage_dir}/checkpoints"
    found = train_ckpt.latest(root)
    if found is not None and found[1].get("fingerprint") == fingerprint:
        step = int(found[1]["step"])
        train_ckpt.trim_loss_log(f"{stage_dir}/loss.jsonl", step)
        ctx.log.info("resuming from %s (step %d)", found[0], step)
        return step
    if found is not None:
        ctx.log.warning("checkpoint %s is from another config or input: starting over", found[0])
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(f"{stage_dir}/init_model", ignore_errors=True)
    for name in ("loss.jsonl", "train_result.json"):
        if os.path.exists(f"{stage_dir}/{name}"):
            os.remove(f"{stage_dir}/{name}")
    return None


def _model_dir(cfg: TrainConfig, rows: list[dict[str, Any]], stage_dir: str) -> str:
    if isinstance(cfg.model, str):
        return cfg.model
    path = f"{stage_dir}/init_model"
    if not os.path.exists(f"{path}/config.json"):
        from stages.lib.model import build_tiny_model

        build_tiny_model(cfg.model, _texts(rows, cfg), path, seed=cfg.seed)
    return path


def _check_data(cfg: TrainConfig) -> list[dict[str, Any]]:
    """The input rows, once every one is known to be usable (else `DataError`)."""
    rows = read_rows(str(cfg.input))
    if cfg.algorithm == "dpo":
        dpo_pairs(rows)
    samples_of(rows, cfg.target if cfg.algorithm == "sft" else "completion", str(cfg.input))
    return rows


def run_train(cfg: TrainConfig, ctx: StageContext) -> dict[str, Any]:
    """Train as configured; see the module docstring."""
    start = time.perf_counter()
    stage_dir = ctx.stage_dir.rstrip("/")
    rows = _check_data(cfg)
    device: Literal["cpu", "cuda"] = "cuda" if ctx.gpus > 0 else "cpu"
    world = ctx.gpus if ctx.gpus > 0 else cfg.num_processes
    trainer = trainer_kind(cfg)
    fingerprint = _fingerprint(cfg, world, trainer, device)
    resumed = _resume_point(stage_dir, fingerprint, ctx)
    ds_config = None
    if trainer == "deepspeed":
        ds_config = build_ds_config(cfg, world, pin_memory=device == "cuda")
        write_json(f"{stage_dir}/ds_config.json", ds_config, indent=2)
    threads = threads_per_rank(cfg, world)
    spec = WorkerSpec(
        config=cfg,
        model_dir=_model_dir(cfg, rows, stage_dir),
        stage_dir=stage_dir,
        device=device,
        trainer=trainer,
        threads=threads,
        tune_threads=cfg.num_threads == "auto" and threads > 1,
        ds_config=ds_config,
        fingerprint=fingerprint,
    )
    spec.write(f"{stage_dir}/train_spec.json")
    engine = f"deepspeed zero {cfg.zero_stage}" if ds_config else "plain torch"
    ctx.log.info(
        "train: %s on %d %s rank(s), %d thread(s) each, %s",
        cfg.algorithm,
        world,
        device,
        threads,
        engine,
    )
    launch(
        "stages.train.worker",
        f"{stage_dir}/train_spec.json",
        world,
        device,
        threads,
        f"{stage_dir}/train_log.txt",
        ctx.log,
    )
    metrics = _metrics(cfg, stage_dir, ctx.name)
    metrics.update(
        resumed_from_step=resumed,
        wall_time_s=round(time.perf_counter() - start, 3),
        world_size=world,
        device=device,
        trainer=trainer,
        zero_stage=cfg.zero_stage if ds_config else None,
    )
    return metrics


def _metrics(cfg: TrainConfig, stage_dir: str, name: str) -> dict[str, Any]:
    from stages.train.plot import plot_loss

    with open(f"{stage_dir}/train_result.json", encoding="utf-8") as f:
        result = json.load(f)
    records = train_ckpt.read_loss_log(f"{stage_dir}/loss.jsonl")
    if records:
        plot_loss(records, f"{stage_dir}/loss.png", f"{name}: {cfg.algorithm} loss")
    tail = [r["loss"] for r in records[-10:]]
    run_time = max(result["run_time_s"], 1e-9)
    out = {
        "algorithm": cfg.algorithm,
        "steps": result["step"],
        "total_steps": result["total_steps"],
        "epochs": round(result["step"] / result["steps_per_epoch"], 3),
        "loss": round(sum(tail) / len(tail), 6) if tail else None,
        "final_loss": records[-1]["loss"] if records else None,
        "initial_loss": records[0]["loss"] if records else None,
        "tokens_per_s": round(result["run_tokens"] / run_time, 1),
        "samples_per_s": round(result["run_samples"] / run_time, 2),
        "steps_per_s": round(result["run_steps"] / run_time, 3),
        "train_time_s": result["train_time_s"],
        "tokens": result["tokens"],
        "samples": result["units"],
        "dropped": result["dropped"],
        "threads": result["threads"],
    }
    if cfg.algorithm == "dpo" and records:
        out["accuracy"] = records[-1].get("accuracy")
        out["margin"] = records[-1].get("margin")
    return out
