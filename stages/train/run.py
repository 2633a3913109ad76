"""The train stage's body: prepare, launch one process per rank, report.

Input: the resolved `TrainConfig` (absolute `input` JSONL, `model` a tiny
model spec or a checkpoint directory, absolute `output`) and the
`StageContext`.
Output: the Hugging Face checkpoint at `cfg.output` (in `save_dtype`, the input's config
fields and other files kept: `stages.lib.model.save`), and in the stage folder
`ds_config.json` (when DeepSpeed trains), `loss.jsonl`, `loss.png`,
`train_log.txt` (every rank's output) and `checkpoints/`; returns the
metrics dict the engine writes to `metrics.json`.

The stage process itself never trains: it checks the data (so a bad row fails
before any process starts), builds the tiny model when the config asks for
one (`<stage_dir>/init_model`), decides whether an earlier interrupted run can
be resumed (same config, inputs and world size: its resume key), writes the
worker brief and launches `stages.train.worker` once per rank: on CPU
`num_processes` ranks over gloo, on GPU one per GPU of the stage over NCCL.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from stages.lib.devices import slow_bf16
from stages.lib.distributed import resume
from stages.lib.distributed.ds_config import build_ds_config
from stages.lib.distributed.spawn import Ranks, launch, rank_table
from stages.lib.distributed.trainer_choice import choose_trainer
from stages.lib.io.jsonl import write_json
from stages.lib.model.dtypes import resolve_save_dtype
from stages.train import ckpt as train_ckpt
from stages.train.brief import WorkerBrief
from stages.train.data import dpo_pairs, read_rows, samples_of

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.train import TrainConfig

UNHASHED = ("logging_steps", "save_steps", "num_threads")
JOIN_TIMEOUT_S = 900.0  # how long a node waits for node 0 to prepare the job


def threads_per_rank(cfg: TrainConfig, world: int) -> int:
    """`num_threads`, or with auto the most a rank may use: the cores shared among the ranks,
    1 to 2 each (the rank then measures which of 1 and that count is faster: train_threads)."""
    if cfg.num_threads != "auto":
        return int(cfg.num_threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2, (cores or 1) // world))


def _texts(rows: list[dict[str, Any]], cfg: TrainConfig) -> list[str]:
    """Prompts and targets as plain text, to train a fresh tokenizer on."""
    if cfg.algorithm == "rm":
        from stages.train.pairwise import pair_texts, preference_pairs

        return pair_texts(preference_pairs(rows, cfg.margin))
    out = []
    for s in samples_of(rows, cfg.target if cfg.algorithm == "sft" else "completion"):
        out.extend(s.texts())
    return out


def _resume_key(cfg: TrainConfig, world: int, trainer: str, device: str) -> str:
    """What a checkpoint must match to be resumed: config, inputs' versions, world size."""
    return resume.resume_key(cfg, UNHASHED, world, trainer, device)


def _resume_point(stage_dir: str, resume_key: str, ctx: StageContext) -> int | None:
    """The step an earlier run of this stage can resume from, or None (stale files cleared)."""
    root = f"{stage_dir}/checkpoints"
    found = train_ckpt.latest(root)
    if found is not None and found[1].get("resume_key") == resume_key:
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


def _model_dir(cfg: TrainConfig, rows: list[dict[str, Any]], ctx: StageContext) -> str:
    """The checkpoint folder the ranks load: `model` (a GGUF converted in the dtype training
    computes in), or the tiny model built now; with `chat_template:`, a view of it rendering
    that template (`stages.lib.model.prepared`), which the saved checkpoint then carries."""
    from stages.lib.model.prepared import compute_dtype, prepare_model, stage_template

    path = cfg.model if isinstance(cfg.model, str) else f"{ctx.stage_dir.rstrip('/')}/init_model"
    if not isinstance(cfg.model, str) and not os.path.exists(f"{path}/config.json"):
        from stages.lib.builders.tiny import build_tiny_model

        build_tiny_model(cfg.model, _texts(rows, cfg), path, seed=cfg.seed)
    template = stage_template(cfg)
    dtype = compute_dtype(cfg.bf16)
    return prepare_model(path, run_dir=ctx.run_dir, dtype=dtype, template=template, log=ctx.log)


def _check_data(cfg: TrainConfig) -> list[dict[str, Any]]:
    """The input rows, once every one is known to be usable (else `DataError`)."""
    rows = read_rows(str(cfg.input))
    if cfg.algorithm == "rm":
        from stages.train.pairwise import check_reward_data

        check_reward_data(cfg, rows)
        return rows
    if cfg.algorithm == "dpo":
        dpo_pairs(rows)
    samples_of(rows, cfg.target if cfg.algorithm == "sft" else "completion", str(cfg.input))
    return rows


def rank_layout(cfg: TrainConfig, ctx: StageContext) -> tuple[Ranks, Literal["cpu", "cuda"]]:
    """This task's ranks and the device kind: one rank per placed device (CUDA when this
    machine has it, else the CPU with gloo, the device ids still given to each rank), or
    `num_processes` CPU ranks for a stage without GPUs."""
    if not ctx.slots:
        return Ranks(world=cfg.num_processes), "cpu"
    table = rank_table(ctx)
    mine = [r for r in table if r["node_rank"] == ctx.node_rank]
    import torch

    device: Literal["cpu", "cuda"] = "cuda" if torch.cuda.is_available() else "cpu"
    names = ctx.device_env().get("CUDA_VISIBLE_DEVICES", "")
    ranks = Ranks(
        world=len(table),
        first=mine[0]["rank"],
        local=len(mine),
        node_rank=ctx.node_rank,
        devices=tuple(names.split(",")) if names else (),
    )
    return ranks, device


def _join(cfg: TrainConfig, ctx: StageContext, ranks: Ranks, device: str) -> dict[str, Any]:
    """A task other than the first: start this node's ranks once node 0 has prepared the job
    and published where its rank 0 listens."""
    assert ctx.link is not None
    addr, port = ctx.link.lookup("master", timeout_s=JOIN_TIMEOUT_S).rsplit(":", 1)
    ranks = replace(ranks, master_addr=addr, master_port=int(port))
    stage_dir = ctx.stage_dir.rstrip("/")
    ctx.log.info(
        "train: ranks %d-%d of %d join %s:%s",
        ranks.first,
        ranks.first + ranks.count - 1,
        ranks.world,
        addr,
        port,
    )
    launch(
        "stages.train.worker",
        f"{stage_dir}/train_brief.json",
        ranks,
        device,
        threads_per_rank(cfg, ranks.count),
        f"{stage_dir}/train_log.{ctx.node_rank}.txt",
        ctx.log,
        should_stop=ctx.link.aborted,
    )
    return {
        "node_rank": ctx.node_rank,
        "ranks": list(range(ranks.first, ranks.first + ranks.count)),
    }


def _master(ctx: StageContext) -> tuple[str, int]:
    """Where global rank 0 listens: this worker's host and a free port."""
    worker = ctx.tasks[0][1] if ctx.tasks else None
    host = worker.split("://")[-1].rsplit(":", 1)[0] if worker else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])


def run_train(cfg: TrainConfig, ctx: StageContext) -> dict[str, Any]:
    """Train as configured; see the module docstring."""
    start = time.perf_counter()
    ranks, device = rank_layout(cfg, ctx)
    if ctx.node_rank > 0:
        return _join(cfg, ctx, ranks, device)
    stage_dir = ctx.stage_dir.rstrip("/")
    rows = _check_data(cfg)
    world = ranks.world
    trainer = choose_trainer(cfg)
    resume_key = _resume_key(cfg, world, trainer, device)
    resumed = _resume_point(stage_dir, resume_key, ctx)
    model_dir = _model_dir(cfg, rows, ctx)
    ds_config = None
    if trainer == "deepspeed":
        ds_config = build_ds_config(cfg, world, pin_memory=device == "cuda", model_dir=model_dir)
        write_json(f"{stage_dir}/ds_config.json", ds_config, indent=2)
    threads = threads_per_rank(cfg, ranks.count)
    save_dtype, save_why = resolve_save_dtype(cfg.save_dtype, model_dir)
    brief = WorkerBrief(
        config=cfg,
        model_dir=model_dir,
        stage_dir=stage_dir,
        device=device,
        trainer=trainer,
        threads=threads,
        tune_threads=cfg.num_threads == "auto" and threads > 1,
        ds_config=ds_config,
        resume_key=resume_key,
        save_dtype=save_dtype,
    )
    brief.write(f"{stage_dir}/train_brief.json")
    engine = f"deepspeed zero {cfg.zero_stage}" if ds_config else "plain torch"
    slow = slow_bf16(device, cfg.bf16)
    if slow is not None:
        ctx.log.warning("%s", slow)
    if cfg.ring_attn_size > 1:
        engine += f", each sequence split over {cfg.ring_attn_size} ranks (Ulysses attention)"
    ctx.log.info(
        "train: %s on %d %s rank(s), %d thread(s) each, %s",
        cfg.algorithm,
        world,
        device,
        threads,
        engine,
    )
    if ctx.link is not None:
        host, port = _master(ctx)
        ranks = replace(ranks, master_addr=host, master_port=port)
        ctx.link.publish("master", f"{host}:{port}")
    launch(
        "stages.train.worker",
        f"{stage_dir}/train_brief.json",
        ranks,
        device,
        threads,
        f"{stage_dir}/train_log.txt",
        ctx.log,
        should_stop=ctx.link.aborted if ctx.link is not None else None,
    )
    metrics = _metrics(cfg, stage_dir, ctx.name)
    metrics.update(
        resumed_from_step=resumed,
        wall_time_s=round(time.perf_counter() - start, 3),
        world_size=world,
        device=device,
        trainer=trainer,
        zero_stage=cfg.zero_stage if ds_config else None,
        save_dtype=save_dtype,
        save_dtype_from=save_why,
    )
    if ctx.slots:
        metrics["ranks"] = rank_table(ctx)
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
        "stopped_at_target": result.get("stopped_at_target"),
        "eval_accuracy": result["last"].get("eval_accuracy") if result.get("last") else None,
    }
    if cfg.algorithm != "sft" and records:
        out["accuracy"] = records[-1].get("accuracy")
        gap = "margin" if cfg.algorithm == "dpo" else "reward_gap"
        out[gap] = records[-1].get(gap)
    return out
