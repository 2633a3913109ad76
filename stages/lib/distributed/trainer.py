"""The optimizer side of a rank: DeepSpeed's engine, or plain torch with the same interface.

Input: the model, the resolved optimizer settings (any config with the fields of
`stages.lib.distributed.trainer_fields.TrainedSettings`: the train and rl kinds' configs),
the ds_config dict (DeepSpeed) and the run's total steps. Output: a `Trainer` whose call (the
model's top-level forward), `backward` and `step` run one optimizer step as a series of micro
batches, which saves and loads resumable checkpoints, and hands rank 0 the full weights for
the final checkpoint.

Both use torch's AdamW (betas 0.9/0.95) with the schedule of
`stages.lib.distributed.schedule`, gradient clipping at 1.0, and gradients averaged over
ranks. Gradient accumulation boundaries are set by the caller for each micro
batch, because dynamic batching gives steps a varying number of them; the loss
the caller passes is already scaled (DeepSpeed's own 1/accumulation scaling
is off). On GPU with `adam_offload`, DeepSpeed's CPU Adam is used instead of
torch's (torch's AdamW on offloaded fp32 states would be slow at scale).

`offload()` and `reload()` move the optimizer side off the GPU and back
(`stages.lib.distributed.sleep` chooses how, `stages.lib.distributed.offload` moves what the
trainer moves itself); a checkpoint saved while the states are away brings them back for the
save.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from stages.lib.distributed.offload import HostStates, optimizer_tensors, state_tensors
from stages.lib.distributed.schedule import lr_factor, warmup_steps
from stages.lib.distributed.sleep import Sleep, sleep_method
from stages.lib.distributed.trainer_fields import TrainedSettings

BETAS = (0.9, 0.95)
log = logging.getLogger("pipe.train")


def _scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainedSettings, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warm = warmup_steps(total, cfg.warmup_ratio)
    kind = cfg.lr_scheduler
    # LambdaLR's counter k is the number of updates done: the next update is step k+1
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k + 1, total, warm, kind)
    )


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition is flat
            (plain if ndim < 2 or "norm" in name else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    # no empty group (LoRA adapters are all matrices): DeepSpeed drops one, and the scheduler,
    # made before, would then step more groups than the optimizer has
    return [g for g in groups if g["params"]]


def has_frozen(model: torch.nn.Module) -> bool:
    """Whether some weights do not train (a LoRA base): checkpoints then hold the rest only."""
    return any(not p.requires_grad for p in model.parameters())


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Every name a frozen weight is saved under, a tied one's second name too."""
    params = model.named_parameters(remove_duplicate=False)
    return {n for n, p in params if not p.requires_grad}


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without its frozen weights (all of it when none is frozen)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


class Sleeper:
    """What both trainers share: a forward's logits, the offload/reload bookkeeping."""

    sleep: Sleep
    asleep: bool = False

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        return self(**inputs).logits  # type: ignore[no-any-return,operator]

    def offload(self) -> str:
        """The optimizer side off the GPU (hybrid engine); what moved."""
        if not self.sleep.moves or self.asleep:
            return f"skipped: {self.sleep.how}" if not self.sleep.moves else "already offloaded"
        moved = self._offload()
        self.asleep = True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the blocks back for the engine's process
        return f"{self.sleep.how}" + (f" ({moved} bytes)" if moved else "")

    def reload(self) -> str:
        """The optimizer side back on the GPU before the next update."""
        if not self.asleep:
            return (
                "skipped: nothing offloaded" if self.sleep.moves else f"skipped: {self.sleep.how}"
            )
        moved = self._reload()
        self.asleep = False
        return "reloaded" + (f" ({moved} bytes)" if moved else "")

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The states on the GPU for the duration (a checkpoint saved while they are away)."""
        was = self.asleep
        if was:
            self.reload()
        try:
            yield
        finally:
            if was:
                self.offload()

    def _offload(self) -> int:
        raise NotImplementedError

    def _reload(self) -> int:
        raise NotImplementedError


class TorchTrainer(Sleeper):
    """Plain torch: AdamW, gradients all-reduced by hand at each step when world > 1."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, cfg: TrainedSettings, total: int, device: str):
        self.module = model.to(device)
        self.device, self.bf16 = device, cfg.bf16
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, cfg.weight_decay), lr=cfg.learning_rate, betas=BETAS
        )
        self.scheduler = _scheduler(self.optimizer, cfg, total)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.sleep = sleep_method("torch", 0, False, device)
        self.host = HostStates(pin=device.startswith("cuda"))
        self.frozen = has_frozen(model)

    def begin_micro(self, boundary: bool) -> None:
        """Nothing to do: gradients are reduced in `step`."""

    def __call__(self, **inputs: Any) -> Any:
        """The model's top-level forward, under bf16 autocast when training in bf16."""
        with self._autocast():
            return self.module(**inputs)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> float | None:
        """Average gradients over ranks, clip, update; returns the gradient norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.world > 1:
            grads = [p.grad for p in params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world
            at = 0
            for g in grads:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _offload(self) -> int:
        return self.host.offload(optimizer_tensors(self.optimizer, self.module))

    def _reload(self) -> int:
        return self.host.reload()

    def save(self, root: str, tag: str) -> None:
        with self.awake():
            self._save(root, tag)

    def _save(self, root: str, tag: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            state = {
                "model": trained_state(self.module),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            os.makedirs(os.path.join(root, tag), exist_ok=True)
            torch.save(state, os.path.join(root, tag, "torch_state.pt"))

    def load(self, root: str, tag: str) -> None:
        state = torch.load(os.path.join(root, tag, "torch_state.pt"), map_location=self.device)
        found = self.module.load_state_dict(state["model"], strict=not self.frozen)
        lost = set(found.missing_keys) - frozen_names(self.module)
        if lost or found.unexpected_keys:  # only frozen weights may be absent (a LoRA base)
            raise RuntimeError(
                f"checkpoint {root}/{tag} does not fit the model: missing {sorted(lost)[:3]}, "
                f"unexpected {found.unexpected_keys[:3]}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """None: every rank holds the whole model already (`save_pretrained` as it is)."""
        return None


class DeepSpeedTrainer(Sleeper):
    """DeepSpeed's engine with the generated ds_config (ZeRO 0-3, offload, bf16)."""

    name = "deepspeed"

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainedSettings,
        total: int,
        device: str,
        ds_config: dict[str, Any],
    ):
        import deepspeed

        groups = _param_groups(model, cfg.weight_decay)
        optimizer: torch.optim.Optimizer
        if cfg.adam_offload and cfg.zero_stage > 0 and device.startswith("cuda"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=cfg.learning_rate, betas=BETAS)
        else:
            optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=BETAS)
        scheduler = _scheduler(optimizer, cfg, total)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        if ds_config.get("compile", {}).get("deepcompile"):
            self.engine.compile()  # DeepCompile: the ZeRO passes compiled into the graph
        self.module = self.engine.module
        self.frozen = has_frozen(model)
        if self.frozen:
            # DeepSpeed's exclude_frozen_parameters drops each frozen weight's first name only
            # (runtime/engine.py `module_state_dict`): a tied output head would be saved whole
            whole = self.engine.module_state_dict
            drop = frozen_names(self.module)

            def trained(*args: Any, **kwargs: Any) -> Any:
                return {k: v for k, v in whole(*args, **kwargs).items() if k not in drop}

            self.engine.module_state_dict = trained
        self.zero3 = cfg.zero_stage == 3
        self.sleep = sleep_method("deepspeed", cfg.zero_stage, cfg.adam_offload, device)
        self.host = HostStates(pin=device.startswith("cuda"))
        # DeepSpeed keeps the gradient norm only through a ZeRO, fp16 or bf16 optimizer (the
        # same test as its own clipping of plain fp32 gradients): otherwise step() measures it
        e = self.engine
        self.own_norm = not (e.fp16_enabled() or e.bfloat16_enabled() or e.zero_optimization())
        if self.zero3:
            self._log_partitioning()

    def _log_partitioning(self) -> None:
        """How much of the model ZeRO-3 split over the ranks (small tensors stay whole)."""
        params = list(self.module.parameters())
        split = [p for p in params if not getattr(p, "ds_persist", True)]
        log.info(
            "zero 3: %d of %d weight tensors partitioned, %d of %d elements held on this rank",
            len(split),
            len(params),
            sum(p.ds_tensor.numel() for p in params),
            sum(p.ds_numel for p in params),
        )

    def begin_micro(self, boundary: bool) -> None:
        """Tell DeepSpeed whether this micro batch ends the step, and that a forward begins
        (before its forward)."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        # deepspeed 0.19 runtime/engine.py `forward` first calls a ZeRO optimizer's
        # clear_backward_seen_flag: ZeRO-3 counts its micro steps there (stage3.py: micro step
        # 0 copies a gradient partition, later ones add). The rl ranks' passes go through
        # engine.forward (`__call__`) and so clear it too; here as well for a pass that does
        # not. Twice is harmless: only a backward sets the flag again.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def __call__(self, **inputs: Any) -> Any:
        """The top-level forward through DeepSpeed's engine (ZeRO-3's trace starts there)."""
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float | None:
        """Update; returns the gradient norm before clipping (with a plain fp32 optimizer
        measured here, on the gradients DeepSpeed has already averaged over the ranks)."""
        if self.own_norm:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None
            self.engine.step()
            return norm
        self.engine.step()
        found = self.engine.get_global_grad_norm()
        return None if found is None else float(found)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, root: str, tag: str) -> None:
        with self.awake():
            # frozen weights (a LoRA base) come from the input checkpoint when it resumes
            self.engine.save_checkpoint(
                root, tag=tag, save_latest=False, exclude_frozen_parameters=self.frozen
            )

    def _offload(self) -> int:
        """By `self.sleep.method` (`stages.lib.distributed.sleep`: what DeepSpeed 0.19 offers
        where)."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum as Device
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        method, opt = self.sleep.method, self.engine.optimizer
        if method == "trainer":  # ZeRO-0: torch AdamW, or the bf16 wrapper's fp32 copies too
            return self.host.offload(optimizer_tensors(opt, self.module))
        if method == "deepspeed":  # ZeRO-1/2: stage_1_and_2.py offload_states, any optimizer
            states = [State.hp_params, State.optim_states, State.lp_grads]
            self.engine.offload_states(include=states, device=Device.cpu, pin_memory=True)
            return 0
        # ZeRO-3: stage3.py asserts FusedAdam only for hp_params and optim_states; those two
        # are moved here as it moves them (their storage swapped), the rest by DeepSpeed
        moved = self.host.offload(
            [*opt.fp32_partitioned_groups_flat, *state_tensors(opt.optimizer)]
        )
        states = [State.lp_grads, State.contiguous_grad_buffer]
        self.engine.offload_states(include=states, device=Device.cpu, pin_memory=True)
        return moved

    def _reload(self) -> int:
        if self.sleep.method != "trainer":
            self.engine.reload_states()
        return self.host.reload()

    def load(self, root: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(root, tag=tag, load_module_strict=not self.frozen)
        if path is None:
            raise RuntimeError(f"deepspeed could not load the checkpoint {root}/{tag}")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Under ZeRO-3 (every rank calls it) the whole model's weights in host memory on rank
        0, gathered one module at a time (DeepSpeed's consolidated state dict: no rank holds
        the whole model on its GPU); None on the other ranks and without ZeRO-3."""
        if not self.zero3:
            return None
        return self.engine._zero3_consolidated_16bit_state_dict()  # type: ignore[no-any-return]
