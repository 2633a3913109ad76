"""The rl stage's steps, synchronous or asynchronous, and what each records.

Input: a started `Controller` (engine, actor, channel) and the step to start after.
Output: one `metrics.jsonl` line per step, held-out accuracy every `eval_every` steps,
a few samples of step 1 and of every `log_samples_every`-th step in `samples.jsonl`, a
checkpoint every `save_steps`, a progress line per step (with its rate).

Order of a step, synchronous: train on batch k -> sync (weights version k) -> sample
batch k+1. Asynchronous (`async_train`, `async_queue_size` q > 0): the actor gets batch
k, and while it trains the engine samples up to q batches ahead with the weights it has
(version k-1); then the sync. A batch records the version that sampled it and its
staleness (updates between that version and the one it trains); with q = 0 the order is
exactly the synchronous one.

One name, two sides of one concept (a kind's step loop: one train rank's; this file: the rl
controller's; `stages/train/loop.py` the other side).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from stages.lib.io.audit import SAMPLES, append_records
from stages.rl.controller.records import append_metrics, logs_samples, sample_records

SYNC_PARTS = ("sync_gather_s", "sync_send_s", "sync_load_s")  # the sync's parts, per step
ENGINE_FIELDS = ("in_flight", "in_flight_peak", "parallel_limit", "queue_wait_s")
# the mismatch figures (`stages.rl.algo.mismatch`), every step; with tis_mode, the weights
MISMATCH_FIELDS = (
    "logprob_diff_mean",
    "logprob_diff_max",
    "mismatch_k3",
    "mismatch_chi2_token",
    "mismatch_chi2_seq",
    "mismatch_ppl_ratio",
    "mismatch_masked_token_frac",
    "mismatch_masked_seq_frac",
    "tis_weight_mean",
    "tis_capped_frac",
)
# on-policy distillation (`stages.rl.algo.distill`): the reverse KL per token to the teacher
# and the teacher's mean log-probability of the sampled tokens, every step with a teacher
DISTILL_FIELDS = ("distill_reverse_kl", "teacher_logprob_mean")

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig
    from stages.rl.algo.logprobs import Sample
    from stages.rl.roles.channel import StageEnd


@dataclass
class Batch:
    """A generated rollout batch, ready for the actor."""

    step: int
    indices: list[int]
    samples: list[Sample]
    rewards: list[list[float]]
    kept: int
    gen_s: float
    version: int
    tokens: int
    engine: dict[str, Any] = field(default_factory=dict)  # vLLM: in flight, queue wait
    turns: float = 1.0  # mean model turns per episode
    failed: int = 0  # episodes the environment broke
    solved: float = 0.0  # share of episodes with a turn earning the full reward
    rounds: int = 1  # generation rounds (dynamic sampling's refills after the first)
    overlong: float | None = None  # overlong_buffer: the mean penalty over the batch's answers
    trained: list[list[float]] | None = None  # reward_model: each group's rewards as trained
    scores: list[float] = field(default_factory=list)  # reward_model: its raw scores


class Controller(Protocol):
    """What the steps need of the stage's controller (`stages.rl.run.Controller`)."""

    cfg: RLConfig
    ctx: StageContext
    dir: str
    total: int
    version: int
    first_turn: float | None  # the latest held-out evaluation's first-turn share
    sleeps: bool
    channel: StageEnd
    critic: StageEnd | None
    teacher: Any  # the teacher role's own ranks (`RefRanks`), or None
    engine: Any  # its `tokenizer` renders the logged samples

    def generate(self, step: int) -> Batch: ...
    def sync(self, version: int) -> dict[str, Any]: ...
    def evaluate(self) -> float | None: ...
    def request(self, kind: str, payload: Any = None) -> Any: ...
    def with_reference(self, samples: list[Sample]) -> list[Sample]: ...
    def actor_alive(self) -> bool: ...
    def rest_engine(self) -> None: ...
    def save(self, step: int) -> None: ...


def run_steps(c: Controller, start: int, first_eval: float | None) -> list[dict[str, Any]]:
    """Steps start+1 .. c.total; returns their records."""
    cfg = c.cfg
    ahead = cfg.async_queue_size if cfg.async_train else 0
    records: list[dict[str, Any]] = []
    if start >= c.total:
        return records
    # the hybrid engine, in the order the memory plan counts: the trained roles' optimizer
    # states are off the GPU whenever the engine holds its memory (weights and KV cache),
    # and the engine sleeps before they come back: offload -> [engine wakes] sync -> generate
    # -> engine sleeps -> reload -> train -> offload -> ...
    if c.sleeps:
        trained_states(c, "offload")
    queue: deque[Batch] = deque([c.generate(start + 1)])
    held_out = first_eval
    step = start
    while step < c.total:
        step += 1
        began = time.perf_counter()
        batch = queue.popleft()
        stats: dict[str, Any] = {}
        stale = c.version - batch.version  # updates since the weights that sampled it
        sync = {"sync_s": 0.0, "probe_diff": 0.0, "probe_logprob": None}
        train_s = 0.0
        distilled: dict[str, Any] = {}
        if batch.samples:
            t = time.perf_counter()
            c.rest_engine()  # the hybrid engine: vLLM sleeps while the actor trains
            if c.sleeps:  # and the actor's and critic's optimizer states come back to the GPU
                trained_states(c, "reload")
            if cfg.kl_coef > 0:  # the ref role's ranks score the batch (when it has its own)
                batch.samples = c.with_reference(batch.samples)
            if cfg.teacher is not None:  # the teacher scores every sampled token
                from stages.rl.algo.distill import distil

                batch.samples, distilled = distil(c, batch.samples)
            if cfg.algorithm == "ppo":
                from stages.rl.algo.ppo import ppo_samples

                batch.samples = ppo_samples(c, batch.samples)
            elif cfg.advantage == "reinforce_pp":
                from stages.rl.algo.advantage import reinforce_pp_samples

                batch.samples = reinforce_pp_samples(c, batch.samples)
            if logs_samples(step, cfg.log_samples_every):
                rows = sample_records(step, batch.samples, c.engine.tokenizer)
                append_records(f"{c.dir}/{SAMPLES}", rows)
            payload = {"step": step, "samples": [asdict(s) for s in batch.samples]}
            c.channel.send("train", payload)
            if c.critic is not None:  # actor and critic train at the same time
                c.critic.send("train", payload)
            while len(queue) < ahead and step + len(queue) < c.total:
                queue.append(c.generate(step + len(queue) + 1))  # with the weights it has
            stats = c.channel.receive("train", timeout_s=3600, alive=c.actor_alive)
            if c.critic is not None:
                stats |= c.critic.receive("train", timeout_s=3600, alive=c.actor_alive)
            train_s = time.perf_counter() - t
            if c.sleeps:  # off the GPU before the engine wakes (weights, then KV cache) to sync
                trained_states(c, "offload")
            sync = c.sync(c.version + 1)
        if not queue and step < c.total:
            queue.append(c.generate(step + 1))
        if step % cfg.eval_every == 0 or step == c.total:
            held_out = c.evaluate()
        row = _row(
            stale,
            c,
            batch,
            stats | distilled,
            sync,
            train_s,
            held_out if step % cfg.eval_every == 0 or step == c.total else None,
        )
        row["step_s"] = round(time.perf_counter() - began, 4)  # train, sync and one generation
        append_metrics(f"{c.dir}/metrics.jsonl", row)
        records.append(row)
        _progress(c, row)
        _warn_mismatch(c, row)
        if step % cfg.save_steps == 0 and step < c.total:
            c.save(step)
    c.save(c.total)
    return records


def trained_states(c: Controller, kind: str) -> None:
    """The hybrid engine: `offload` the actor's and the critic's optimizer states from the
    GPU, or `reload` them; both roles at once, each answering when its ranks are done."""
    if c.critic is not None:
        c.critic.send(kind)
    c.request(kind)
    if c.critic is not None:
        c.critic.receive(kind, timeout_s=600, alive=c.actor_alive)


def _row(
    stale: int,
    c: Controller,
    batch: Batch,
    stats: dict[str, Any],
    sync: dict[str, Any],
    train_s: float,
    held_out: float | None,
) -> dict[str, Any]:
    flat = [r for group in batch.rewards for r in group]  # the verifier's (episodes' totals)
    trained = flat if batch.trained is None else [r for g in batch.trained for r in g]
    groups = len(batch.rewards)
    verified = c.cfg.verifier is not None or c.cfg.environment is not None
    lengths = [s.completion_len for s in batch.samples]
    return {
        "step": batch.step,
        "version": batch.version,
        "staleness": stale,
        "prompts": batch.indices,
        "reward_mean": sum(trained) / len(trained) if trained else 0.0,
        "reward_std": statistics.pstdev(trained) if len(trained) > 1 else 0.0,
        "accuracy": (sum(r >= 1.0 for r in flat) / len(flat) if flat else 0.0)
        if verified
        else None,
        # reward_model: its scores before normalize_reward and reward_clip
        "rm_score_mean": sum(batch.scores) / len(batch.scores) if batch.scores else None,
        "rm_score_std": statistics.pstdev(batch.scores) if batch.scores else None,
        "solved": round(batch.solved, 4),
        "turns_mean": round(batch.turns, 3),
        "episodes_failed": batch.failed,
        "groups_kept": batch.kept,
        "groups_dropped_frac": 1 - batch.kept / groups if groups else 0.0,
        "prompts_drawn": len(batch.indices),  # dynamic sampling: the step's and its refills
        "gen_rounds": batch.rounds,
        "overlong_penalty_mean": batch.overlong,
        "samples_trained": len(batch.samples),
        "response_len": sum(lengths) / len(lengths) if lengths else 0.0,
        "loss": stats.get("loss"),
        "kl": stats.get("kl"),
        "entropy": stats.get("entropy"),
        "clip_frac": stats.get("clip_frac"),
        "grad_norm": stats.get("grad_norm"),
        "value_loss": stats.get("value_loss"),
        # the engine's log-probabilities against the actor's before the step's first update
        **{k: stats.get(k) for k in MISMATCH_FIELDS},
        **{k: stats.get(k) for k in DISTILL_FIELDS},
        "updates": stats.get("updates", 0),
        "gen_s": round(batch.gen_s, 4),
        "train_s": round(train_s, 4),
        "sync_s": round(sync["sync_s"], 4),
        **{k: round(sync.get(k, 0.0), 4) for k in SYNC_PARTS},
        "sync_bytes": int(sync.get("sync_bytes", 0)),
        "probe_diff": sync["probe_diff"],
        "probe_logprob": sync["probe_logprob"],  # the engine's, after the sync
        "tokens_generated": batch.tokens,  # every round's, dropped groups' included: the cost
        "tokens_per_s": round(batch.tokens / max(batch.gen_s, 1e-9), 1),
        # vLLM engines: requests in flight (mean, peak, the bound), the servers' queue wait
        **{k: batch.engine.get(k) for k in ENGINE_FIELDS},
        "eval_accuracy": held_out,
        "eval_first_turn": c.first_turn if held_out is not None else None,
    }


def distill_ends(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and last steps' reverse KL per token to the teacher (rl_result.json, the
    headline); nothing without a teacher."""
    kl = [r["distill_reverse_kl"] for r in rows if r.get("distill_reverse_kl") is not None]
    if not kl:
        return {}
    return {"distill_reverse_kl_first": kl[0], "distill_reverse_kl_last": kl[-1]}


def _warn_mismatch(c: Controller, row: dict[str, Any]) -> None:
    """Once per step whose largest difference passes `logprob_diff_warn`."""
    top = row["logprob_diff_max"]
    if top is None or top <= c.cfg.logprob_diff_warn:
        return
    c.ctx.log.warning(
        "step %d: the engine's log-probability of a sampled token differs from the actor's by "
        "%.3g nats (mean %.3g, logprob_diff_warn %g, staleness %d): the rollouts are not the "
        "policy the loss trains; check the engine's precision and temperature, or set tis_mode",
        row["step"],
        top,
        row["logprob_diff_mean"],
        c.cfg.logprob_diff_warn,
        row["staleness"],
    )


def _progress(c: Controller, row: dict[str, Any]) -> None:
    held = f", held-out {row['eval_accuracy']:.1%}" if row["eval_accuracy"] is not None else ""
    if row["logprob_diff_max"] is not None:
        held += f", logprob diff {row['logprob_diff_mean']:.2g} (max {row['logprob_diff_max']:.2g})"
    if row["distill_reverse_kl"] is not None:
        held += f", reverse KL to the teacher {row['distill_reverse_kl']:.3g}"
    if row["in_flight"] is not None:
        held += f", in flight {row['in_flight']:.0f} (peak {row['in_flight_peak']})"
    accuracy = f"{row['accuracy']:.1%}" if row["accuracy"] is not None else "-"
    c.ctx.log.info(
        "step %d/%d: reward %.3f, accuracy %s, %d/%d groups kept | gen %.2f s (%.0f tokens/s), "
        "train %.2f s, sync %.3f s, staleness %d%s",
        row["step"],
        c.total,
        row["reward_mean"],
        accuracy,
        row["groups_kept"],
        len(row["prompts"]),
        row["gen_s"],
        row["tokens_per_s"],
        row["train_s"],
        row["sync_s"],
        row["staleness"],
        held,
    )
