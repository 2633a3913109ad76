"""One training rank, run as its own process: `python -m stages.train.worker SPEC.json`.

Input: the worker spec written by `stages.train.run` (the resolved config,
the model directory, device, trainer kind, ds_config, threads) and the rank
in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Output: checkpoints and `loss.jsonl` in the stage folder; from rank 0 the
final Hugging Face checkpoint at the config's `output` (written to a
temporary sibling, then renamed into place) and `train_result.json`.

DeepSpeed keeps process-global state (its accelerator, communication
backend, ZeRO hooks), so every run gets fresh processes: the stage launches
this module once per rank and never trains in its own process. Exit status 0
means the output is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.train import TrainConfig
    from stages.train.batch import BatchPlan
    from stages.train.data import TrainingSet
    from stages.train.loop import Loop
    from stages.train.spec import WorkerSpec

log = logging.getLogger("pipe.train")
PARENT_ENV = "PIPE_TRAIN_PARENT_PID"
MARK = "@pipe "  # lines the launcher passes on to the stage's log; the rest go to the log file only


def _setup(rank: int, threads: int) -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{MARK}%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*(barrier|destroy_process_group|TypedStorage).*")
    import torch

    torch.set_num_threads(threads)


def init_distributed(trainer: str, device: str, world: int) -> None:
    """The process group of this rank (from the environment): gloo on CPU, NCCL on GPU."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if trainer == "deepspeed":
        import deepspeed

        if device == "cpu":
            # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op on first use
            # (~40 s on a fresh machine); only tensor-parallel inference calls it, not training
            with contextlib.suppress(Exception):
                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    elif world > 1:
        dist.init_process_group(backend)


def _load(model_dir: str, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    return tokenizer, model


def make_trainer(
    trainer: str, ds_config: dict[str, Any] | None, cfg: Any, model: Any, total: int, device: str
) -> Any:
    """The `Trainer` (`trainer`: deepspeed with `ds_config`, or torch) around `model`, in
    training mode."""
    from stages.lib.trainer import DeepSpeedTrainer, TorchTrainer

    model.train()  # from_pretrained returns eval mode, where checkpointing is skipped
    if cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if trainer == "deepspeed" and ds_config is not None:
        return DeepSpeedTrainer(model, cfg, total, device, ds_config)
    return TorchTrainer(model, cfg, total, device)


def _save_final(trainer: Any, tokenizer: Any, output: str, rank: int) -> None:
    """Rank 0 writes the Hugging Face checkpoint beside `output`, then renames it into place."""
    import torch.distributed as dist

    tmp = f"{output.rstrip('/')}.tmp-{os.getpid()}"
    with trainer.full_weights() as module:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            module.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    if rank == 0:
        shutil.rmtree(output, ignore_errors=True)
        os.replace(tmp, output)
    if dist.is_initialized():
        dist.barrier()


def plan_for(cfg: TrainConfig, data: TrainingSet, world: int) -> BatchPlan:
    from stages.train.batch import BatchPlan

    return BatchPlan(
        data.units,
        [len(ex.input_ids) for ex in data.examples],
        train_batch_size=cfg.train_batch_size,
        micro_batch_size=cfg.micro_train_batch_size,
        world_size=world,
        max_length=cfg.max_length,
        packing=cfg.packing_samples,
        dynamic=cfg.use_dynamic_batch,
        seed=cfg.seed,
        max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps,
    )


def _resume(loop: Loop, root: str, rank: int) -> int | None:
    """Load the newest complete checkpoint, if any; the step it was saved at."""
    from stages.train import ckpt as train_ckpt
    from stages.train.loop import Counters

    found = train_ckpt.latest(root)
    if found is None:
        return None
    tag, state = found
    train_ckpt.restore(loop.trainer, root, tag, rank)
    loop.counters = Counters(
        step=state["step"],
        tokens=state["tokens"],
        samples=state["samples"],
        train_time_s=state["train_time_s"],
    )
    log.info("resumed from checkpoint %s (step %d)", tag, state["step"])
    return int(state["step"])


def _result(loop: Loop, resumed: int | None) -> dict[str, Any]:
    import torch

    c = loop.counters
    return {
        **c.state(),
        "total_steps": loop.plan.total_steps,
        "steps_per_epoch": loop.plan.steps_per_epoch,
        "resumed_from_step": resumed,
        "run_steps": c.run_steps,
        "run_tokens": c.run_tokens,
        "run_samples": c.run_samples,
        "run_time_s": round(c.run_time_s, 3),
        "units": len(loop.data.units),
        "dropped": loop.data.dropped,
        "threads": loop.threads.best if loop.threads else torch.get_num_threads(),
        "last": c.last,
    }


def _build_loop(
    spec: WorkerSpec, cfg: TrainConfig, rank: int, world: int, device: str
) -> tuple[Loop, Any]:
    """Model, data, plan and trainer of this rank, ready to run; and the tokenizer."""
    from stages.train.data import read_rows, training_set
    from stages.train.loop import Loop
    from stages.train.threads import ThreadTuner

    tokenizer, model = _load(spec.model_dir, device)
    rows = read_rows(str(cfg.input))
    data = training_set(
        rows, tokenizer, algorithm=cfg.algorithm, target=cfg.target, max_length=cfg.max_length
    )
    plan = plan_for(cfg, data, world)
    reference = None
    if cfg.algorithm == "dpo":
        reference = _load(spec.model_dir, device)[1].to(device).eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id
    loop = Loop(
        cfg=cfg,
        trainer=make_trainer(spec.trainer, spec.ds_config, cfg, model, plan.total_steps, device),
        plan=plan,
        data=data,
        device=device,
        pad_id=tokenizer.eos_token_id if pad_id is None else pad_id,
        stage_dir=spec.stage_dir,
        rank=rank,
        world=world,
        reference=reference,
        fingerprint=spec.fingerprint,
        threads=ThreadTuner(spec.threads) if spec.tune_threads else None,
    )
    return loop, tokenizer


def run(spec: WorkerSpec) -> None:
    """Train one rank from its spec; see the module docstring."""
    import torch

    started = time.perf_counter()
    cfg = spec.config
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    _setup(rank, spec.threads)
    device = f"cuda:{local}" if spec.device == "cuda" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(local)
    init_distributed(spec.trainer, device, world)
    _record_rank(spec.stage_dir, rank, world, device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    loop, tokenizer = _build_loop(spec, cfg, rank, world, device)
    resumed = _resume(loop, f"{spec.stage_dir}/checkpoints", rank)
    log.info(
        "training %d %s on %d rank(s) with %s: %d steps (%d per epoch), ready in %.1fs",
        len(loop.data.units),
        "pairs" if cfg.algorithm == "dpo" else "samples",
        world,
        loop.trainer.name,
        loop.plan.total_steps,
        loop.plan.steps_per_epoch,
        time.perf_counter() - started,
    )
    loop.run()
    t = time.perf_counter()
    _save_final(loop.trainer, tokenizer, cfg.output, rank)
    log.info("wrote %s in %.2fs", cfg.output, time.perf_counter() - t)
    if rank == 0:
        with open(f"{spec.stage_dir}/train_result.json", "w", encoding="utf-8") as f:
            json.dump(_result(loop, resumed), f, indent=1)


def _record_rank(stage_dir: str, rank: int, world: int, device: str) -> None:
    """What this rank was given, as it sees it: `<stage_dir>/ranks/rank-<r>.json`."""
    import socket

    from stages.lib.jsonl import write_json

    env = {
        k: os.environ.get(k)
        for k in ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
    }
    write_json(
        f"{stage_dir}/ranks/rank-{rank}.json",
        {
            "rank": rank,
            "world_size": world,
            "device": device,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **{k.lower(): v for k, v in env.items()},
        },
    )


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the stage process dies (no orphans training on)."""
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    from stages.train.spec import WorkerSpec

    run(WorkerSpec.read(args[0]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and flushed by now. Skip the interpreter's teardown: a gloo or
    # DeepSpeed thread still joinable there aborts the process now and then ("terminate called
    # without an active exception", SIGABRT) after a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
