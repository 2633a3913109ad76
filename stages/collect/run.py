"""The collect stage at run time: resume, collect, publish.

Input: a resolved CollectConfig (absolute `input` and `output`) and the
StageContext. Output: `cfg.output` (rollouts, or episodes with an environment, sorted
by prompt_idx, sample_idx), `<output>.failures.jsonl` when some rows failed for good,
and the metrics dict (its `sampling`: every sampling field each request of this run
carried, `stages.lib.api.sampling`; with a local backend, the precision its checkpoint was
loaded in, also in the stage's `settings.json`).

A GGUF model is converted and the stage's `chat_template:` applied before any request
(`stages.lib.model.prepared`): the backend loads or serves that folder.

`run_collect` publishes nothing until every pair is done, so it can be killed
and run again at any point: the rerun reads `<output>.partial`, skips the
pairs written, retries the failed ones (up to `max_failed_runs` runs) and goes
on. An existing `<output>` means the stage is complete: nothing to do. A
stage placed on several workers collects one shard per worker, each with the
vLLM engines of its own devices, and the first task merges them; without GPUs,
with `shards` > 1 inside a Dask worker, the range is split into shard tasks
(`stages.collect.shard`); one range is collected by `stages.collect.ranged`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from stages.collect.ranged import collect_range, up_to_date
from stages.lib.api.sampling import request_sampling

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.collect import CollectConfig


def run_collect(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    """Collect every (prompt, sample) pair of the configured range into cfg.output; with an
    environment, the task that publishes the output also sums up its episodes and fails the
    stage when too many failed (`stages.collect.multiturn.check_episodes`)."""
    if not os.path.exists(cfg.output):
        cfg = prepared(cfg, ctx.run_dir, ctx.log)
    metrics = _collect(cfg, ctx)
    from stages.collect.in_process import precision

    loaded = precision(cfg)
    if loaded is not None:  # the precision its checkpoint was loaded in
        from stages.lib.chat.clock import dated
        from stages.lib.io.jsonl import write_json

        dtype, why = loaded
        metrics["precision"] = {"dtype": dtype, "why": why}
        settings = {"backend.precision": metrics["precision"]}
        write_json(f"{ctx.stage_dir}/settings.json", {**settings, **dated(ctx)})
    if not metrics.get("up_to_date"):  # what every request carried; the local engine the same
        vllm = cfg.backend.VLLM_SAMPLING  # local: the same neutral rest
        metrics["sampling"] = request_sampling(cfg.temperature, cfg.top_p, vllm)
    if cfg.environment is not None and (ctx.link is None or ctx.node_rank == 0):
        from stages.collect.multiturn import check_episodes

        metrics["episodes"] = check_episodes(cfg.output, cfg.environment, ctx.log)
    return metrics


def prepared(cfg: CollectConfig, run_dir: str, log: logging.Logger) -> CollectConfig:
    """`cfg` with its backend's model as the folder the stage loads or serves: a GGUF
    converted, the stage's `chat_template:` applied (`stages.lib.model.prepared`); its
    engine's batch is the plan's (`micro_rollout_batch_size` derived into the block:
    `stages.lib.backends.rollout_batch`)."""
    from stages.lib.model.prepared import prepare_model, stage_template

    model = cfg.backend.model
    if cfg.backend.SERVES_OWN_MODEL or model is None:
        return cfg
    dtype, template = cfg.backend.gguf_dtype(), stage_template(cfg)
    folder = prepare_model(model, run_dir=run_dir, dtype=dtype, template=template, log=log)
    if folder == model:
        return cfg
    log.info("collect: %s is served from %s", model, folder)
    return cfg.model_copy(update={"backend": cfg.backend.serving(folder)})


def _collect(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    """The output, collected now or already complete: complete only when it was made with
    the settings that shape every rollout and the same range (`made_with`); an output made
    otherwise (the stage runs again because its config changed) is collected afresh."""
    from stages.collect import io

    stamp = made_with(cfg)
    if os.path.exists(cfg.output):
        if io.read_done(cfg.output) == stamp:
            return up_to_date(cfg.output, ctx)
        ctx.log.info("collect: %s was made with other settings; collecting it again", cfg.output)
        io.clear_output(cfg.output)
    metrics = _collect_now(cfg, ctx)
    io.write_done(cfg.output, stamp)
    return metrics


def made_with(cfg: CollectConfig) -> str:
    """What a complete output was made with: the settings that shape each rollout
    (`io.resume_key`) and its range."""
    from stages.collect import io

    return f"{io.resume_key(cfg)}:{cfg.start_idx}:{cfg.end_idx}:{cfg.limit}"


def _collect_now(cfg: CollectConfig, ctx: StageContext) -> dict[str, Any]:
    if ctx.link is not None:  # placed on several workers: a shard each, on their devices
        from stages.collect.shard import run_on_nodes

        return run_on_nodes(cfg, ctx)
    if ctx.slots:  # placed on one worker's devices: its engines serve the whole range
        return collect_range(cfg, ctx)
    shards = ctx.workers if cfg.shards == "auto" else cfg.shards
    if shards > 1:
        from stages.collect.shard import run_sharded
        from stages.lib.devices import in_dask_worker

        if in_dask_worker():
            return run_sharded(cfg, ctx, shards)
        ctx.log.info("collect: shards=%d, but not inside a Dask worker; one piece", shards)
    return collect_range(cfg, ctx)
