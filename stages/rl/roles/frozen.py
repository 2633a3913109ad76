"""The frozen models, the reference policy (kl_coef > 0) and the teacher (on-policy
distillation): where each loads, how, and what it scores.

Input: the stage's slots (which devices each role holds); a model directory, the compute
dtype and the actor's ds_config. Output: `in_actor` (does the reference load inside the
actor's ranks?), `load_reference` (the model in the compute dtype: bf16 when `bf16`, else
fp32; split over its ranks under ZeRO-3), `reference_logprobs` (each sample's completion
log-probabilities under it), and `RefRanks`, the controller's side of the ref role's own
ranks (`stages.rl.roles.ref`), which serves the teacher role's too (`stages.rl.roles.teacher`:
the same code on the teacher's folder).

Where it loads, the rule the memory model (`RLConfig.memory_needs`) counts too (the
teacher's the same with the `teacher` role):
- the `ref` role holds devices of its own: its own ranks there, one torch.distributed job;
  each rank scores every world-th sample and rank 0 gathers the answers;
- the `ref` role shares the actor's devices (`resources.colocate`), or the stage has no
  devices (a CPU run, or `ref` left out of a written ratio): inside each actor rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def in_actor(slots: Sequence[Any], role: str = "ref") -> bool:
    """Does the frozen model of `role` (the reference, the teacher) load inside the actor's
    ranks? Yes unless the role holds devices that are not the actor's (`slots`: the
    stage's, each with role, worker and devices)."""
    ref = {(s.worker, d) for s in slots if s.role == role for d in s.devices}
    actor = {(s.worker, d) for s in slots if s.role == "actor" for d in s.devices}
    return not ref or ref == actor


def ref_ds_config(ds_config: dict[str, Any] | None, bf16: bool) -> dict[str, Any] | None:
    """DeepSpeed's config for the frozen reference: only under ZeRO-3 (its weights split over
    the ranks that load it, as the actor's are); no optimizer, nothing to train."""
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        return None
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


def load_reference(
    model_dir: str, bf16: bool, ds_config: dict[str, Any] | None, device: str
) -> tuple[Any, Any]:
    """The frozen reference of `model_dir` in the compute dtype (bf16 when `bf16`, else
    fp32), on `device`, in eval mode without gradients; and the DeepSpeed engine that holds
    it (None unless ZeRO-3). Under ZeRO-3 (`ds_config`, the actor's) it is built inside
    `zero.Init` and filled one module at a time like the actor (`load_model`), then wrapped
    by `deepspeed.initialize` without an optimizer, which installs the hooks that gather
    each module's weights for its forward (DeepSpeed's engine: ZeRO stage 3 and no optimizer
    -> `DeepSpeedZeRoOffload`, runtime/engine.py `_configure_zero_optimizer`)."""
    import torch

    from stages.lib.distributed.rank import load_model

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = ref_ds_config(ds_config, bf16)
    model = load_model(model_dir, config, dtype=dtype)
    model.requires_grad_(False)
    if config is None:
        return model.to(device).eval(), None
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine.module, engine


def reference_logprobs(
    module: Any, samples: Sequence[Any], device: str, cfg: Any, pad_id: int, passes: int = 0
) -> list[list[float]]:
    """Each sample's completion log-probabilities under `module` (no gradients), in micro
    batches of `micro_train_batch_size`; at least `passes` forward passes (a pass beyond the
    samples scores the first sample again and is dropped: ZeRO-3 needs every rank in each)."""
    import torch

    from stages.rl.algo.logprobs import completion_logprobs

    size = cfg.micro_train_batch_size
    out: list[list[float]] = []
    n = max(passes, -(-len(samples) // size))
    with torch.no_grad():
        for i in range(n):
            micro = samples[i * size : (i + 1) * size]
            lp, _ = completion_logprobs(
                module, micro or samples[:1], device, cfg.temperature, pad_id
            )
            out += [x.float().tolist() for x in lp] if micro else []
    return out


class RefRanks:
    """The controller's side of a frozen role's own ranks (`ref`, or `teacher`): started
    where the role's devices are (`Roles.start`, as the critic's), asked for each batch's
    log-probabilities before the actor's update, stopped with the stage."""

    def __init__(
        self, roles: Any, host: str, brief: Any, model_dir: str, role: str = "ref"
    ) -> None:
        """`brief`: the actor's; the ranks take their own channel, the folder they load
        (`model_dir`: the actor's for the reference, the teacher's) and, under DeepSpeed, a
        ds_config for the role's rank count (it only says how the weights split)."""
        from stages.lib.distributed.ds_config import build_ds_config
        from stages.rl.roles.channel import StageEnd

        self.roles, self.end, self.role = roles, StageEnd(host), role
        world = roles.devices(role)[1]
        ds = build_ds_config(brief.config, world, model_dir=model_dir) if brief.ds_config else None
        update = {
            "channel": self.end.address,
            "authkey": self.end.authkey.hex(),
            "ds_config": ds,
            "model_dir": model_dir,
        }
        self.thread = roles.start(role, brief.model_copy(update=update), self.end)

    def alive(self) -> bool:
        return bool(
            self.thread.is_alive() if self.thread is not None else self.roles.remote_alive()
        )

    def score(self, samples: list[Any]) -> list[Any]:
        """`samples` with `ref_logprobs` (`teacher_logprobs`) set, from the role's ranks."""
        from dataclasses import asdict, replace

        payload = {"samples": [asdict(s) for s in samples]}
        kind = f"{self.role}_logprobs"
        scored = self.end.request(kind, payload, timeout_s=3600, alive=self.alive)
        return [replace(s, **{kind: tuple(lp)}) for s, lp in zip(samples, scored, strict=True)]

    def stop(self) -> None:
        self.end.request("stop", timeout_s=600, alive=self.alive)
        if self.thread is not None:
            self.thread.join(timeout=120)
