"""One training rank, run as its own process: `python -m stages.train.worker BRIEF.json`.

Input: the worker brief written by `stages.train.run` (the resolved config,
the model directory, device, trainer kind, ds_config, threads) and the rank
in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Output: checkpoints, `loss.jsonl` and (a fresh start) `first_batch.jsonl`, the first step's
sequences as text, ids and loss mask, in the stage folder; from rank 0 the
final Hugging Face checkpoint at the config's `output` in the resolved save dtype
(written to a temporary sibling, then renamed into place: `stages.lib.model.save`) and
`train_result.json`; a reward model (`algorithm: rm`) with held-out pairs also leaves
`heldout_scores.jsonl`, each held-out pair's final scores, and its checkpoint holds the
statistics of its final scores (`stages.train.pairwise.final_stats`) and a tokenizer padding
with its config's pad id.

DeepSpeed keeps process-global state (its accelerator, communication
backend, ZeRO hooks), so every run gets fresh processes: the stage launches
this module once per rank and never trains in its own process. Exit status 0
means the output is complete.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.train import TrainConfig
    from stages.train.batch_plan import BatchPlan
    from stages.train.brief import WorkerBrief
    from stages.train.data import TrainingSet
    from stages.train.loop import Loop

from stages.lib.chat.tokens import pad_id
from stages.lib.distributed.rank import (
    die_with_parent,
    exit_now,
    leave_group,
    load_model,
    make_trainer,
    start_rank,
)
from stages.lib.io.audit import FIRST_BATCH, append_records, token_record

log = logging.getLogger("pipe.train")
HELDOUT_SCORES = "heldout_scores.jsonl"  # rm: every held-out pair's final scores


def _load(brief: WorkerBrief) -> tuple[Any, Any]:
    """The tokenizer and the model to train: the checkpoint's, with adapters when `lora` is
    set (`stages.lib.model.lora`); a reward model (`algorithm: rm`, never with LoRA) with its
    pad id the one its scores are read with (`stages.lib.model.reward_model.score_pad_id`),
    saved with it."""
    from transformers import AutoTokenizer

    from stages.lib.model.lora.wrap import load_trained

    tokenizer = AutoTokenizer.from_pretrained(brief.model_dir)
    if brief.config.algorithm != "rm":
        model = load_trained(brief.model_dir, brief.ds_config, brief.config.lora, brief.config.bf16)
        return tokenizer, model
    from stages.lib.model.reward_model import score_pad_id

    model = load_model(brief.model_dir, brief.ds_config, reward=True)
    model.config.pad_token_id = score_pad_id(tokenizer, model.config)
    return tokenizer, model


def _save_final(
    trainer: Any,
    brief: WorkerBrief,
    rank: int,
    tokenizer: Any = None,
    stats: dict[str, float] | None = None,
) -> None:
    """Rank 0 writes the Hugging Face checkpoint at the config's `output` in the resolved
    save dtype, beside the input's files (`stages.lib.model.save`; with LoRA merged, or the
    adapter alone: `stages.lib.model.lora.output.write_output`); a reward model's config names its
    head, one label, its pad id and the statistics `stats` of its final scores
    (`stages.lib.model.reward_model.reward_config`), and its tokenizer pads with that id
    (`tokenizer_pad`)."""
    import torch.distributed as dist

    from stages.lib.model.lora.output import write_output
    from stages.lib.model.reward_model import reward_config, tokenizer_pad
    from stages.lib.model.save import write_checkpoint

    state = trainer.full_state_dict()  # every rank takes part under ZeRO-3
    if rank == 0:
        cfg, module = brief.config, trainer.module
        if cfg.algorithm == "rm":
            pad = int(module.config.pad_token_id)
            token = str(tokenizer.convert_ids_to_tokens(pad))
            fields = reward_config(module, pad, stats)
            write_checkpoint(
                module,
                state,
                brief.model_dir,
                cfg.output,
                brief.save_dtype,
                fields,
                finish=lambda folder: tokenizer_pad(folder, token, pad),
            )
        else:
            write_output(module, state, cfg.lora, brief.model_dir, cfg.output, brief.save_dtype)
    if dist.is_initialized():
        dist.barrier()


def plan_for(cfg: TrainConfig, data: TrainingSet, world: int) -> BatchPlan:
    from stages.train.batch_plan import BatchPlan

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
        stopped=bool(state.get("stopped", False)),
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
        "stopped_at_target": c.step if c.stopped else None,
    }


def _build_loop(
    brief: WorkerBrief, cfg: TrainConfig, rank: int, world: int, device: str
) -> tuple[Loop, Any]:
    """Model, data, plan and trainer of this rank, ready to run; and the tokenizer."""
    from stages.train.data import read_rows, training_set
    from stages.train.heldout import HeldOut
    from stages.train.loop import Loop
    from stages.train.pairwise import HeldOutPairs, preference_pairs, reward_set
    from stages.train.threads import ThreadTuner

    reward = cfg.algorithm == "rm"
    tokenizer, model = _load(brief)
    sp = None
    if cfg.ring_attn_size > 1:  # ranks in groups that split each sequence
        from stages.lib.distributed import seqpar

        seqpar.check_heads(model.config, cfg.ring_attn_size, cfg.max_length)
        sp = seqpar.split_world(cfg.ring_attn_size, rank, world)
    rows = read_rows(str(cfg.input))
    if reward:
        pairs = preference_pairs(rows, cfg.margin, str(cfg.input))
        data = reward_set(pairs, tokenizer, cfg.max_length)
    else:
        data = training_set(
            rows, tokenizer, algorithm=cfg.algorithm, target=cfg.target, max_length=cfg.max_length
        )
    plan = plan_for(cfg, data, sp.dp_size if sp is not None else world)  # data-parallel ranks
    # a reward model's scores read the last non-pad token: its pads are the config's
    pad = int(model.config.pad_token_id) if reward else pad_id(tokenizer, model.config)
    held_out: HeldOut | HeldOutPairs | None = None
    if cfg.eval_input and reward:
        held_out = HeldOutPairs.held_out(cfg, tokenizer, pad, device)
    elif cfg.eval_input:
        held_out = HeldOut(cfg, tokenizer)
    reference = None
    if cfg.algorithm == "dpo" and cfg.lora is None:  # with LoRA: the base, adapters off
        reference = load_model(brief.model_dir, None).to(device).eval().requires_grad_(False)
    loop = Loop(
        cfg=cfg,
        trainer=make_trainer(brief.trainer, brief.ds_config, cfg, model, plan.total_steps, device),
        plan=plan,
        data=data,
        device=device,
        pad_id=pad,
        stage_dir=brief.stage_dir,
        rank=rank,
        world=world,
        reference=reference,
        resume_key=brief.resume_key,
        threads=ThreadTuner(brief.threads) if brief.tune_threads else None,
        held_out=held_out,
        sp=sp,
    )
    return loop, tokenizer


def run(brief: WorkerBrief) -> None:
    """Train one rank from its brief; see the module docstring."""
    import torch

    started = time.perf_counter()
    cfg = brief.config
    rank, world, device = start_rank(brief)
    _record_rank(brief.stage_dir, rank, world, device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    loop, tokenizer = _build_loop(brief, cfg, rank, world, device)
    resumed = _resume(loop, f"{brief.stage_dir}/checkpoints", rank)
    if rank == 0 and resumed is None:
        write_first_batch(loop, tokenizer, f"{brief.stage_dir}/{FIRST_BATCH}")
    log.info(
        "training %d %s on %d rank(s) with %s: %d steps (%d per epoch), ready in %.1fs",
        len(loop.data.units),
        "samples" if cfg.algorithm == "sft" else "pairs",
        world,
        loop.trainer.name,
        loop.plan.total_steps,
        loop.plan.steps_per_epoch,
        time.perf_counter() - started,
    )
    loop.run()
    from stages.train.pairwise import HeldOutPairs

    if isinstance(loop.held_out, HeldOutPairs) and loop.held_out.last:
        loop.held_out.write_scores(f"{brief.stage_dir}/{HELDOUT_SCORES}", rank, world)
    stats = None
    if cfg.algorithm == "rm":
        from stages.train.pairwise import final_stats

        stats = final_stats(loop, rank, world)
        log.info("reward statistics for normalize_reward: %s", stats)
    t = time.perf_counter()
    _save_final(loop.trainer, brief, rank, tokenizer, stats)
    log.info("wrote %s in %.2fs", cfg.output, time.perf_counter() - t)
    if rank == 0:
        with open(f"{brief.stage_dir}/train_result.json", "w", encoding="utf-8") as f:
            json.dump(_result(loop, resumed), f, indent=1)


def write_first_batch(loop: Loop, tokenizer: Any, path: str) -> None:
    """The first step's sequences, every rank's, as rendered text, ids and loss mask (DPO:
    chosen then rejected, `unit` the pair)."""
    if loop.plan.total_steps == 0:
        return
    rows = []
    for unit in loop.plan.step(0).units:
        for example in loop.data.units[unit]:
            ex = loop.data.examples[example]
            start = ex.prompt_len
            mask = [0] * (len(ex.input_ids) - start)
            for a, b in ex.trained():
                for i in range(max(a, start), b):
                    mask[i - start] = 1
            rows.append({"unit": unit, **token_record(tokenizer, ex.input_ids, start, mask)})
    if os.path.exists(path):
        os.remove(path)
    append_records(path, rows)


def _record_rank(stage_dir: str, rank: int, world: int, device: str) -> None:
    """What this rank was given, as it sees it: `<stage_dir>/ranks/rank-<r>.json`."""
    import socket

    from stages.lib.io.jsonl import write_json

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent()
    from stages.train.brief import WorkerBrief

    run(WorkerBrief.read(args[0]))
    leave_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
