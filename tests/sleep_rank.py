"""One DeepSpeed rank that puts its optimizer side to sleep between two steps, for the tests:
`python -m tests.sleep_rank ZERO BF16 DEVICE` prints one JSON line.

Two trainers start from the same weights and take the same two steps; one offloads and
reloads its states (`stages.lib.distributed.trainer`, by the method `stages.lib.distributed.sleep` picks for
a GPU) between them. Output: the method, what moved, the device bytes allocated before the
offload, after it and after the reload (CUDA only), which optimizer tensors were off the
device while asleep, and whether the two trainers' weights are identical at the end.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch


class Settings:
    learning_rate = 0.01
    weight_decay = 0.1
    warmup_ratio = 0.0
    lr_scheduler = "constant"
    overlap_comm = False
    micro_train_batch_size = 2
    train_batch_size = 2
    gradient_checkpointing = False

    def __init__(self, zero: int, bf16: bool) -> None:
        self.zero_stage, self.bf16, self.adam_offload = zero, bf16, False


def tiny() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def step(trainer: Any, seed: int, device: str) -> None:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    trainer.begin_micro(True)
    logits = trainer.forward({"input_ids": ids.to(device)})
    trainer.backward(logits.float().pow(2).mean())
    trainer.step()


def allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def main(zero: int, bf16: bool, device: str) -> dict[str, Any]:
    import deepspeed

    from stages.lib.distributed.ds_config import build_ds_config
    from stages.lib.distributed.offload import HostStates, optimizer_tensors
    from stages.lib.distributed.sleep import sleep_method
    from stages.lib.distributed.trainer import DeepSpeedTrainer

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if device != "cpu" else "gloo")
    cfg = Settings(zero, bf16)
    weights = tiny().state_dict()
    trainers = []
    for _ in range(2):
        model = tiny()
        model.load_state_dict(weights)
        trainers.append(DeepSpeedTrainer(model, cfg, 10, device, build_ds_config(cfg, 1)))
    plain, sleeper = trainers
    if device == "cpu":  # what a GPU rank does, between two places in host memory
        sleeper.sleep = sleep_method("deepspeed", zero, False, "cuda")
        sleeper.host = HostStates(pin=False)
    for t in trainers:
        step(t, 1, device)
    watched = _watched(sleeper)
    before = {k: v.data_ptr() for k, v in watched.items()}
    mem = [allocated(device)]
    moved = sleeper.offload()
    mem.append(allocated(device))
    away = sorted(k for k, v in watched.items() if v.data_ptr() != before[k] or v.is_cpu)
    sleeper.reload()
    mem.append(allocated(device))
    for t in trainers:
        step(t, 2, device)
    mine, theirs = sleeper.module.state_dict(), plain.module.state_dict()
    same = all(torch.equal(mine[k], theirs[k]) for k in theirs)
    own = optimizer_tensors(sleeper.engine.optimizer, sleeper.module)
    return {
        "method": sleeper.sleep.method,
        "moved": moved,
        "memory": mem,
        "away": away,
        "watched": sorted(watched),
        "optimizer_tensors": len(own),
        "identical": same,
    }


def _watched(trainer: Any) -> dict[str, torch.Tensor]:
    """The tensors that should leave: the inner optimizer's state, and the parameters it
    steps when they are fp32 master copies, not the model's own (under ZeRO-3 its groups
    are filled only during a step: its state's keys are those parameters)."""
    opt = trainer.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    own = {id(p) for p in trainer.module.parameters()}
    stepped = [p for g in inner.param_groups for p in g["params"]] + list(inner.state)
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(dict.fromkeys(stepped)):
        if id(p) not in own:
            out[f"master {i}"] = p
        for key, value in inner.state.get(p, {}).items():
            if torch.is_tensor(value) and value.numel() > 1:
                out[f"{key} {i}"] = value
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3])
    print("RESULT " + json.dumps(result), flush=True)
    import os

    os._exit(0)
