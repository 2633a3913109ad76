"""rl: online RL (GRPO) with placed roles, live weight sync to the rollout engine.

The config model, its registration and its rules; the body (`stages.rl.run`) and the
actor ranks (`stages.rl.roles.actor`) are imported only when a stage runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, MemoryNeed, ResolveContext, stage
from stages.lib.backends.registered import backend_preset_path, rl_engine_kinds
from stages.lib.backends.rollout_batch import check_rollout_batch, derive_rollout_batch
from stages.lib.builders.recipe import TinyModel
from stages.lib.chat.template import (
    ChatTemplate,
    PromptTemplate,
    check_chat_template,
)
from stages.lib.config import (
    check_verifier,
)
from stages.lib.distributed.ds_config import check_deepspeed, trainer_memory, trainer_memory_changes
from stages.lib.env.field import check_environment, check_environment_tools
from stages.lib.model.declared import ModelRef
from stages.lib.model.dtypes import SAVE_DTYPE_HELP, Dtype
from stages.lib.model.gguf import memory_model
from stages.lib.model.path import check_model_ref
from stages.rl.algo.combinations import check_algorithm, derive_algorithm
from stages.rl.algo.distill import DistillSettings, check_distill, derive_distill
from stages.rl.algo.options import AlgorithmOptions
from stages.rl.settings.distributed import DistributedSettings
from stages.rl.settings.optim import OptimSettings
from stages.rl.settings.rollout import RolloutSettings
from stages.rl.settings.scoring import ScoringSettings, check_scoring, derive_scoring


# pydantic lists a model's fields from its last base to its first, then its own: `pipe plan
# --explain` and the schema show rollout, reward model, teacher, algorithm, optimisation,
# distributed, then these
class RLConfig(
    DistributedSettings,
    OptimSettings,
    AlgorithmOptions,
    DistillSettings,
    ScoringSettings,
    RolloutSettings,
):
    """Online RL: sample groups from the engine, score them, update the actor, sync weights."""

    SPANS_NODES = True  # the controller on the engine's worker; other roles where placed
    INPUTS = ("input", "eval_input", "model", "reward_model", "teacher", "chat_template")
    MODEL_INPUTS = ("model", "reward_model", "teacher", "chat_template")
    OUTPUTS = ("output",)
    OUTPUT_TYPES: ClassVar[dict[str, str]] = {"output": "checkpoint"}
    REFUSED_ROLES: ClassVar[dict[str, str]] = {
        "reward": "it has no reward_model; its rewards come from 'verifier' (reasoning_gym, "
        "exact_match, regex, math, or your own 'module:function'): set reward_model (a "
        "checkpoint with a scalar head, or '@stage') to bring the reward role, or leave "
        "'reward' out",
        "teacher": "it has no teacher; set teacher (a checkpoint with the policy's tokenizer, "
        "or '@stage') to bring the teacher role for on-policy distillation, or leave "
        "'teacher' out",
    }

    # what the stage reads and writes, how long it runs, when it saves and evaluates
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
        description="The policy to start from: a checkpoint directory, a .gguf file (converted "
        "once into one), '@stage', a hub id, or a tiny model spec.",
    )
    chat_template: ChatTemplate = None
    prompt_template: PromptTemplate = None
    max_steps: int | None = Field(
        100,
        gt=0,
        description="RL steps (rollout, update, sync); empty: max_epochs over the prompts.",
    )
    max_epochs: int = Field(1, gt=0, description="Passes over the prompts when max_steps is empty.")
    save_steps: int = Field(
        50, gt=0, description="Save a resumable checkpoint every this many steps."
    )
    eval_every: int = Field(
        20, gt=0, description="Score eval_input every this many steps (and at the end)."
    )
    eval_limit: int | None = Field(500, gt=0, description="Held-out prompts scored at most.")
    log_samples_every: int = Field(
        10,
        ge=0,
        description="At step 1 and every this many steps, the first samples of the step's batch "
        "(text, ids, loss mask, log-probabilities, reward, advantage) to samples.jsonl and the "
        "trackers; 0: none.",
    )
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    save_dtype: Dtype = Field("auto", description=SAVE_DTYPE_HELP)

    @classmethod
    def refused_roles(cls, data: Mapping[str, Any]) -> dict[str, str]:
        """`reward` while the stage has no reward_model, `teacher` while it has no teacher
        (with one, the stage holds the role)."""
        refused = super().refused_roles(data)
        for role, field in (("reward", "reward_model"), ("teacher", "teacher")):
            if data.get(field):
                refused.pop(role, None)
        return refused

    @classmethod
    def roles_used(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        """The rollout engines and the actor; the reference when kl_coef > 0, the teacher with
        a teacher, the critic under ppo, the reward model's role with a reward_model."""
        kl = data.get("kl_coef", 0.0)
        ref = ("ref",) if isinstance(kl, int | float) and kl > 0 else ()
        teacher = ("teacher",) if data.get("teacher") else ()
        critic = ("critic",) if data.get("algorithm") == "ppo" else ()
        reward = ("reward",) if data.get("reward_model") else ()
        return ("vllm", "actor", *ref, *teacher, *critic, *reward)

    @classmethod
    def preset_path(cls, key: str, data: Mapping[str, Any]) -> tuple[str, ...] | None:
        return super().preset_path(key, data) or backend_preset_path(key, data)

    def gpu_unit(self, role: str | None = None) -> int:
        """A vLLM engine's tensor-parallel group stays on one node; trained roles place by GPU."""
        return self.backend.gpu_unit() if role == "vllm" else 1

    @classmethod
    def headline(cls, result: Mapping[str, Any]) -> list[str]:
        """Reward (and the reverse KL to a teacher) and held-out accuracy, first -> last."""
        if not result.get("steps"):
            return []

        def arrow(a: Any, b: Any, fmt: str) -> str:
            first = format(a, fmt) if a is not None else "-"
            last = format(b, fmt) if b is not None else "-"
            return f"{first} -> {last}"

        line = f"reward {arrow(result.get('reward_first'), result.get('reward_last'), '.3f')}"
        if "distill_reverse_kl_first" in result:
            kl = arrow(result["distill_reverse_kl_first"], result["distill_reverse_kl_last"], ".3f")
            line += f", reverse KL to the teacher {kl}"
        start, end = result.get("eval_accuracy_start"), result.get("eval_accuracy_end")
        if start is not None or end is not None:
            line += f", held-out accuracy {arrow(start, end, '.1%')}"
        return [f"{line} over {result['steps']} steps"]

    def derive(self, ctx: ResolveContext) -> dict[str, Derived]:
        """The vLLM engines from the `vllm` role's GPUs (engines x tensor-parallel size = the
        role's GPUs), prefix caching for groups, half a shared GPU left to training; GSPO's
        loss and clip with ratio_level sequence (`derive_algorithm`); what the reward model
        reads (`derive_scoring`); the engine's batch from micro_rollout_batch_size."""
        out = self.backend.derive(engine_context(ctx), self.num_repeats)
        return (
            out
            | derive_algorithm(self)
            | derive_scoring(self, ctx)
            | derive_distill(self)
            | derive_rollout_batch(self, ctx)
        )

    def memory_needs(self) -> list[MemoryNeed]:
        """The engine (a vLLM share, or the local engine's copy of the weights), the actor as a
        trainer, and the frozen reference when kl_coef > 0: in the compute dtype, split by
        ZeRO-3 under DeepSpeed, on the ref role's devices or, when that role has none of its
        own, inside the actor's ranks (`stages.rl.roles.frozen`; colocated with the actor, the two
        share devices and are summed there); the teacher, frozen as the reference is, on the
        teacher role's devices or inside the actor's ranks; the reward model, frozen in the
        compute dtype, whole on each of the reward role's devices (`stages.rl.roles.reward`)."""
        model = memory_model(self.model if isinstance(self.model, str) else self.model.model_dump())
        engines = [replace(n, role="vllm") for n in self.backend.memory_needs()]
        if not engines:
            engines = [MemoryNeed(role="vllm", profile="frozen", model=model, bf16=self.bf16)]
        needs = [*engines, trainer_memory(self, model, self.max_length, role="actor")]
        if self.kl_coef > 0:
            zero = self.zero_stage if self.trainer != "torch" else 0
            ref = MemoryNeed(
                "ref", "frozen", model, zero_stage=zero, bf16=self.bf16, inside="actor"
            )
            needs.append(ref)
        if self.teacher is not None:
            zero = self.zero_stage if self.trainer != "torch" else 0
            teacher = memory_model(self.teacher)
            needs.append(
                MemoryNeed(
                    "teacher", "frozen", teacher, zero_stage=zero, bf16=self.bf16, inside="actor"
                )
            )
        if self.algorithm == "ppo":
            needs.append(trainer_memory(self, model, self.max_length, role="critic"))
        if self.reward_model is not None:
            needs.append(MemoryNeed("reward", "frozen", self.reward_model, bf16=self.bf16))
        return needs

    def memory_changes(self) -> list[tuple[str, Any]]:
        return trainer_memory_changes(self)

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        out = check_deepspeed(self, ctx, self.num_processes)
        out += self.backend.check(engine_context(ctx))
        out += check_model_ref(ctx, "model", self.model)
        out += check_chat_template(
            ctx, self.chat_template, self.prompt_template, [("model", self.model)]
        )
        out += check_algorithm(self, ctx, self.environment is not None)
        out += check_scoring(self, ctx)
        out += check_distill(self, ctx)
        if self.backend.RL_ENGINE is None:
            kinds = " or ".join(map(repr, rl_engine_kinds()))
            out.append(
                ctx.error(
                    "backend.kind",
                    f"an rl engine takes the actor's weights after every update, which "
                    f"'{self.backend.kind}' cannot; use {kinds}",
                )
            )
        else:
            out += self.backend.check_rl(ctx, self.bf16)
        sleeping = self.backend.sleeps
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
        out += self._check_sync(ctx) + self._note_sleep(ctx) + self._check_lora(ctx)
        out += check_rollout_batch(ctx, self) + self.refuse_ring_attn(ctx)
        # refusals of the run path known from the config alone (tests/unit/test_refusals.py)
        if self.verifier is not None:
            out += check_verifier(self.verifier, ctx)
        out += check_environment(self.environment, ctx)
        if self.environment is not None and self.environment.agent_plays:
            out += self._check_agent(ctx)
        out += check_environment_tools(
            self.environment, ctx, self.chat_template, self.prompt_template, [("model", self.model)]
        )
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

    def _check_lora(self, ctx: ResolveContext) -> list[Diagnostic]:
        """LoRA on the actor (`stages.lib.model.lora`): not with a critic, whose own weights
        would train in full beside it, nor on a 4-bit base, which the engines (full precision)
        would not sample like."""
        from stages.lib.model.lora.refusals import check_lora, lora_path

        if self.lora is None:
            return []
        actor = ctx.roles.get("actor")
        out = check_lora(self.lora, ctx, self, actor.gpus if actor else 0, "actor")
        if self.algorithm == "ppo":
            out.append(
                ctx.error(
                    lora_path(self.lora),
                    f"LoRA trains the actor's adapters only, and algorithm ppo "
                    f"({ctx.source('algorithm')}) trains a critic whose weights would all train "
                    "beside it; use algorithm grpo, or leave lora out",
                )
            )
        if self.lora.load_in_4bit:
            out.append(
                ctx.error(
                    "lora.load_in_4bit",
                    "the engines generate with the full-precision base and the adapters, which "
                    "a 4-bit actor does not score like (the probe after every sync would fail); "
                    "4-bit loading is for the train stage",
                )
            )
        return out

    def _note_sleep(self, ctx: ResolveContext) -> list[Diagnostic]:
        """What `deepspeed_enable_sleep` will move off the actor's GPUs, and how, under the
        resolved trainer and ZeRO stage (`stages.lib.distributed.sleep`: DeepSpeed's offload_states
        exists only for ZeRO-1/2, and asks for FusedAdam at ZeRO-3)."""
        from stages.lib.distributed.sleep import sleep_method
        from stages.lib.distributed.trainer_choice import choose_trainer

        actor = ctx.roles.get("actor")
        if not (self.deepspeed_enable_sleep and actor and actor.gpus) or self.async_train:
            return []
        trainer = choose_trainer(self, installed=True)  # as on a worker that has DeepSpeed
        how = sleep_method(trainer, self.zero_stage, self.adam_offload, "cuda").how
        zero = f"ZeRO-{self.zero_stage}" + (" with adam_offload" if self.adam_offload else "")
        where = f"{trainer} at {zero}" if trainer == "deepspeed" else "plain torch"
        return [ctx.error("deepspeed_enable_sleep", f"{where}: {how}", "note")]

    def _check_agent(self, ctx: ResolveContext) -> list[Diagnostic]:
        """NeMo Gym's agent plays the episodes against the engine served over HTTP
        (`stages.rl.rollout.agent_play`): settings that would act on nothing are refused."""
        out: list[Diagnostic] = []
        if self.eval_input:
            out.append(
                ctx.error(
                    "eval_input",
                    "with NeMo Gym's agent playing the episodes, held-out episodes are scored "
                    "by an evaluate stage on the rl stage's checkpoint (environment kind "
                    "nemo_gym there too): leave eval_input out",
                )
            )
        if "multi_turn_tokens" in ctx.explicit:
            out.append(
                ctx.error(
                    "multi_turn_tokens",
                    "NeMo Gym's agent asks every turn itself; the endpoint serving it extends "
                    "each turn's sampled ids (token in, token out), so this would act on "
                    "nothing: remove it",
                )
            )
        return out

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
