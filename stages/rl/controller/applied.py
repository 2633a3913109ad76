"""How each setting of an rl stage acts in this run: applied (and how), or skipped (and why).

Input: the resolved `RLConfig` and what the stage decided (trainer, device, actor ranks,
weight-sync backend). Output: `{field: (status, how)}` for every field, written to the
stage's `settings.json`; a field missing here fails the run (`stages.rl.controller.records`), so a
new setting cannot be resolved and then ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stages.lib.api.sampling import request_sampling
from stages.lib.distributed.sleep import sleep_method
from stages.lib.env.field import scores_itself
from stages.rl.algo.distill import distill_coef
from stages.rl.algo.effects import account_algorithm
from stages.rl.algo.options import per_token_returns
from stages.rl.controller.records import SAMPLES_PER_STEP
from stages.rl.sync.choice import LORA_SYNC, SyncChoice

if TYPE_CHECKING:
    from stages.rl import RLConfig

A, S = "applied", "skipped"


def account(
    cfg: RLConfig,
    trainer: str,
    device: str,
    world: int,
    sync: SyncChoice,
    engines: Sequence[Mapping[str, Any]] = (),
    *,
    saved: tuple[str, str],
    threads_how: str = "",
) -> dict[str, tuple[str, str]]:
    """Every field of `cfg` with its status in a run with these decisions (`engines`: where
    each engine started; `saved`: the final checkpoint's dtype and why,
    `stages.lib.model.dtypes.resolve_save_dtype`; `threads_how`: how `num_threads` was
    chosen, `stages.rl.run.with_threads`)."""
    ds = trainer == "deepspeed"
    lora_vllm = cfg.lora is not None and cfg.backend.RL_ENGINE == "servers"
    adapter_files = (S, f"lora on vLLM: {LORA_SYNC}") if lora_vllm else None
    no_ds = (S, "plain torch trains the actor (deepspeed is not installed or trainer: torch)")
    how: dict[str, tuple[str, str]] = {
        "input": (A, "the prompts sampled each step"),
        "eval_input": (A, "scored greedily every eval_every steps")
        if cfg.eval_input
        else (S, "no held-out prompts given"),
        "output": (A, "the final checkpoint"),
        "model": (A, "the actor's and the engine's starting weights"),
        "chat_template": (A, f"prompts rendered with '{cfg.chat_template}', saved with the output")
        if cfg.chat_template
        else (S, "the checkpoint's own chat template renders the prompts"),
        "prompt_template": (A, "each user turn written through it (chat_template plain)")
        if cfg.prompt_template
        else (S, "chat_template is not plain"),
        "verifier": _verifier(cfg),
        "environment": _environment(cfg),
        "multi_turn_tokens": _multi_turn(cfg),
        **_scoring(cfg),
        "backend": _backend(cfg, device, engines),
        "num_repeats": (A, "samples per prompt (the group)"),
        "rollout_batch_size": (A, "prompts per step"),
        "num_samples_in_parallel": (
            A,
            f"vLLM requests in flight: {cfg.num_samples_in_parallel} "
            + (
                "(adaptive, from 64 to the engines' knee)"
                if cfg.num_samples_in_parallel == "auto"
                else "at most"
            ),
        )
        if cfg.backend.RL_ENGINE == "servers"
        else (S, "the local engine generates a step's groups in one batched call"),
        "micro_rollout_batch_size": _micro_rollout(cfg),
        "train_batch_size": (A, "samples per optimizer step"),
        "micro_train_batch_size": (
            A,
            "samples per rank per forward pass"
            + (" (token budget with use_dynamic_batch)" if cfg.use_dynamic_batch else ""),
        ),
        "learning_rate": (A, "the actor's AdamW rate"),
        "lr_scheduler": (A, "the actor's schedule over its updates"),
        "warmup_ratio": (A, "the actor's warm-up share of its updates"),
        "weight_decay": (A, "the actor's AdamW weight decay"),
        "max_steps": (A, "steps run") if cfg.max_steps else (S, "max_epochs decides"),
        "max_epochs": (S, "max_steps decides") if cfg.max_steps else (A, "passes over the prompts"),
        "temperature": _temperature(cfg),
        "max_output_tokens": (A, "most tokens per answer"),
        "max_length": (A, "prompt + answer cut to this for the update"),
        # above 1 refused at plan (`OptimSettings.refuse_ring_attn`): every rank reads whole rows
        "ring_attn_size": (A, "each sequence whole on one rank"),
        "kl_coef": _kl(cfg),
        **_distill(cfg),
        "ppo_epochs": (A, "updates over each rollout batch"),
        **account_algorithm(cfg),
        "gamma": (A, "GAE discount")
        if cfg.algorithm == "ppo"
        else (S, "GRPO has no value function: gamma acts with algorithm ppo"),
        "lambd": (A, "GAE lambda")
        if cfg.algorithm == "ppo"
        else (S, "GRPO has no value function: lambd acts with algorithm ppo"),
        "async_train": (
            A,
            "the engine samples ahead while the actor trains"
            if cfg.async_train
            else "off: synchronous steps",
        ),
        "async_queue_size": (A, f"at most {cfg.async_queue_size} batch(es) ahead")
        if cfg.async_train
        else (S, "async_train is off"),
        "save_steps": (A, "a resumable checkpoint every this many steps"),
        "eval_every": (A, "held-out scoring interval")
        if cfg.eval_input
        else (S, "no held-out prompts given"),
        "eval_limit": (A, "held-out prompts scored at most")
        if cfg.eval_input
        else (S, "no held-out prompts given"),
        "log_samples_every": (
            A,
            f"at step 1 and every {cfg.log_samples_every} step(s), the first {SAMPLES_PER_STEP} "
            "samples of the step's batch to samples.jsonl (uploaded to the trackers when the "
            "stage ends)",
        )
        if cfg.log_samples_every
        else (S, "0: no samples logged"),
        "seed": (A, "data order, sampling and the actor's initialisation"),
        "zero_stage": (A, f"ZeRO stage {cfg.zero_stage} in the actor's ds_config") if ds else no_ds,
        "adam_offload": (
            A,
            "optimizer states offloaded (ds_config)" if cfg.adam_offload else "off (ds_config)",
        )
        if ds
        else no_ds,
        "gradient_checkpointing": (
            A,
            "activations recomputed in backward" if cfg.gradient_checkpointing else "off",
        ),
        "packing_samples": (
            A,
            "each micro batch of the actor"
            + (" and the critic" if cfg.algorithm == "ppo" else "")
            + " packed into rows as wide as its longest sample, position ids restarting per "
            "sample, attention within each"
            + (" (the token budget counts packed tokens)" if cfg.use_dynamic_batch else ""),
        )
        if cfg.packing_samples
        else (A, "off: micro batches are padded"),
        "use_dynamic_batch": (
            A,
            "micro batches by a token budget"
            if cfg.use_dynamic_batch
            else "off: micro batches by sample count",
        ),
        "overlap_comm": (
            A,
            "overlap_comm in the actor's ds_config" if cfg.overlap_comm else "off (ds_config)",
        )
        if ds
        else no_ds,
        "deepcompile": (
            A,
            "compile: {deepcompile: true} in the actor's ds_config, then its engine.compile()",
        )
        if ds and cfg.deepcompile
        else (S, "off")
        if ds
        else no_ds,
        "deepspeed_enable_sleep": _sleep(cfg, trainer, device),
        "bf16": _bf16(cfg, ds),
        "save_dtype": (A, f"the final checkpoint in {saved[0]} ({saved[1]})"),
        "lora": _lora(cfg),
        "vllm_sync_backend": adapter_files or _sync(sync, cfg.bf16),
        "sync_timeout_s": (A, "a weight sync past it fails the step"),
        "sync_bucket_mb": (A, f"weights broadcast in buckets of {cfg.sync_bucket_mb} MiB")
        if sync.backend != "disk" and not adapter_files
        else adapter_files or (S, "disk: one file, no buckets"),
        "num_processes": (A, f"{world} actor rank(s) on the CPU")
        if device == "cpu"
        else (S, f"one actor rank per GPU: {world}"),
        "num_threads": (
            A,
            "torch threads of the engine and of each actor rank"
            + (f"; {threads_how}" if threads_how else ""),
        ),
        "trainer": (A, f"{trainer} trains the actor"),
        "logprob_diff_warn": (A, _diff_warn(cfg.logprob_diff_warn)),
    }
    return how


def _diff_warn(nats: float) -> str:
    return (
        f"a warning in the stage's log when a sampled token's log-probability differs by more "
        f"than {nats} nats between the engine and the actor before the step's first update "
        "(logprob_diff_max in metrics.jsonl; the count in rl_result.json)"
    )


def _sleep(cfg: RLConfig, trainer: str, device: str) -> tuple[str, str]:
    """What leaves the GPU while the engine generates, for each trained role."""
    if not cfg.deepspeed_enable_sleep:
        return A, "off: the optimizer states stay where they are"
    if cfg.async_train:
        return S, "async_train: the actor trains while the engine generates, so its states stay"
    way = sleep_method(trainer, cfg.zero_stage, cfg.adam_offload, device)
    roles = "the actor and the critic" if cfg.algorithm == "ppo" else "the actor"
    if not way.moves:
        return S, f"{roles}: {way.how}"
    return A, f"{roles}, while the engine generates, back before each update: {way.how}"


def _started(engines: Sequence[Mapping[str, Any]]) -> str:
    nodes = list(dict.fromkeys(str(e.get("node")) for e in engines if e.get("node")))
    return f" on {len(nodes)} node(s) ({', '.join(nodes)})" if nodes else ""


def _backend(cfg: RLConfig, device: str, engines: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    return A, cfg.backend.rl_engines_record(
        len(engines), _started(engines), gpu=device != "cpu", async_train=cfg.async_train
    )


def _micro_rollout(cfg: RLConfig) -> tuple[str, str]:
    """The engine's batch (`stages.lib.backends.rollout_batch`: already in the block here)."""
    servers = cfg.backend.RL_ENGINE == "servers"
    if cfg.micro_rollout_batch_size is None:
        own = "vLLM's default --max-num-seqs" if servers else "the local block's batch_size"
        return S, f"empty: {own} batches the engine's generation"
    where = "each vLLM server's --max-num-seqs" if servers else "the local engine's batch"
    return A, f"{cfg.micro_rollout_batch_size} samples generated at once ({where})"


def _bf16(cfg: RLConfig, ds: bool) -> tuple[str, str]:
    """How the actor computes, and the local engine with it (the probe compares the two)."""
    if not cfg.bf16:
        how = "fp32"
    else:
        how = "the actor trains in bfloat16" if ds else "torch autocast to bfloat16"
    if cfg.backend.RL_ENGINE == "in_process":
        how += f"; the local engine loads the policy in {'bfloat16' if cfg.bf16 else 'float32'}"
    return A, how


def _sync(choice: SyncChoice, bf16: bool) -> tuple[str, str]:
    wire = "bfloat16" if bf16 else "float32"
    how = (
        "through a safetensors file every engine reloads"
        if choice.backend == "disk"
        else f"over {choice.backend}, one broadcast to every engine at once, no file written,"
    )
    ran = f"weights reach the engine {how} in {wire}, checked by a probe after every sync"
    if choice.reason is None:
        return A, ran
    return S, f"{choice.reason} ({ran})"


def _temperature(cfg: RLConfig) -> tuple[str, str]:
    """The policy sampled and scored, and for vLLM the sampling fields each request sent."""
    policy = "sampling temperature, and the policy the ratio is taken under: softmax(logits / T)"
    if cfg.backend.RL_ENGINE != "servers":
        return A, f"{policy} over the whole vocabulary, sampled by the local engine itself"
    sent = json.dumps(request_sampling(cfg.temperature))
    return A, (
        f"{policy} over the whole vocabulary; every vLLM request sent {sent} (servers started "
        "with --generation-config vllm: no defaults from the checkpoint's generation_config)"
    )


def _kl(cfg: RLConfig) -> tuple[str, str]:
    if cfg.kl_coef <= 0:
        return A, "0: no reference model loaded"
    if per_token_returns(cfg):
        return A, "KL to a frozen reference in every token's reward (k1), not in the loss"
    return A, "k3 KL to a frozen reference in the actor's loss"


def _distill(cfg: RLConfig) -> dict[str, tuple[str, str]]:
    """The teacher and its weight (`stages.rl.algo.distill`), or skipped without one."""
    if cfg.teacher is None:
        return {"teacher": (S, "none: no distillation"), "distill_coef": (S, "no teacher")}
    how = (
        "in each token's reward, so in its return (with the KL's)"
        if per_token_returns(cfg)
        else "added to each token's group advantage, not normalised"
    )
    return {
        "teacher": (
            A,
            "scores every sampled token (its log-probability): the reverse KL per token",
        ),
        "distill_coef": (A, f"-{distill_coef(cfg)} x (log pi_old - log pi_teacher) {how}"),
    }


def _verifier(cfg: RLConfig) -> tuple[str, str]:
    env = cfg.environment
    if env is not None and scores_itself(env):
        return S, "the environment scores its own episodes"
    if cfg.verifier is None and cfg.reward_model is None:
        return S, "none (null): the teacher's per-token reverse KL alone trains the policy"
    if cfg.verifier is None:
        return S, "none (null): the reward model alone scores the samples"
    if cfg.reward_model is not None and cfg.reward_weights is None:
        return A, f"held-out and per-step accuracy ({cfg.verifier.kind}); not in the reward"
    return A, f"scores every sample ({cfg.verifier.kind})"


def _scoring(cfg: RLConfig) -> dict[str, tuple[str, str]]:
    """The reward model's settings: each acts on its scores, or is skipped without one."""
    none = (S, "no reward_model: the verifier's rewards")
    if cfg.reward_model is None:
        names = (
            "reward_model",
            "reward_weights",
            "reward_sequences",
            "normalize_reward",
            "reward_clip",
        )
        return {name: none for name in names}
    w = cfg.reward_weights
    return {
        "reward_model": (A, "scores every sample on the reward role's ranks"),
        "reward_weights": (
            A,
            f"reward = {w.reward_model:g} x the model's score + {w.verifier:g} x the verifier's",
        )
        if w is not None
        else (S, "none: the reward is the model's score alone"),
        "reward_sequences": (A, cfg.reward_sequences),  # the reading, once the role starts
        "normalize_reward": (A, "scores less the mean, over the std, its config.json holds")
        if cfg.normalize_reward
        else (S, "off: the model's scores as they are"),
        "reward_clip": (A, f"scores clipped to [-{cfg.reward_clip:g}, {cfg.reward_clip:g}]")
        if cfg.reward_clip is not None
        else (S, "none: scores unclipped"),
    }


def _environment(cfg: RLConfig) -> tuple[str, str]:
    from stages.lib.env.contract import max_turns

    env = cfg.environment
    if env is None:
        return S, "none: each sample is one turn scored by the verifier"
    what = env.url or env.kind
    if env.agent_plays:  # the agent ends its episodes (its config's bound, e.g. max_steps)
        return A, (
            f"each sample is an episode {what}'s agent plays, its turns bounded by the "
            "agent's config; the loss covers the model's own tokens only"
        )
    return A, (
        f"each sample is an episode with {what}, at most {max_turns(env)} turns; the loss "
        "covers the model's own tokens only"
    )


def _multi_turn(cfg: RLConfig) -> tuple[str, str]:
    if cfg.environment is None:
        return S, "no environment: each sample is one turn, there is no later turn to ask"
    if cfg.multi_turn_tokens == "extend":
        return A, "each later turn asked from the ids so far and the observation's ids"
    return A, "each later turn asked from the chat template's rendering of the conversation"


def _lora(cfg: RLConfig) -> tuple[str, str]:
    lora = cfg.lora
    if lora is None:
        return (S, "no adapters: every weight of the actor trains")
    out = "merged into the final checkpoint" if lora.save == "merged" else "saved alone"
    targets = lora.target_modules
    on = targets if isinstance(targets, str) else ", ".join(targets)
    return (
        A,
        f"the actor trains rank-{lora.rank} adapters (alpha {lora.scale_alpha:g}) on {on}, the "
        f"base frozen; the engines generate with them and each sync sends the adapters alone; "
        f"{out}",
    )
