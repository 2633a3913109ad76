"""One actor rank, run as its own process: `python -m stages.rl.roles.actor BRIEF.json`.

Input: the `ActorBrief` (resolved `RLConfig`, model directory, trainer, ds_config, the
stage's channel and the weight-sync rendezvous) and the rank in the environment.
Output: answers to the stage's requests, in order: `train` (the clipped GRPO update over
a rollout batch, `ppo_epochs` passes, one optimizer step per `train_batch_size` samples;
returns its statistics), `sync` (publish the weights to the engine, then score the probe),
`probe`, `save` (a resumable checkpoint), `offload`/`reload` (the optimizer states, for
the hybrid engine), `final` (the Hugging Face checkpoint at `output`), `stop`. With `lora` the
actor trains adapters on a frozen base (`stages.lib.model.lora`) and a sync sends the adapters
alone.

Rank 0 talks to the stage and passes each request on to the other ranks (through the
rendezvous store, not a collective: they may wait for hours, `stages.lib.distributed.serve`; the
process around the role: `stages.rl.roles.rank_process`); every rank trains on its share of
each optimizer step's samples (gradients averaged by the trainer), and per-token losses are
divided by the step's token count over all ranks (`stages.rl.roles.policy_update`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from stages.lib.distributed.rank import exit_now
from stages.lib.model.lora.wrap import load_trained
from stages.rl.roles.trained import TrainedRank

log = logging.getLogger("pipe.rl")


class Actor(TrainedRank):
    """The model, its trainer and reference, and what each request does."""

    def __init__(self, brief: Any, rank: int, world: int, device: str) -> None:
        cfg = brief.config
        model = load_trained(brief.model_dir, brief.ds_config, cfg.lora, cfg.bf16)
        super().__init__(brief, rank, world, device, model)
        self.reference: Any = None  # here when the ref role has no devices of its own
        if self.cfg.kl_coef > 0 and brief.ref_in_actor:
            from stages.rl.roles.frozen import load_reference

            self.reference, self.ref_engine = load_reference(
                brief.model_dir, self.cfg.bf16, brief.ds_config, device
            )
            dtype = next(self.reference.parameters()).dtype
            log.info("frozen reference in the actor's ranks, %s", dtype)
        self.teacher: Any = None  # here when the teacher role has no devices of its own
        if self.cfg.teacher is not None and brief.teacher_dir and brief.teacher_in_actor:
            from stages.rl.roles.frozen import load_reference

            self.teacher, self.teacher_engine = load_reference(
                brief.teacher_dir, self.cfg.bf16, brief.ds_config, device
            )
            dtype = next(self.teacher.parameters()).dtype
            log.info("frozen teacher in the actor's ranks, %s", dtype)
        if self.resume("checkpoints"):
            log.info("resumed the actor from %s", brief.resume_tag)
        self.publisher: Any = None
        # tis_mode: per sample, its log-probabilities at the step's start and its weights
        self.pi_old: dict[int, Any] | None = None

    # --- requests ----------------------------------------------------------------------
    def train(self, payload: dict[str, Any]) -> dict[str, float]:
        """The policy update over a rollout batch (`stages.rl.roles.policy_update`)."""
        from stages.rl.roles.policy_update import train

        return train(self, payload)

    def synced(self) -> list[tuple[str, Any]]:
        """What a sync sends: every parameter, or with LoRA the adapters alone (the engines
        hold the same frozen base)."""
        module = self.trainer.module
        if self.cfg.lora is not None:
            from stages.lib.model.lora.wrap import adapter_params

            return adapter_params(module)
        return list(module.named_parameters())

    def params(self) -> Iterator[tuple[str, Any]]:
        """The synced parameters one at a time (under ZeRO-3 each is gathered on every rank
        for the moment it is sent, then released)."""
        zero3 = getattr(self.trainer, "zero3", False)
        for name, param in self.synced():
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
        if "adapter_dir" in payload:  # LoRA into vLLM servers: the adapters as peft files
            return self._sync_adapter(payload, start)
        if self.rank == 0 and self.publisher is None:
            brief = self.brief
            self.publisher = make_publisher(  # vLLM's group: its address and size come now
                brief.sync_backend,
                payload.get("store") or brief.sync_store,
                sync_file(brief.stage_dir),
                brief.config.sync_timeout_s,
                payload.get("world") or brief.sync_world,
                wire_dtype(self.cfg.bf16, self.trainer.name),
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

    def _sync_adapter(self, payload: dict[str, Any], start: float) -> dict[str, Any]:
        """Rank 0 writes the adapters to the folder the servers load next
        (`stages.rl.sync.vllm.VLLMLoraReceiver`), then every rank scores the probe."""
        stats: dict[str, float] = {}
        if self.rank == 0:
            from stages.lib.model.lora.sync_writer import write_sync_adapter

            stats = write_sync_adapter(self.trainer.module, payload["adapter_dir"])
        probe = self.probe(payload["probe"])
        return {"probe": probe, "seconds": time.perf_counter() - start, **stats}

    def shapes(self) -> list[tuple[str, list[int]]]:
        """Each parameter's full shape, in `params` order (ZeRO-3 keeps it as `ds_shape`)."""
        return [(name, list(getattr(p, "ds_shape", p.shape))) for name, p in self.synced()]

    def ref_logprobs(self, payload: dict[str, Any]) -> list[list[float]]:
        """The frozen reference's log-probabilities of each sample's completion, when it
        loads here (PPO's KL penalty in the reward); every rank scores every sample."""
        from stages.rl.algo.logprobs import Sample
        from stages.rl.roles.frozen import reference_logprobs

        assert self.reference is not None
        samples = [Sample(**s) for s in payload["samples"]]
        return reference_logprobs(self.reference, samples, self.device, self.cfg, self.pad_id)

    def teacher_logprobs(self, payload: dict[str, Any]) -> list[list[float]]:
        """The frozen teacher's log-probabilities of each sample's completion, when it loads
        here (on-policy distillation); every rank scores every sample."""
        from stages.rl.algo.logprobs import Sample
        from stages.rl.roles.frozen import reference_logprobs

        assert self.teacher is not None
        samples = [Sample(**s) for s in payload["samples"]]
        return reference_logprobs(self.teacher, samples, self.device, self.cfg, self.pad_id)

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
        root = f"{self.brief.stage_dir}/checkpoints"
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
        from stages.lib.model.lora.output import write_output

        output, brief = self.cfg.output, self.brief
        state = self.trainer.full_state_dict()  # under ZeRO-3 on rank 0 only, module by module
        if self.rank == 0:
            module, lora = self.trainer.module, self.cfg.lora
            write_output(module, state, lora, brief.model_dir, output, brief.save_dtype)
        return str(output)


def handlers_of(actor: Actor) -> dict[str, Any]:
    return {
        "train": actor.train,
        "sync": actor.sync,
        "probe": actor.probe,
        "ref_logprobs": actor.ref_logprobs,
        "teacher_logprobs": actor.teacher_logprobs,
        "save": actor.save,
        "final": actor.final,
        "offload": actor.offload,
        "reload": actor.reload,
    }


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(run_role(None, log, Actor, handlers_of))
