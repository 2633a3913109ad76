"""The rl stage's body: the controller. It owns the rollout engine and drives the actor.

Input: a resolved `RLConfig` (absolute `input`, `eval_input`, `model`, `output`) and the
`StageContext`. Output: the final checkpoint at `output`; in the stage's folder
`metrics.jsonl`, `rl.png`, `settings.json`, `checkpoints/` and the actor's log; the
metrics dict.

A step: the engine samples `rollout_batch_size` prompts x `num_repeats` with per-token
log-probabilities -> the verifier scores them -> group advantages (uniform groups
dropped) -> the actor's update -> the weights go to the engine (`stages.rl.sync`) and the
engine's probe must score like the actor's -> next step. With `async_train` the engine
samples batch k+1 with the previous weights while the actor trains on batch k (at most
`async_queue_size` batches ahead; 0 is the synchronous order). Every `save_steps` the
actor saves a checkpoint with the step and the weight version; a run started again
resumes from the last one (same config and inputs), the engine loading the actor's
weights before its first rollout.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from stages.lib.config import VLLMBackend
from stages.lib.jsonl import write_json
from stages.rl.data import Prompts, Stream, load_prompts, probe_ids
from stages.rl.layout import role_workers
from stages.rl.loop import Batch, run_steps
from stages.rl.records import fingerprint, plot, read_metrics, resume_point, write_settings
from stages.rl.roles import Roles, host_of
from stages.rl.settings import account

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

log = logging.getLogger("pipe.rl")
UNHASHED = ("save_steps", "eval_every", "eval_limit", "num_threads", "sync_timeout_s")


def run_rl(cfg: RLConfig, ctx: StageContext) -> dict[str, Any]:
    """Run the stage; see the module docstring. Its first task is the controller (with the
    engine); a task on another worker starts the ranks of the roles placed there."""
    if ctx.node_rank > 0:
        from stages.rl.remote import host_roles

        return host_roles(cfg, ctx)
    controller = Controller(cfg, ctx)
    try:
        return controller.run()
    finally:
        controller.close()


class Controller:
    """The engine, the actor's ranks and channel, and the loop over steps."""

    def __init__(self, cfg: RLConfig, ctx: StageContext) -> None:
        import torch

        from stages.lib.environment import environment_factory

        torch.set_num_threads(cfg.num_threads)
        self.cfg, self.ctx = cfg, ctx
        self.dir = ctx.stage_dir.rstrip("/")
        if not cfg.input:
            raise ValueError(
                "rl needs prompts: set 'input' or add the stage producing them to needs"
            )
        self.data = load_prompts(cfg.input)
        self.evals: Prompts | None = (
            load_prompts(cfg.eval_input, cfg.eval_limit) if cfg.eval_input else None
        )
        self.make_env = environment_factory(cfg.environment, cfg.verifier)
        self.stream = Stream(len(self.data.rows), cfg.rollout_batch_size, cfg.seed)
        self.total = cfg.max_steps or cfg.max_epochs * self.stream.steps_per_epoch
        self.how: dict[str, tuple[str, str]] = {}
        self.actor_thread: threading.Thread | None = None
        self.roles = Roles(cfg, ctx, self.dir)
        self.channel: Any = None
        self.critic: Any = None  # ppo: the critic's channel
        self.critic_thread: Any = None
        self.ref: Any = None  # kl_coef > 0, the ref role on devices of its own: its ranks
        self.engine: Any = None
        self.engine_sleeps = self.engine_asleep = False
        self.version = 0
        self.first_turn: float | None = None

    # --- preparation ----------------------------------------------------------------
    def _model_dir(self) -> str:
        if isinstance(self.cfg.model, str):
            return self.cfg.model
        path = f"{self.dir}/init_model"
        if not os.path.exists(f"{path}/config.json"):
            from stages.lib.model import build_tiny_model
            from stages.lib.prompt import as_messages

            texts: list[str] = []
            for p in self.data.prompts:
                texts += [p] if isinstance(p, str) else [m["content"] for m in as_messages(p)]
            texts += [str(r.get(self.cfg.verifier.answer_field, "")) for r in self.data.rows]
            build_tiny_model(self.cfg.model, texts, path, seed=self.cfg.seed)
        return path

    def _fingerprint(self, world: int, trainer: str) -> str:
        return fingerprint(self.cfg, world, trainer, UNHASHED)

    def _resume(self, fingerprint: str) -> tuple[str | None, int]:
        """The checkpoint tag to resume from and its step (None, 0: a fresh start)."""
        tag, step, version = resume_point(self.dir, fingerprint, self.ctx.log)
        self.version = version if tag else self.version
        return tag, step

    def _start(self) -> int:
        """Build the engine, launch the actor, sync the first weights; the step to start at."""
        from stages.lib.ds_config import build_ds_config
        from stages.rl.channel import StageEnd
        from stages.rl.engine import LocalEngine
        from stages.rl.spec import ActorSpec
        from stages.rl.sync import make_receiver, sync_file, wire_dtype

        cfg = self.cfg
        model_dir = self._model_dir()
        device, world, _ = self.roles.devices("actor")
        has_ds = importlib.util.find_spec("deepspeed") is not None
        trainer = (
            "deepspeed"
            if cfg.trainer == "deepspeed" or (cfg.trainer == "auto" and has_ds)
            else "torch"
        )
        fingerprint = self._fingerprint(world, trainer)
        tag, start = self._resume(fingerprint)
        self.fingerprint = fingerprint
        from stages.lib.devices import torch_device
        from stages.lib.launch import rank_table
        from stages.rl.sync_plan import choose_sync, shared_gpu

        engine_device = torch_device(self.ctx, "vllm")
        vllm = isinstance(cfg.backend, VLLMBackend)
        rank0 = next(((r["worker"], r["device"]) for r in rank_table(self.ctx, "actor")), None)
        self.sync_choice = choose_sync(
            cfg.vllm_sync_backend,
            actor_gpu=device != "cpu",
            engine_gpu=engine_device.startswith("cuda"),
            shared_gpu=shared_gpu(rank0, self.ctx.slots),
        )
        self.sync_kind = sync = self.sync_choice.backend
        self.host = host_of(self.ctx)
        self.channel = StageEnd(self.host)
        sync_path = sync_file(self.dir)
        os.makedirs(os.path.dirname(sync_path), exist_ok=True)
        shutil.rmtree(f"{self.dir}/ranks", ignore_errors=True)  # each rank records itself anew
        engines = max(1, len(role_workers(self.ctx, "vllm")))  # local: one per worker of the role
        sync_world = 1 + engines
        self.receiver: Any = (
            None
            if vllm
            else make_receiver(
                sync,
                "local-0",
                sync_path,
                cfg.sync_timeout_s,
                engine_device,
                host=self.host,
                world=sync_world,
                wire=wire_dtype(cfg.bf16),
            )
        )
        join = {  # what the engines of other workers need to join the sync
            "model_dir": model_dir,
            "kind": sync,
            "path": sync_path,
            "timeout_s": cfg.sync_timeout_s,
            "world": sync_world,
            "store": getattr(self.receiver, "address", ""),
        }
        from stages.rl.reference import RefRanks, in_actor

        ref_in_actor = cfg.kl_coef > 0 and in_actor(self.ctx.slots)
        spec = ActorSpec(
            config=cfg,
            model_dir=model_dir,
            stage_dir=self.dir,
            device=device,
            trainer=trainer,  # type: ignore[arg-type]
            ds_config=build_ds_config(cfg, world, pin_memory=device == "cuda", model_dir=model_dir)
            if trainer == "deepspeed"
            else None,
            threads=cfg.num_threads,
            channel=self.channel.address,
            authkey=self.channel.authkey.hex(),
            sync_backend=sync,
            sync_store=getattr(self.receiver, "address", ""),
            sync_world=sync_world,
            resume_tag=tag,
            total_updates=max(1, self.total * cfg.ppo_epochs),
            ref_in_actor=ref_in_actor,
        )
        self.actor_thread = self.roles.start("actor", spec, self.channel)
        if cfg.kl_coef > 0 and not ref_in_actor:  # started as the critic's ranks are
            self.ref = RefRanks(self.roles, self.host, spec, model_dir)
        if cfg.algorithm == "ppo":  # the critic: its own ranks, on the critic role's devices
            self.critic = StageEnd(self.host)
            c_world = self.roles.devices("critic")[1]
            critic_spec = spec.model_copy(
                update={
                    "channel": self.critic.address,
                    "authkey": self.critic.authkey.hex(),
                    "ds_config": build_ds_config(
                        cfg, c_world, pin_memory=device == "cuda", model_dir=model_dir
                    )
                    if trainer == "deepspeed"
                    else None,
                }
            )
            self.critic_thread = self.roles.start("critic", critic_spec, self.critic)
        if vllm:
            self.engine = self._vllm_engine(model_dir, sync_path)
        else:
            from stages.rl.engines import start_pool

            local = LocalEngine(model_dir, engine_device)
            self.engine = start_pool(self.ctx, local, join, self.roles.remote_alive)
        tok = self.engine.tokenizer
        row = self.data.rows[0]
        self.probe = probe_ids(
            tok, self.data.prompts[0], str(row.get(cfg.verifier.answer_field, ""))
        )
        self._account(trainer, device, world)
        # the actor's optimizer states leave the GPU while the engine generates (sync steps)
        self.sleeps = cfg.deepspeed_enable_sleep and device == "cuda" and not cfg.async_train
        self.sync(self.version)  # the engine takes the actor's weights (a checkpoint's too)
        return start

    def with_reference(self, samples: list[Any]) -> list[Any]:
        """`samples` with their reference log-probabilities from the ref role's own ranks;
        as they are when the reference loads inside the actor's."""
        return samples if self.ref is None else self.ref.score(samples)

    def _vllm_engine(self, model_dir: str, sync_path: str) -> Any:
        from stages.rl.vllm_engine import start_vllm
        from stages.rl.vllm_sync import VLLMDiskReceiver, VLLMGroupReceiver

        engine = start_vllm(self.cfg, self.ctx, model_dir, f"{self.dir}/vllm.log")
        try:
            self.receiver = (
                VLLMDiskReceiver(engine, sync_path)
                if self.sync_kind == "disk"
                else VLLMGroupReceiver(
                    engine, self.host, self.cfg.sync_timeout_s, nccl=self.sync_kind == "nccl"
                )
            )
        except BaseException:
            engine.close()
            raise
        # the hybrid engine: vLLM's weights and KV cache leave the GPU while the actor trains
        self.engine_sleeps = engine.sleeping_allowed and not self.cfg.async_train
        return engine

    def rest_engine(self) -> None:
        """Before the actor trains: a sleeping-mode engine gives its GPU memory back."""
        if self.engine_sleeps and not self.engine_asleep:
            self.engine.sleep()
            self.engine_asleep = True

    def actor_alive(self) -> bool:
        if self.actor_thread is None:
            return self.roles.remote_alive()
        return self.actor_thread.is_alive()

    def _account(self, trainer: str, device: str, world: int) -> None:
        self.how = account(self.cfg, trainer, device, world, self.sync_choice, self.engine.where)

    # --- the loop ---------------------------------------------------------------------
    def request(self, kind: str, payload: Any = None) -> Any:
        try:
            return self.channel.request(kind, payload, timeout_s=3600, alive=self.actor_alive)
        except Exception:
            if self.roles.errors:
                raise self.roles.errors[0] from None
            raise

    def generate(self, step: int) -> Batch:
        from stages.rl.rollout import rollout

        return rollout(self, step)

    def sync(self, version: int) -> dict[str, Any]:
        from stages.rl.logprobs import Sample
        from stages.rl.sync import verify

        start = time.perf_counter()
        probe = {"ids": self.probe[0], "prompt_len": self.probe[1]}
        self.channel.send("sync", {"probe": probe, **getattr(self.receiver, "group", {})})
        if self.engine_asleep:
            self.engine.wake("weights")
        pulls = getattr(self.receiver, "pulls", False)  # disk: read once the actor has written
        if not pulls:  # a process group receives while the actor sends
            self.engine.load(self.receiver)
        reply = self.channel.receive(
            "sync", timeout_s=self.cfg.sync_timeout_s, alive=self.actor_alive
        )
        if pulls:
            self.engine.load(self.receiver)
        if self.engine_asleep:
            self.engine.wake("kv_cache")
            self.engine_asleep = False
        precision = "bf16" if self.cfg.bf16 else "fp32"
        diff, mine = 0.0, []
        for name, mine in self.engine.scores(Sample(*self.probe)).items():  # every engine
            diff = max(diff, verify(name, mine, reply["probe"], precision, version))
        self.version = version
        got = getattr(self.receiver, "stats", {})
        return {
            "sync_s": time.perf_counter() - start,
            "sync_gather_s": reply.get("gather_s", 0.0),
            "sync_send_s": reply.get("send_s", 0.0),
            "sync_load_s": got.get("load_s", 0.0),
            "sync_bytes": int(reply.get("bytes", 0)),
            "probe_diff": diff,
            "probe_logprob": sum(mine),
        }

    def evaluate(self) -> float | None:
        from stages.rl.rollout import held_out

        return held_out(self) if self.evals is not None else None

    def run(self) -> dict[str, Any]:
        began = time.perf_counter()
        start = self._start()
        write_settings(f"{self.dir}/settings.json", self.cfg, self.how)
        first_eval = self.evaluate() if start == 0 else None
        first_turn_start = self.first_turn
        records = run_steps(self, start, first_eval)
        self.request("final")
        self.request("stop")
        if self.critic is not None:
            self.critic.request("stop", timeout_s=600, alive=self.actor_alive)
            if self.critic_thread is not None:
                self.critic_thread.join(timeout=120)
        if self.ref is not None:
            self.ref.stop()
        if self.actor_thread is not None:
            self.actor_thread.join(timeout=120)
        if self.roles.errors:
            raise self.roles.errors[0]
        every = read_metrics(f"{self.dir}/metrics.jsonl")
        title = f"{self.ctx.name}: {self.cfg.algorithm.upper()} reward and held-out accuracy"
        plot(every, f"{self.dir}/rl.png", title)
        evals = [r["eval_accuracy"] for r in every if r.get("eval_accuracy") is not None]
        out = {
            "steps": len(every),
            "resumed_from_step": start or None,
            "reward_first": every[0]["reward_mean"] if every else None,
            "reward_last": every[-1]["reward_mean"] if every else None,
            "eval_accuracy_start": first_eval
            if first_eval is not None
            else (evals[0] if evals else None),
            "eval_accuracy_end": evals[-1] if evals else None,
            "eval_first_turn_start": first_turn_start,  # beside them (multi-turn episodes)
            "eval_first_turn_end": self.first_turn,
            "seconds": round(time.perf_counter() - began, 2),
            "seconds_per_step": round(sum(r["step_s"] for r in records) / max(len(records), 1), 4),
            "sync_backend": self.sync_kind,
            "engines": self.engine.where,
            "ranks": self.roles.records(),
            "reference": ("ref role's ranks" if self.ref else "actor's ranks")
            if self.cfg.kl_coef > 0
            else None,
        }
        write_json(f"{self.dir}/rl_result.json", out)
        return out

    def save(self, step: int) -> None:
        state = {"step": step, "fingerprint": self.fingerprint, "version": self.version}
        tag = f"step_{step:08d}"
        if self.critic is not None:  # first: the actor's `latest` marks a complete checkpoint
            self.critic.request("save", {"tag": tag}, timeout_s=3600, alive=self.actor_alive)
        self.request("save", {"tag": tag, "state": state})

    def close(self) -> None:
        if self.ctx.link is not None and isinstance(self.cfg.backend, VLLMBackend):
            self.ctx.link.publish("vllm-stop", "1")  # the other workers' servers stop too
        if hasattr(self.engine, "close"):
            self.engine.close()  # vLLM servers stop with the stage, also when it fails
        for end in (self.channel, self.critic, self.ref and self.ref.end):
            if end is not None:
                end.close()
