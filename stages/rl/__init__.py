"""rl: online RL (GRPO) with placed roles, live weight sync to the rollout engine.

The config model, its registration and its rules; the body (`stages.rl.run`) and the
actor ranks (`stages.rl.roles.actor`) are imported only when a stage runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, MemoryNeed, ResolveContext, stage
from stages.lib.block import CountOrAuto
from stages.lib.build.recipe import TinyModel
from stages.lib.config import (
    Backend,
    LocalBackend,
    Verifier,
    VLLMBackend,
    backend_gpu_unit,
    backend_memory,
    backend_preset_path,
    check_backend,
    check_verifier,
    derive_backend,
)
from stages.lib.dist.ds_config import check_deepspeed, trainer_memory, trainer_memory_changes
from stages.lib.env.field import EnvironmentConfig, check_environment
from stages.lib.model.declared import ModelRef
from stages.lib.model.dtypes import SAVE_DTYPE_HELP, Dtype
from stages.lib.model.path import check_model_ref
from stages.rl.algo.options import AlgorithmOptions, check_algorithm


class RLConfig(AlgorithmOptions):
    """Online RL: sample groups from the engine, score them, update the actor, sync weights."""

    SPANS_NODES = True  # the controller on the engine's worker; other roles where placed
    INPUTS = ("input", "eval_input", "model")
    MODEL_INPUTS = ("model",)
    OUTPUTS = ("output",)
    OUTPUT_TYPES: ClassVar[dict[str, str]] = {"output": "checkpoint"}
    REFUSED_ROLES: ClassVar[dict[str, str]] = {
        "reward": "it has no reward model; its rewards come from 'verifier' (reasoning_gym, "
        "exact_match, regex, math, or your own 'module:function'): leave 'reward' out",
    }

    input: str | None = Field(
        None,
        description="Prompt JSONL (rows with messages or prompt); empty: the upstream's output.",
    )
    eval_input: str | None = Field(
        None, description="Held-out prompt JSONL scored greedily every eval_every steps."
    )
    output: str = Field("checkpoint", description="The final checkpoint directory written.")
    model: ModelRef = Field(
        default_factory=TinyModel,
        description="The policy to start from: a checkpoint directory, '@stage', a hub id, or a tiny model spec.",
    )
    verifier: Verifier = Field(default_factory=Verifier, description="How answers are scored.")
    environment: EnvironmentConfig | None = Field(
        None,
        description="A multi-turn environment each episode talks to (README, Environments); none: one turn scored by the verifier.",
    )
    backend: Backend = Field(
        default_factory=lambda: LocalBackend(kind="local", batch_size=256),
        description="The rollout engine: local (in the stage's process) or vllm (servers on the vllm role's devices); weights synced from the actor.",
    )
    num_repeats: int = Field(8, ge=2, description="Samples per prompt: the group size.")
    rollout_batch_size: int = Field(32, gt=0, description="Prompts per step.")
    num_samples_in_parallel: CountOrAuto = Field(
        "auto",
        description="vLLM engines: sample requests in flight at once (all of a step's submitted together), or auto to find and track the engines' knee, as collect does; the local engine generates a step in one batched call.",
    )
    train_batch_size: int = Field(
        256,
        gt=0,
        description="Samples per optimizer step (a step's kept samples, cut in pieces of this).",
    )
    micro_train_batch_size: int = Field(64, gt=0, description="Samples per rank per forward pass.")
    learning_rate: float = Field(1e-4, gt=0, description="Actor learning rate.")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule over the run's optimizer steps."
    )
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Fraction of updates warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_steps: int | None = Field(
        100,
        gt=0,
        description="RL steps (rollout, update, sync); empty: max_epochs over the prompts.",
    )
    max_epochs: int = Field(1, gt=0, description="Passes over the prompts when max_steps is empty.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    max_output_tokens: int = Field(256, gt=0, description="Most tokens per answer.")
    max_length: int = Field(512, gt=0, description="Longest prompt + answer trained on, in tokens.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: discount.")
    lambd: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")
    async_train: bool = Field(
        False,
        description="Generate batch k+1 with the previous weights while the actor trains on batch k.",
    )
    async_queue_size: int = Field(
        1, ge=0, description="async: rollout batches in flight at most (0: synchronous)."
    )
    save_steps: int = Field(
        50, gt=0, description="Save a resumable checkpoint every this many steps."
    )
    eval_every: int = Field(
        20, gt=0, description="Score eval_input every this many steps (and at the end)."
    )
    eval_limit: int | None = Field(500, gt=0, description="Held-out prompts scored at most.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage of the actor.")
    adam_offload: bool = Field(False, description="Offload Adam states to CPU memory (ZeRO).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    packing_samples: bool = Field(
        False, description="Pack samples into rows (no padding); rl records it as not applied yet."
    )
    use_dynamic_batch: bool = Field(
        False, description="Form micro batches by a token budget instead of a sample count."
    )
    overlap_comm: bool = Field(
        False, description="Overlap gradient communication with backward (ZeRO)."
    )
    deepspeed_enable_sleep: bool = Field(
        False,
        description="Move the actor's and critic's optimizer states off the GPU while the engine generates (synchronous steps on GPU).",
    )
    bf16: bool = Field(False, description="Train in bfloat16 (fp32 otherwise).")
    save_dtype: Dtype = Field("auto", description=SAVE_DTYPE_HELP)
    vllm_sync_backend: Literal["nccl", "gloo", "disk"] = Field(
        "gloo",
        description="How weights reach the engine: nccl (GPUs), gloo (a process group, CPU too) or disk (safetensors).",
    )
    sync_timeout_s: float = Field(
        120.0, gt=0, description="A weight sync taking longer fails the step."
    )
    sync_bucket_mb: int = Field(
        256,
        gt=0,
        description="Weights travel to the engines (nccl, gloo) in buckets of this many MiB: the sending rank holds one bucket beyond its own shard.",
    )
    num_processes: int = Field(
        1, gt=0, description="Actor ranks on CPU (on GPU: one per actor GPU)."
    )
    num_threads: int = Field(
        1, gt=0, description="Torch threads of each actor rank and of the engine."
    )
    trainer: Literal["auto", "deepspeed", "torch"] = Field(
        "auto", description="auto: DeepSpeed when installed, plain torch otherwise."
    )
    logprob_diff_warn: float = Field(
        0.5,
        gt=0,
        description="Warn when the engine's log-probability of a sampled token differs from the actor's (before the step's first update) by more than this many nats: the rollouts are then not the policy the loss trains (metrics: logprob_diff_mean, logprob_diff_max).",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling, for engines that differ from the actor by design (bf16, other kernels): the ratio taken against the actor's own log-probabilities at the step's start, each token's loss weighted by min(exp(actor - engine), tis_cap), as verl's tis_imp_ratio_cap; empty: off.",
    )

    @classmethod
    def roles_used(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        """The rollout engines and the actor; the reference when kl_coef > 0."""
        kl = data.get("kl_coef", 0.0)
        ref = ("ref",) if isinstance(kl, int | float) and kl > 0 else ()
        critic = ("critic",) if data.get("algorithm") == "ppo" else ()
        return ("vllm", "actor", *ref, *critic)

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        return super().preset_path(key, data) or backend_preset_path(key, data)

    def gpu_unit(self, role: str | None = None) -> int:
        """A vLLM engine's tensor-parallel group stays on one node; trained roles place by GPU."""
        return backend_gpu_unit(self.backend) if role == "vllm" else 1

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Reward and held-out accuracy, first -> last."""
        if not result.get("steps"):
            return []

        def arrow(a: Any, b: Any, fmt: str) -> str:
            return f"{format(a, fmt) if a is not None else '-'} -> {format(b, fmt) if b is not None else '-'}"

        line = f"reward {arrow(result.get('reward_first'), result.get('reward_last'), '.3f')}"
        start, end = result.get("eval_accuracy_start"), result.get("eval_accuracy_end")
        if start is not None or end is not None:
            line += f", held-out accuracy {arrow(start, end, '.1%')}"
        return [f"{line} over {result['steps']} steps"]

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        """The vLLM engines from the `vllm` role's GPUs (engines x tensor-parallel size = the
        role's GPUs), prefix caching for groups, half a shared GPU left to training."""
        return derive_backend(self.backend, engine_context(ctx), self.num_repeats)

    def memory_needs(self) -> list[MemoryNeed]:
        """The engine (a vLLM share, or the local engine's copy of the weights), the actor as a
        trainer, and the frozen reference when kl_coef > 0: in the compute dtype, split by
        ZeRO-3 under DeepSpeed, on the ref role's devices or, when that role has none of its
        own, inside the actor's ranks (`stages.rl.roles.frozen`; colocated with the actor, the two
        share devices and are summed there)."""
        model = self.model if isinstance(self.model, str) else self.model.model_dump()
        engines = [replace(n, role="vllm") for n in backend_memory(self.backend)]
        if not engines:
            engines = [MemoryNeed(role="vllm", profile="frozen", model=model, bf16=self.bf16)]
        needs = [*engines, trainer_memory(self, self.model, self.max_length, role="actor")]
        if self.kl_coef > 0:
            zero = self.zero_stage if self.trainer != "torch" else 0
            ref = MemoryNeed(
                "ref", "frozen", model, zero_stage=zero, bf16=self.bf16, inside="actor"
            )
            needs.append(ref)
        if self.algorithm == "ppo":
            needs.append(trainer_memory(self, self.model, self.max_length, role="critic"))
        return needs

    def memory_changes(self) -> list[tuple[str, Any]]:
        return trainer_memory_changes(self)

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        out = check_deepspeed(self, ctx, self.num_processes)
        out += check_backend(self.backend, engine_context(ctx))
        out += check_model_ref(ctx, "model", self.model)
        out += check_algorithm(self, ctx, self.environment is not None)
        if not isinstance(self.backend, LocalBackend | VLLMBackend):
            out.append(
                ctx.error(
                    "backend.kind",
                    f"an rl engine takes the actor's weights after every update, which "
                    f"'{self.backend.kind}' cannot; use 'local' or 'vllm'",
                )
            )
        elif self.backend.model is not None:
            out.append(
                ctx.error(
                    "backend.model",
                    "the engine generates with the actor's weights; leave backend.model empty",
                )
            )
        if isinstance(self.backend, LocalBackend) and self.backend.precision != "auto":
            out.append(
                ctx.error(
                    "backend.precision",
                    f"the rl engine computes in the actor's dtype (bf16: {self.bf16}), which the "
                    f"probe compares it with; found '{self.backend.precision}': leave it auto",
                )
            )
        sleeping = isinstance(self.backend, VLLMBackend) and self.backend.vllm_enable_sleep
        if self.async_train and sleeping:
            out.append(
                ctx.error(
                    "async_train",
                    f"async_train ({ctx.source('async_train')}) cannot run with vllm_enable_sleep "
                    f"({ctx.source('backend.vllm_enable_sleep')}): the engines must stay awake to "
                    "generate while the actor trains; turn one of them off",
                )
            )
        if self.async_train and self.deepspeed_enable_sleep and ctx.gpus > 0:
            out.append(
                ctx.error(
                    "async_train",
                    f"async_train ({ctx.source('async_train')}) cannot run with "
                    f"deepspeed_enable_sleep ({ctx.source('deepspeed_enable_sleep')}) on GPUs: "
                    "the actor trains while the engines generate, so its optimizer states "
                    "cannot leave the GPU for them (the memory plan would count them gone); "
                    "turn one of them off",
                )
            )
        if self.rollout_batch_size * self.num_repeats < self.micro_train_batch_size:
            out.append(
                ctx.warning(
                    "micro_train_batch_size",
                    f"larger than a step's {self.rollout_batch_size * self.num_repeats} samples",
                )
            )
        out += self._check_sync(ctx) + self._note_sleep(ctx)
        # refusals of the run path known from the config alone (tests/unit/test_refusals.py)
        out += check_verifier(self.verifier, ctx) + check_environment(self.environment, ctx)
        if self.environment is not None and self.algorithm == "ppo":
            out.append(
                ctx.error(
                    "environment.kind" if self.environment.kind else "environment.url",
                    f"multi-turn episodes train with GRPO only; algorithm is ppo "
                    f"({ctx.source('algorithm')}), whose critic would value observation tokens "
                    "the model did not write: use algorithm grpo, or leave environment out",
                )
            )
        return out

    def _note_sleep(self, ctx: ResolveContext) -> list[Diagnostic]:
        """What `deepspeed_enable_sleep` will move off the actor's GPUs, and how, under the
        resolved trainer and ZeRO stage (`stages.lib.dist.sleep`: DeepSpeed's offload_states
        exists only for ZeRO-1/2, and asks for FusedAdam at ZeRO-3)."""
        from stages.lib.dist.sleep import sleep_method

        actor = ctx.roles.get("actor")
        if not (self.deepspeed_enable_sleep and actor and actor.gpus) or self.async_train:
            return []
        trainer = "torch" if self.trainer == "torch" else "deepspeed"
        how = sleep_method(trainer, self.zero_stage, self.adam_offload, "cuda").how
        zero = f"ZeRO-{self.zero_stage}" + (" with adam_offload" if self.adam_offload else "")
        where = f"{trainer} at {zero}" if trainer == "deepspeed" else "plain torch"
        return [ctx.error("deepspeed_enable_sleep", f"{where}: {how}", "note")]

    def _check_sync(self, ctx: ResolveContext) -> list[Diagnostic]:
        """Which weight-sync backend will run, where it is not the one asked for on GPUs
        (`stages.rl.sync.choice`): an engine colocated with the actor gets gloo."""
        from stages.rl.sync.choice import choose_sync

        engine = ctx.roles.get("vllm")
        actor = ctx.roles.get("actor")
        if not (engine and actor):
            return []
        choice = choose_sync(
            self.vllm_sync_backend,
            actor_gpu=actor.gpus > 0,
            engine_gpu=engine.gpus > 0,
            shared_gpu="actor" in engine.colocated_with,
        )
        if choice.reason is None or not (actor.gpus and engine.gpus):
            return []
        return [
            ctx.warning(
                "vllm_sync_backend",
                f"{self.vllm_sync_backend} ({ctx.source('vllm_sync_backend')}) will not run, "
                f"{choice.backend} will: {choice.reason}",
            )
        ]


def engine_context(ctx: ResolveContext) -> ResolveContext:
    """The stage's context as the `vllm` role sees it: that role's GPUs."""
    alloc = ctx.roles.get("vllm")
    return replace(ctx, gpus=alloc.gpus if alloc else 0, role="vllm")


stage("rl", config=RLConfig, run="stages.rl.run:run_rl")
