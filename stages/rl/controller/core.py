"""The rl stage's controller: it owns the rollout engines and drives the trained roles.

Input: a resolved `RLConfig` (absolute `input`, `eval_input`, `model`, `output`) and the
`StageContext`. Output: through `run`, the final checkpoint at `output`; in the stage's
folder `metrics.jsonl`, `rl.png`, `settings.json`, `rl_result.json`, `checkpoints/` and the
roles' logs; the metrics dict.

A step: the engine samples `rollout_batch_size` prompts x `num_repeats` with per-token
log-probabilities -> the verifier (and the reward model's ranks) score them -> group
advantages (uniform groups dropped) -> the actor's update -> the weights go to the engine
(`stages.rl.sync`) and the engine's probe must score like the actor's -> next step. With
`async_train` the engine samples batch k+1 with the previous weights while the actor trains
on batch k (at most `async_queue_size` batches ahead; 0 is the synchronous order). Every
`save_steps` the actor saves a checkpoint with the step and the weight version; a run
started again resumes from the last one (same config and inputs), the engine loading the
actor's weights before its first rollout. It is started (model, ranks, engines, first sync)
by `stages.rl.controller.start`; the steps: `stages.rl.controller.loop`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from stages.lib.io.jsonl import write_json
from stages.rl.controller.loop import Batch, distill_ends, run_steps
from stages.rl.controller.records import plot, read_metrics, write_settings
from stages.rl.roles.launch import Roles
from stages.rl.rollout.prompts import Prompts, Stream, load_prompts

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig


def _agent_plays() -> Any:
    raise RuntimeError(
        "NeMo Gym's agent plays this stage's episodes (stages.rl.rollout.agent_play)"
    )


class Controller:
    """The engine, the actor's ranks and channel, and the loop over steps."""

    def __init__(self, cfg: RLConfig, ctx: StageContext, threads_how: str = "") -> None:
        import torch

        from stages.lib.env.contract import environment_factory

        torch.set_num_threads(cfg.threads)
        self.cfg, self.ctx = cfg, ctx
        self.threads_how = threads_how  # how `num_threads` was chosen (`stages.rl.run`)
        self.dir = ctx.stage_dir.rstrip("/")
        if not cfg.input:
            raise ValueError(
                "rl needs prompts: set 'input' or add the stage producing them to needs"
            )
        self.data = load_prompts(cfg.input)
        self.evals: Prompts | None = (
            load_prompts(cfg.eval_input, cfg.eval_limit) if cfg.eval_input else None
        )
        self.stream = Stream(len(self.data.rows), cfg.rollout_batch_size, cfg.seed)
        self.total = cfg.max_steps or cfg.max_epochs * self.stream.steps_per_epoch
        self.how: dict[str, tuple[str, str]] = {}
        self.actor_thread: threading.Thread | None = None
        self.roles = Roles(cfg, ctx, self.dir)
        self.channel: Any = None
        self.critic: Any = None  # ppo: the critic's channel
        self.critic_thread: Any = None
        self.ref: Any = None  # kl_coef > 0, the ref role on devices of its own: its ranks
        self.teacher: Any = None  # a teacher, the teacher role on devices of its own: its ranks
        self.reward: Any = None  # reward_model: the reward role's ranks (`RewardRanks`)
        self.engine: Any = None
        self.engine_sleeps = self.engine_asleep = False
        self.version = 0
        self.first_turn: float | None = None
        # set when it starts (`stages.rl.controller.start`)
        self.resume_key = ""
        self.sync_choice: Any = None  # a `SyncChoice`: the backend that runs, and why
        self.sync_kind = ""
        self.host = ""
        self.receiver: Any = None  # the engines' side of the weight sync
        self.probe: tuple[tuple[int, ...], int] = ((), 0)
        self.probe_scores: dict[str, list[float]] = {}  # each engine's, after the last sync
        self.sleeps = False  # the actor's optimizer states leave the GPU while engines generate
        self.agent: Any = None  # NeMo Gym's agent plays the episodes: its servers (`start`)
        # last: an environment served by a process starts here and stops in `close`
        env = cfg.environment
        self.make_env = (
            _agent_plays
            if env is not None and env.agent_plays
            else environment_factory(env, cfg.verifier, ctx.run_dir)
        )

    def with_reference(self, samples: list[Any]) -> list[Any]:
        """`samples` with their reference log-probabilities from the ref role's own ranks;
        as they are when the reference loads inside the actor's."""
        return samples if self.ref is None else self.ref.score(samples)

    def rest_engine(self) -> None:
        """Before the actor trains: a sleeping-mode engine gives its GPU memory back."""
        if self.engine_sleeps and not self.engine_asleep:
            self.engine.sleep()
            self.engine_asleep = True

    def actor_alive(self) -> bool:
        if self.actor_thread is None:
            return self.roles.remote_alive()
        return self.actor_thread.is_alive()

    # --- the loop ---------------------------------------------------------------------
    def request(self, kind: str, payload: Any = None) -> Any:
        try:
            return self.channel.request(kind, payload, timeout_s=3600, alive=self.actor_alive)
        except Exception:
            if self.roles.errors:
                raise self.roles.errors[0] from None
            raise

    def generate(self, step: int) -> Batch:
        from stages.rl.controller.batch import rollout

        return rollout(self, step)

    def sync(self, version: int) -> dict[str, Any]:
        from stages.rl.algo.logprobs import Sample
        from stages.rl.sync.transports import verify

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
        rule = self.engine.probe_rule
        diff, mine = 0.0, []
        for name, mine in self.engine.scores(Sample(*self.probe)).items():  # every engine
            before = self.probe_scores.get(name)
            diff = max(diff, verify(name, mine, reply["probe"], rule, version, before))
            self.probe_scores[name] = mine
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
        from stages.rl.controller.batch import held_out

        return held_out(self) if self.evals is not None else None

    def run(self, start: int, began: float) -> dict[str, Any]:
        """The steps after `start` (the controller started at `began`), then the records."""
        stops = getattr(self.engine, "stop_ids", [])
        write_settings(f"{self.dir}/settings.json", self.cfg, self.how, stops, self.ctx.date)
        first_eval = self.evaluate() if start == 0 else None
        if first_eval is not None:
            self.ctx.log.info("held-out accuracy before training: %.1f%%", 100 * first_eval)
        first_turn_start = self.first_turn
        records = run_steps(self, start, first_eval)
        self.request("final")
        self.request("stop")
        if self.critic is not None:
            self.critic.request("stop", timeout_s=600, alive=self.actor_alive)
            if self.critic_thread is not None:
                self.critic_thread.join(timeout=120)
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                frozen.stop()
        if self.reward is not None:
            self.reward.stop()
        if self.actor_thread is not None:
            self.actor_thread.join(timeout=120)
        if self.roles.errors:
            raise self.roles.errors[0]
        every = read_metrics(f"{self.dir}/metrics.jsonl")
        what = "reward model score" if self.cfg.reward_model is not None else "reward"
        title = f"{self.ctx.name}: {self.cfg.algorithm.upper()} {what} and held-out accuracy"
        plot(every, f"{self.dir}/rl.png", title, first_eval)
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
            "logprob_diff_warnings": sum(  # steps past logprob_diff_warn (each warned)
                (r.get("logprob_diff_max") or 0.0) > self.cfg.logprob_diff_warn for r in every
            ),
            "seconds": round(time.perf_counter() - began, 2),
            "seconds_per_step": round(sum(r["step_s"] for r in records) / max(len(records), 1), 4),
            "sync_backend": self.sync_kind,
            "engines": self.engine.where,
            "ranks": self.roles.records(),
            "reference": ("ref role's ranks" if self.ref else "actor's ranks")
            if self.cfg.kl_coef > 0
            else None,
            "teacher": ("teacher role's ranks" if self.teacher else "actor's ranks")
            if self.cfg.teacher is not None
            else None,
            **distill_ends(every),
        }
        write_json(f"{self.dir}/rl_result.json", out)
        return out

    def save(self, step: int) -> None:
        state = {
            "step": step,
            "resume_key": self.resume_key,
            "version": self.version,
        }
        tag = f"step_{step:08d}"
        if self.critic is not None:  # first: the actor's `latest` marks a complete checkpoint
            self.critic.request("save", {"tag": tag}, timeout_s=3600, alive=self.actor_alive)
        self.request("save", {"tag": tag, "state": state})

    def close(self) -> None:
        from stages.lib.env.contract import close_environments

        close_environments(self.make_env)
        if self.agent is not None:
            self.agent.close()  # NeMo Gym's servers, then the endpoint serving the engine
        if self.ctx.link is not None and self.cfg.backend.RL_ENGINE == "servers":
            self.ctx.link.publish("vllm-stop", "1")  # the other workers' servers stop too
        if hasattr(self.engine, "close"):
            self.engine.close()  # vLLM servers stop with the stage, also when it fails
        for end in (
            self.channel,
            self.critic,
            self.ref and self.ref.end,
            self.teacher and self.teacher.end,
            self.reward and self.reward.end,
        ):
            if end is not None:
                end.close()
