"""The rl controller's start: the model, the roles' ranks, the engines and the first sync.

Input: a `Controller` just made (config, context, prompts, the roles' launcher). Output: the
controller holding its engine (local pool or vLLM servers) and weight-sync receiver, the
actor's ranks (and the critic's and reference's) started and connected, the settings
accounted for, the first weights synced; `start` returns the step to start after (a
checkpoint's on resume, else 0).
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

from stages.lib.distributed import resume
from stages.rl.controller.applied import account
from stages.rl.controller.records import resume_point
from stages.rl.roles.launch import host_of
from stages.rl.roles.layout import role_workers
from stages.rl.rollout.prompts import probe_ids

if TYPE_CHECKING:
    from stages.rl.controller.core import Controller

UNHASHED = ("save_steps", "eval_every", "eval_limit", "num_threads", "sync_timeout_s")


def init_model_dir(c: Controller) -> str:
    """The checkpoint folder every role and engine loads: `model` (a GGUF converted in the
    actor's compute dtype), or the tiny model built now; with `chat_template:`, a view of it
    rendering that template (`stages.lib.model.prepared`), which the saved checkpoint carries."""
    from stages.lib.model.prepared import compute_dtype, prepare_model, stage_template

    path = _model_source(c)
    template = stage_template(c.cfg)
    dtype = compute_dtype(c.cfg.bf16)
    return prepare_model(path, run_dir=c.ctx.run_dir, dtype=dtype, template=template, log=c.ctx.log)


def _model_source(c: Controller) -> str:
    if isinstance(c.cfg.model, str):
        return c.cfg.model
    path = f"{c.dir}/init_model"
    if not os.path.exists(f"{path}/config.json"):
        from stages.lib.builders.tiny import build_tiny_model
        from stages.lib.chat.prompt import as_messages

        texts: list[str] = []
        for p in c.data.prompts:
            texts += [p] if isinstance(p, str) else [m["content"] for m in as_messages(p)]
        texts += [str(r.get(answer_field(c.cfg), "")) for r in c.data.rows]
        build_tiny_model(c.cfg.model, texts, path, seed=c.cfg.seed)
    return path


def teacher_dir(c: Controller, model_dir: str) -> str | None:
    """The teacher's folder (a GGUF converted in the compute dtype), its tokenizer checked
    against the policy's folder `model_dir`: at plan where both were on disk, here for the
    rest (a tiny model built now, an earlier stage's output, a GGUF, a hub snapshot)."""
    from stages.lib.model.prepared import compute_dtype, prepare_model
    from stages.rl.algo.distill import teacher_tokenizer_error

    if c.cfg.teacher is None:
        return None
    dtype = compute_dtype(c.cfg.bf16)
    folder = prepare_model(
        c.cfg.teacher, run_dir=c.ctx.run_dir, dtype=dtype, template=None, log=c.ctx.log
    )
    why = teacher_tokenizer_error(model_dir, folder)
    if why is not None:
        raise ValueError(f"teacher '{c.cfg.teacher}': {why}")
    return folder


def answer_field(cfg: Any) -> str:
    """The rows' field holding a reference answer (the tiny model's tokenizer learns it, the
    probe ends with it): the verifier's, or `answer` when no verifier scores."""
    return cfg.verifier.answer_field if cfg.verifier is not None else "answer"


def _resume_key(c: Controller, world: int, trainer: str) -> str:
    """What a checkpoint must match to be resumed: the config (less `UNHASHED`), the
    inputs' versions, the actor's world size and trainer."""
    return resume.resume_key(c.cfg, UNHASHED, world, trainer)


def _resume(c: Controller, resume_key: str) -> tuple[str | None, int]:
    """The checkpoint tag to resume from and its step (None, 0: a fresh start)."""
    tag, step, version = resume_point(c.dir, resume_key, c.ctx.log)
    c.version = version if tag else c.version
    return tag, step


def start(c: Controller) -> int:
    """Build the engine, launch the actor, sync the first weights; the step to start at."""
    from stages.lib.distributed.ds_config import build_ds_config
    from stages.lib.distributed.trainer_choice import choose_trainer
    from stages.lib.model.dtypes import resolve_save_dtype
    from stages.rl.roles.brief import ActorBrief
    from stages.rl.roles.channel import StageEnd
    from stages.rl.rollout.local import LocalEngine
    from stages.rl.sync.transports import engine_autocast, make_receiver, sync_file, wire_dtype

    cfg = c.cfg
    model_dir = init_model_dir(c)
    device, world, _ = c.roles.devices("actor")
    trainer = choose_trainer(cfg)
    resume_key = _resume_key(c, world, trainer)
    tag, start = _resume(c, resume_key)
    c.resume_key = resume_key
    from stages.lib.devices import slow_bf16, torch_device
    from stages.lib.distributed.spawn import rank_table
    from stages.rl.sync.choice import choose_sync, shared_gpu

    engine_device = torch_device(c.ctx, "vllm")
    slow = slow_bf16(device, cfg.bf16)
    if slow is not None:
        c.ctx.log.warning("%s", slow)
    vllm = cfg.backend.RL_ENGINE == "servers"  # its servers take the weights
    rank0 = next(((r["worker"], r["device"]) for r in rank_table(c.ctx, "actor")), None)
    c.sync_choice = choose_sync(
        cfg.vllm_sync_backend,
        actor_gpu=device != "cpu",
        engine_gpu=engine_device.startswith("cuda"),
        shared_gpu=shared_gpu(rank0, c.ctx.slots),
    )
    c.sync_kind = sync = c.sync_choice.backend
    c.host = host_of(c.ctx)
    c.channel = StageEnd(c.host)
    sync_path = sync_file(c.dir)
    os.makedirs(os.path.dirname(sync_path), exist_ok=True)
    shutil.rmtree(f"{c.dir}/ranks", ignore_errors=True)  # each rank records itself anew
    engines = max(1, len(role_workers(c.ctx, "vllm")))  # local: one per worker of the role
    sync_world = 1 + engines
    c.receiver = (
        None
        if vllm
        else make_receiver(
            sync,
            "local-0",
            sync_path,
            cfg.sync_timeout_s,
            engine_device,
            host=c.host,
            world=sync_world,
            wire=wire_dtype(cfg.bf16, trainer),
        )
    )
    join = {  # what the engines of other workers need to join the sync
        "model_dir": model_dir,
        "kind": sync,
        "path": sync_path,
        "timeout_s": cfg.sync_timeout_s,
        "world": sync_world,
        "store": getattr(c.receiver, "address", ""),
    }
    from stages.rl.roles.frozen import RefRanks, in_actor

    ref_in_actor = cfg.kl_coef > 0 and in_actor(c.ctx.slots)
    teacher = teacher_dir(c, model_dir)
    teacher_in_actor = teacher is not None and in_actor(c.ctx.slots, "teacher")
    saved = resolve_save_dtype(cfg.save_dtype, model_dir)
    brief = ActorBrief(
        config=cfg,
        model_dir=model_dir,
        stage_dir=c.dir,
        device=device,
        trainer=trainer,
        ds_config=build_ds_config(cfg, world, pin_memory=device == "cuda", model_dir=model_dir)
        if trainer == "deepspeed"
        else None,
        threads=cfg.threads,
        channel=c.channel.address,
        authkey=c.channel.authkey.hex(),
        sync_backend=sync,
        sync_store=getattr(c.receiver, "address", ""),
        sync_world=sync_world,
        resume_tag=tag,
        total_updates=max(1, c.total * cfg.ppo_epochs),
        ref_in_actor=ref_in_actor,
        teacher_dir=teacher,
        teacher_in_actor=teacher_in_actor,
        save_dtype=saved[0],
    )
    c.actor_thread = c.roles.start("actor", brief, c.channel)
    if cfg.kl_coef > 0 and not ref_in_actor:  # started as the critic's ranks are
        c.ref = RefRanks(c.roles, c.host, brief, model_dir)
    if teacher is not None and not teacher_in_actor:  # its own ranks, as the reference's
        c.teacher = RefRanks(c.roles, c.host, brief, teacher, role="teacher")
    if cfg.reward_model is not None:  # its own ranks, on the reward role's devices
        from stages.rl.roles.reward import RewardRanks

        c.reward = RewardRanks(c.roles, c.host, brief, cfg.reward_model)
        c.ctx.log.info("the reward model reads %s: %s", c.reward.reading.mode, c.reward.reading.why)
    if cfg.algorithm == "ppo":  # the critic: its own ranks, on the critic role's devices
        c.critic = StageEnd(c.host)
        c_world = c.roles.devices("critic")[1]
        critic_brief = brief.model_copy(
            update={
                "channel": c.critic.address,
                "authkey": c.critic.authkey.hex(),
                "ds_config": build_ds_config(
                    cfg, c_world, pin_memory=device == "cuda", model_dir=model_dir
                )
                if trainer == "deepspeed"
                else None,
            }
        )
        c.critic_thread = c.roles.start("critic", critic_brief, c.critic)
    if vllm:
        c.engine = _vllm_engine(c, model_dir, sync_path)
    else:
        from stages.rl.rollout.pool import start_pool

        autocast = engine_autocast(cfg.bf16, trainer)
        local = LocalEngine(model_dir, engine_device, cfg.bf16, cfg.lora, autocast)
        c.engine = start_pool(c.ctx, local, join, c.roles.remote_alive)
    tok = c.engine.tokenizer
    if cfg.environment is not None and cfg.environment.agent_plays:
        from stages.rl.rollout.agent_play import start_agent
        from stages.rl.rollout.token_play import play_batch

        c.agent = start_agent(c.engine, cfg, c.dir, play_batch(cfg))
    row = c.data.rows[0]
    c.probe = probe_ids(tok, c.data.prompts[0], str(row.get(answer_field(cfg), "")))
    _account(c, trainer, device, world, saved)
    # the actor's optimizer states leave the GPU while the engine generates (sync steps)
    c.sleeps = cfg.deepspeed_enable_sleep and device == "cuda" and not cfg.async_train
    c.sync(c.version)  # the engine takes the actor's weights (a checkpoint's too)
    return start


def _vllm_engine(c: Controller, model_dir: str, sync_path: str) -> Any:
    from stages.rl.rollout.vllm import start_vllm
    from stages.rl.sync.vllm import VLLMDiskReceiver, VLLMGroupReceiver, VLLMLoraReceiver

    engine = start_vllm(c.cfg, c.ctx, model_dir, f"{c.dir}/vllm.log")
    try:
        if c.cfg.lora is not None:  # the adapters alone, through vLLM's LoRA support
            c.receiver = VLLMLoraReceiver(engine, os.path.dirname(sync_path))
        elif c.sync_kind == "disk":
            c.receiver = VLLMDiskReceiver(engine, sync_path)
        else:
            nccl = c.sync_kind == "nccl"
            c.receiver = VLLMGroupReceiver(engine, c.host, c.cfg.sync_timeout_s, nccl=nccl)
    except BaseException:
        engine.close()
        raise
    # the hybrid engine: vLLM's weights and KV cache leave the GPU while the actor trains
    c.engine_sleeps = engine.sleeping_allowed and not c.cfg.async_train
    return engine


def _account(c: Controller, trainer: str, device: str, world: int, saved: tuple[str, str]) -> None:
    c.how = account(
        c.cfg,
        trainer,
        device,
        world,
        c.sync_choice,
        c.engine.where,
        saved=saved,
        threads_how=c.threads_how,
    )
    if c.reward is not None:  # `auto` decided now, or as the plan derived it
        c.how["reward_sequences"] = ("applied", f"{c.reward.reading.mode}: {c.reward.reading.why}")
