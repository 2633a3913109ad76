"""One actor rank, run as its own process: `python -m stages.rl.roles.actor SPEC.json`.

Input: the `ActorSpec` (resolved `RLConfig`, model directory, trainer, ds_config, the
stage's channel and the weight-sync rendezvous) and the rank in the environment.
Output: answers to the stage's requests, in order: `train` (the clipped GRPO update over
a rollout batch, `ppo_epochs` passes, one optimizer step per `train_batch_size` samples;
returns its statistics), `sync` (publish the weights to the engine, then score the probe),
`probe`, `save` (a resumable checkpoint), `offload`/`reload` (the optimizer states, for
the hybrid engine), `final` (the Hugging Face checkpoint at `output`), `stop`.

Rank 0 talks to the stage and passes each request on to the other ranks (through the
rendezvous store, not a collective: they may wait for hours, `stages.lib.dist.serve`); every rank
trains on its share of each optimizer step's samples (gradients averaged by the
trainer), and per-token losses are divided by the step's token count over all ranks.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

from stages.lib.chat.tokens import pad_id
from stages.lib.dist.rank import (
    die_with_parent,
    exit_now,
    init_distributed,
    load_model,
    make_trainer,
    setup,
)

log = logging.getLogger("pipe.rl")


class Actor:
    """The model, its trainer and reference, and what each request does."""

    def __init__(self, spec: Any, rank: int, world: int, device: str) -> None:
        self.spec, self.cfg = spec, spec.config
        self.rank, self.world, self.device = rank, world, device
        model = load_model(spec.model_dir, spec.ds_config)
        self.pad_id = pad_id(None, model.config)
        self.trainer = make_trainer(
            spec.trainer, spec.ds_config, self.cfg, model, spec.total_updates, device
        )
        self.reference: Any = None  # here when the ref role has no devices of its own
        if self.cfg.kl_coef > 0 and spec.ref_in_actor:
            from stages.rl.roles.frozen import load_reference

            self.reference, self.ref_engine = load_reference(
                spec.model_dir, self.cfg.bf16, spec.ds_config, device
            )
            dtype = next(self.reference.parameters()).dtype
            log.info("frozen reference in the actor's ranks, %s", dtype)
        if spec.resume_tag:
            self.trainer.load(f"{spec.stage_dir}/checkpoints", spec.resume_tag)
            log.info("resumed the actor from %s", spec.resume_tag)
        self.publisher: Any = None
        self.pi_old: dict[int, Any] | None = None  # tis_cap: per sample, at the step's start

    # --- requests ----------------------------------------------------------------------
    def train(self, payload: dict[str, Any]) -> dict[str, float]:
        """`ppo_epochs` passes over the batch; one optimizer step per `train_batch_size`.
        Also the mismatch figure (`stages.rl.roles.proximal`): `|new - old|` on the loss's
        tokens of the first optimizer step, from its forward before the update (with
        `tis_cap`: over every sample, from the no-grad pass that gives the ratio its pi_old)."""
        from stages.rl.algo.logprobs import Sample
        from stages.rl.algo.micro import epoch_steps
        from stages.rl.algo.mismatch import Gap
        from stages.rl.roles.proximal import gap_figures, proximal

        samples = [Sample(**s) for s in payload["samples"]]
        rng = random.Random(self.cfg.seed * 1_000_003 + payload["step"])
        epochs = epoch_steps(samples, rng, self.cfg.ppo_epochs, self.cfg.train_batch_size)
        totals: dict[str, float] = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        tokens = updates = 0
        norms = []
        figures: dict[str, float] = {}
        self.pi_old = None
        if self.cfg.tis_cap is not None:
            self.pi_old, figures = proximal(self, samples, epochs[0], self._micros)
        for chunks in epochs:
            for chunk in chunks:
                gap = Gap() if updates == 0 and self.pi_old is None else None
                step_stats, norm = self._update(chunk, gap)
                if gap is not None:
                    figures = gap_figures(gap, self.world, self.device)
                for k, v in step_stats.items():
                    totals[k] += v
                tokens += sum(s.trained_len for s in chunk)
                updates += 1
                if norm is not None:
                    norms.append(norm)
        out = {k: v / max(tokens, 1) for k, v in totals.items()}
        out.update(updates=updates, tokens=tokens, lr=self.trainer.lr(), **figures)
        if norms:
            out["grad_norm"] = sum(norms) / len(norms)
        return out

    def _micros(self, chunk: list[Any]) -> list[list[Any]]:
        """This rank's micro batches of the step `chunk`, as many as every other rank's (an
        empty one is a dummy pass: `stages.rl.algo.micro`)."""
        from stages.rl.algo.micro import plan_micros

        size, dynamic = self.cfg.micro_train_batch_size, self.cfg.use_dynamic_batch
        return plan_micros(chunk, self.world, size, dynamic, self.cfg.packing_samples)[self.rank]

    def _update(self, chunk: list[Any], gap: Any = None) -> tuple[dict[str, float], float | None]:
        """One optimizer step over `chunk` (this rank takes every world-th sample, in as many
        forward/backward passes as every other rank); `gap`: adds up `|new - old|` of its
        tokens before the update."""
        import torch

        from stages.rl.algo.logprobs import completion_logprobs
        from stages.rl.algo.loss import masked_policy_terms, tis_weights, token_scale

        cfg = self.cfg
        norm = sum(s.trained_len for s in chunk)  # the step's trained tokens, over all ranks
        micros = self._micros(chunk)
        sums = torch.zeros(4, dtype=torch.float64)
        divisor = norm
        for i, planned in enumerate(micros):
            micro = planned or chunk[:1]  # a dummy pass keeps the ranks in step: weight 0
            lengths = [(s.completion_len, s.trained_len) for s in micro]
            per_token, divisor = token_scale(cfg.loss_agg, lengths, len(chunk), norm)
            weight = self.world / divisor if planned else 0.0
            self.trainer.begin_micro(i == len(micros) - 1)
            new, ent = completion_logprobs(
                self.trainer.module,
                micro,
                self.device,
                self.cfg.temperature,
                self.pad_id,
                True,
                self.trainer,  # the top-level forward: DeepSpeed's engine, or torch's autocast
                self.cfg.packing_samples,
            )
            new_t = torch.cat(new)
            old = torch.tensor([lp for s in micro for lp in s.old_logprobs], device=self.device)
            tis = None
            if self.pi_old is not None:  # the ratio against pi_old, weighted by pi_old / mu
                behaviour, old = old, torch.cat([self.pi_old[id(s)] for s in micro])
                tis = tis_weights(old, behaviour, self.cfg.tis_cap)
            adv = torch.tensor(
                [a for s in micro for a in (s.advantages or [s.advantage] * s.completion_len)],
                device=self.device,
            )
            # observation tokens of a multi-turn episode carry no loss and no KL
            mask = torch.tensor([m for s in micro for m in s.loss_mask()], device=self.device)
            # ppo and reinforce_pp: the KL is in the reward, not in the loss
            with_kl = (
                cfg.kl_coef > 0 and cfg.algorithm == "grpo" and cfg.advantage != "reinforce_pp"
            )
            ref = self._reference(micro) if with_kl else None
            if gap is not None and planned:
                gap.add(new_t, old, mask)
            scale = None if per_token is None else torch.tensor(per_token, device=self.device)
            seqs = [n for n, _ in lengths] if cfg.ratio_level == "sequence" else None  # GSPO
            loss, kl, clipped = masked_policy_terms(
                new_t, old, adv, mask, cfg.eps_clip, ref, cfg.kl_coef, tis,
                eps_clip_high=cfg.eps_clip_high, lengths=seqs, scale=scale,
            )  # fmt: skip
            self.trainer.backward(loss * weight)
            n = float(mask.sum()) if planned else 0.0
            sums += torch.tensor(
                [
                    loss.item() * (n > 0),
                    kl.item() * (n > 0),
                    clipped.item() * (n > 0),
                    float(ent or 0.0) * n,
                ],
                dtype=torch.float64,
            )
        grad_norm = self.trainer.step()
        if self.world > 1:  # NCCL reduces device tensors only
            import torch.distributed as dist

            reduced = sums.to(self.device)
            dist.all_reduce(reduced)
            sums = reduced.cpu()
        names = ("loss", "kl", "clip_frac", "entropy")
        stats = dict(zip(names, sums.tolist(), strict=True))
        stats["loss"] *= norm / divisor  # the step's objective x its tokens (train: / tokens)
        return stats, grad_norm

    def _reference(self, micro: list[Any]) -> Any:
        """The reference's log-probabilities of `micro`'s completion tokens, flat: sent with
        the samples (the ref role's own ranks scored them), or scored here."""
        import torch

        if all(s.ref_logprobs for s in micro):
            flat = [x for s in micro for x in s.ref_logprobs]
            return torch.tensor(flat, device=self.device)
        from stages.rl.algo.logprobs import completion_logprobs

        assert self.reference is not None, "no reference here and none sent with the samples"
        with torch.no_grad():  # one pass per micro batch, as the actor's own
            ref, _ = completion_logprobs(
                self.reference,
                micro,
                self.device,
                self.cfg.temperature,
                self.pad_id,
                packed=self.cfg.packing_samples,
            )
        return torch.cat(ref).float()

    def params(self) -> Iterator[tuple[str, Any]]:
        """The full parameters one at a time (under ZeRO-3 each is gathered on every rank for
        the moment it is sent, then released)."""
        zero3 = getattr(self.trainer, "zero3", False)
        for name, param in self.trainer.module.named_parameters():
            if not zero3:
                yield name, param.data
                continue
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.data

    def sync(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Publish the weights (rank 0 sends, every rank gathers), then score the probe."""
        from stages.rl.sync.transports import make_publisher, sync_file, tied_aliases, wire_dtype

        start = time.perf_counter()
        if self.rank == 0 and self.publisher is None:
            spec = self.spec
            self.publisher = make_publisher(  # vLLM's group: its address and size come now
                spec.sync_backend,
                payload.get("store") or spec.sync_store,
                sync_file(spec.stage_dir),
                spec.config.sync_timeout_s,
                payload.get("world") or spec.sync_world,
                wire_dtype(self.cfg.bf16),
                self.cfg.sync_bucket_mb,
            )
            self.publisher.aliases = tied_aliases(self.trainer.module)
        if self.rank == 0:
            self.publisher.publish(self.params(), self.shapes())
        else:
            for _ in self.params():  # take part in each gather
                pass
        probe = self.probe(payload["probe"])
        stats = self.publisher.stats if self.rank == 0 else {}
        return {"probe": probe, "seconds": time.perf_counter() - start, **stats}

    def shapes(self) -> list[tuple[str, list[int]]]:
        """Each parameter's full shape, in `params` order (ZeRO-3 keeps it as `ds_shape`)."""
        return [
            (name, list(getattr(p, "ds_shape", p.shape)))
            for name, p in self.trainer.module.named_parameters()
        ]

    def ref_logprobs(self, payload: dict[str, Any]) -> list[list[float]]:
        """The frozen reference's log-probabilities of each sample's completion, when it
        loads here (PPO's KL penalty in the reward); every rank scores every sample."""
        from stages.rl.algo.logprobs import Sample
        from stages.rl.roles.frozen import reference_logprobs

        assert self.reference is not None
        samples = [Sample(**s) for s in payload["samples"]]
        return reference_logprobs(self.reference, samples, self.device, self.cfg, self.pad_id)

    def probe(self, sample: dict[str, Any]) -> list[float]:
        import torch

        from stages.rl.algo.logprobs import Sample, completion_logprobs

        with torch.no_grad():
            lp, _ = completion_logprobs(
                self.trainer.module,
                [Sample(**sample)],
                self.device,
                1.0,  # the probe checks weights: the model's own distribution on both sides
                self.pad_id,
                call=self.trainer,
            )
        return [float(x) for x in lp[0]]

    def save(self, payload: dict[str, Any]) -> str:
        """A resumable checkpoint: the trainer's state, and (rank 0) the stage's cursor."""
        root = f"{self.spec.stage_dir}/checkpoints"
        tag = payload["tag"]
        self.trainer.save(root, tag)
        if self.rank == 0:
            from stages.lib.io.jsonl import atomic_write, write_json

            write_json(f"{root}/{tag}/rl_state.json", payload["state"])
            atomic_write(f"{root}/latest", tag)
        return f"{root}/{tag}"

    def final(self, payload: dict[str, Any]) -> str:
        """The Hugging Face checkpoint at `output` in the resolved save dtype, beside the
        input's files (written beside it, then renamed in: `stages.lib.model.save`)."""
        from stages.lib.model.save import write_checkpoint

        output = self.cfg.output
        state = self.trainer.full_state_dict()  # under ZeRO-3 on rank 0 only, module by module
        if self.rank == 0:
            write_checkpoint(
                self.trainer.module, state, self.spec.model_dir, output, self.spec.save_dtype
            )
        return str(output)

    def offload(self, payload: Any) -> str:
        """The optimizer side off the GPU while the engine generates (hybrid engine; how:
        `stages.lib.dist.sleep`); what moved."""
        return str(self.trainer.offload())

    def reload(self, payload: Any) -> str:
        """The optimizer side back on the GPU before the next update."""
        return str(self.trainer.reload())


def serve_with(handlers: dict[str, Any], world: int, conn: Any) -> None:
    """Answer requests with `handlers` until `stop`: rank 0 receives each and passes it on
    to the other ranks (through the store, not a collective: `stages.lib.dist.serve`), every rank
    runs it, rank 0 replies."""
    from stages.lib.dist.serve import Requests

    requests = Requests(world, conn)
    while True:
        kind, payload = requests.next()
        if kind == "stop":
            requests.read_by_all()
            if conn is not None:
                conn.send(("ok", None))
            return
        try:
            reply = handlers[kind](payload)
        except Exception as exc:
            if conn is not None:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        if conn is not None:
            conn.send(("ok", reply))


def run_role(
    argv: list[str] | None, logger: logging.Logger, build: Any, handlers: Any, seed_offset: int = 0
) -> int:
    """The body of an rl rank process (actor or critic): read the spec, set up the rank and
    its process group, `build(spec, rank, world, device)` the role, answer requests with
    `handlers(role)` until `stop`."""
    import torch

    from stages.rl.roles.channel import connect
    from stages.rl.roles.spec import ActorSpec

    args = sys.argv[1:] if argv is None else argv
    die_with_parent()
    spec = ActorSpec.read(args[0])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    setup(rank, spec.threads)
    device = f"cuda:{local}" if spec.device == "cuda" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(local)
    init_distributed(spec.trainer, device, world)
    from stages.rl.roles.launch import record_rank

    record_rank(spec.stage_dir, os.environ.get("PIPE_ROLE", "actor"), rank, world, device)
    random.seed(spec.config.seed + seed_offset)
    torch.manual_seed(spec.config.seed + seed_offset)
    role = build(spec, rank, world, device)
    conn = connect(spec.channel, spec.authkey) if rank == 0 else None
    what = role.trainer.name if hasattr(role, "trainer") else role.kind
    logger.info("ready: %d rank(s), %s, %s", world, what, device)
    serve_with(handlers(role), world, conn)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def handlers_of(actor: Actor) -> dict[str, Any]:
    return {
        "train": actor.train,
        "sync": actor.sync,
        "probe": actor.probe,
        "ref_logprobs": actor.ref_logprobs,
        "save": actor.save,
        "final": actor.final,
        "offload": actor.offload,
        "reload": actor.reload,
    }


if __name__ == "__main__":
    exit_now(run_role(None, log, Actor, handlers_of))
