"""What every rank process (a train or rl rank) does first, and how it ends.

Input: the rank's environment (set by `stages.lib.distributed.spawn`) and its brief
(`stages.lib.distributed.brief.RankBrief`: device kind, trainer, threads). Output: logging whose
marked lines (`@pipe LEVEL ...`) the launcher passes on to the stage's log, the process group
(gloo on CPU, NCCL on GPU; DeepSpeed's when it trains), the trainer around the model,
and an exit that skips the interpreter's teardown once everything is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.lib.distributed.brief import RankBrief

PARENT_ENV = "PIPE_TRAIN_PARENT_PID"
MARK = "@pipe "  # lines the launcher passes on to the stage's log; the rest go to the log file only


def setup(rank: int, threads: int) -> None:
    """Quiet libraries, mark our own log lines (every `pipe.*` logger: the role's and the
    shared trainer's and loader's; rank 0 logs INFO), set torch threads."""
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{MARK}%(levelname)s %(message)s"))
    ours = logging.getLogger("pipe")
    ours.handlers = [handler]
    ours.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    ours.propagate = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*(barrier|destroy_process_group|TypedStorage).*")
    import torch

    torch.set_num_threads(threads)


def collective_timeout_s() -> float:
    """How long one collective of the ranks may take before it fails its rank (and the
    launcher the stage): 30 minutes, long enough for a 70B model's gathers at a save;
    `PIPE_COLLECTIVE_TIMEOUT_S` overrides it. DeepSpeed's default is 10 minutes and torch's
    10 (NCCL) or 30 (gloo): given explicitly so every backend waits the same. The ranks'
    idle wait between two requests is not a collective (`stages.lib.distributed.serve`), so the
    controller generating, evaluating or saving for longer kills nothing."""
    return float(os.environ.get("PIPE_COLLECTIVE_TIMEOUT_S", 1800))


def init_distributed(trainer: str, device: str, world: int) -> None:
    """The process group of this rank (from the environment): gloo on CPU, NCCL on GPU, with
    an explicit timeout (`collective_timeout_s`)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=collective_timeout_s())
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if trainer == "deepspeed":
        import deepspeed

        if device == "cpu":
            # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op on first use
            # (~40 s on a fresh machine); only tensor-parallel inference calls it, not training
            with contextlib.suppress(Exception):
                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    elif world > 1:
        dist.init_process_group(backend, timeout=timeout)


def load_model(
    model_dir: str, ds_config: dict[str, Any] | None, dtype: Any = None, *, reward: bool = False
) -> Any:
    """The causal LM of `model_dir` (with `reward`: the same network with a one-label
    sequence-classification head instead, `...ForSequenceClassification`, its head read from
    the checkpoint when it has one, else newly initialised) in `dtype` (default: bf16 when
    DeepSpeed trains in bf16,
    which casts the module to bf16 and keeps its fp32 master copies from those values anyway,
    so every ZeRO-0/1/2 rank's host copy is half the fp32 one; fp32 otherwise, also for the
    torch trainer, whose bf16 is autocast over fp32 weights). Under ZeRO-3 it is built inside
    DeepSpeed's `zero.Init`, so each parameter is partitioned as soon as it is made, and the
    checkpoint's tensors are read one at a time on rank 0 and scattered (what Hugging
    Face's DeepSpeed integration does): no rank ever holds the whole model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto: Any = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    head = {"num_labels": 1} if reward else {}
    bf16 = bool((ds_config or {}).get("bf16", {}).get("enabled"))
    dtype = dtype or (torch.bfloat16 if bf16 else torch.float32)
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        model = auto.from_pretrained(model_dir, dtype=dtype, **head)
    else:
        import deepspeed
        from transformers.initialization import no_init_weights

        config = AutoConfig.from_pretrained(model_dir, **head)
        # no random init (the checkpoint overwrites it, and it cannot index a partition)
        with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = auto.from_config(config, dtype=dtype)
        model.tie_weights()  # init_weights, skipped, ties them otherwise
        _rotary_as_transformers_makes_it(model)
        missing = _load_partitioned(model, model_dir)
        if reward and "score.weight" in missing:
            _init_head(model.score, config.initializer_range)
    model.config.use_cache = False
    return model


def _rotary_as_transformers_makes_it(model: Any) -> None:
    """Rotary embeddings' frequencies as transformers computes them (fp32), not as zero.Init
    made them: it creates every floating tensor of a module's __init__ in the training dtype,
    so a bf16 run's `inv_freq` was computed in bf16 (1.8e-4 off on the tiny Llama), and the
    actor's RoPE was another function than the engines' (the probe after a sync saw 0.00109
    nats at step 0). Each rotary module has no weights: it is built again here, outside
    zero.Init, and its buffers replace the ones zero.Init made."""
    for module in model.modules():
        config = getattr(module, "config", None)
        rotary = type(module).__name__.endswith("RotaryEmbedding")
        if not rotary or config is None or any(module.parameters()):
            continue
        fresh = type(module)(config)
        for name, buffer in fresh.named_buffers(recurse=False):
            old = getattr(module, name)
            module.register_buffer(name, buffer.to(old.device), persistent=False)


def _init_head(head: Any, std: float) -> None:
    """A new reward head under ZeRO-3 as transformers initialises one: normal(0, std)."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([head.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            head.weight.data.normal_(mean=0.0, std=std)


def _load_partitioned(model: Any, model_dir: str) -> set[str]:
    """Fill a ZeRO-3 model from the checkpoint's safetensors, one module's weights at a time;
    the names of the parameters the checkpoint does not hold."""
    import json

    import deepspeed
    import torch.distributed as dist
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            where = {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(model_dir, "model.safetensors")
        with safe_open(single, "pt") as f:
            where = dict.fromkeys(f.keys(), single)
    rank0 = dist.get_rank() == 0
    read = 0
    missing: set[str] = set()
    for prefix, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            if rank0:
                for name, param in params.items():
                    key = f"{prefix}.{name}" if prefix else name
                    if key in where:  # absent: tied to a weight loaded under another name
                        with safe_open(where[key], "pt") as f:
                            param.data.copy_(f.get_tensor(key))
                        read += 1
        missing.update(
            f"{prefix}.{n}" if prefix else n
            for n in params
            if (f"{prefix}.{n}" if prefix else n) not in where
        )
    if rank0:
        logging.getLogger("pipe.rank").info(
            "zero 3: %d checkpoint tensors read one module at a time into the partitions", read
        )
    return missing


def make_trainer(
    trainer: str, ds_config: dict[str, Any] | None, cfg: Any, model: Any, total: int, device: str
) -> Any:
    """The `Trainer` (`trainer`: deepspeed with `ds_config`, or torch) around `model`, in
    training mode."""
    from stages.lib.distributed.trainer import DeepSpeedTrainer, TorchTrainer

    model.train()  # from_pretrained returns eval mode, where checkpointing is skipped
    if cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if trainer == "deepspeed" and ds_config is not None:
        return DeepSpeedTrainer(model, cfg, total, device, ds_config)
    return TorchTrainer(model, cfg, total, device)


def start_rank(brief: RankBrief) -> tuple[int, int, str]:
    """This rank's place from its environment (RANK, WORLD_SIZE, LOCAL_RANK), set up
    (`setup`) on its device (`cuda:<local rank>` where the brief says cuda, else cpu) and in
    its process group (`init_distributed`): its rank, the world size and the device."""
    import torch

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    setup(rank, brief.threads)
    device = f"cuda:{local}" if brief.device == "cuda" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(local)
    init_distributed(brief.trainer, device, world)
    return rank, world, device


def leave_group() -> None:
    """Destroy the process group, where one was made (a single torch rank makes none)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the stage process dies (no orphans training on)."""
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: everything is written and flushed by now,
    and a gloo or DeepSpeed thread still joinable there aborts the process now and then
    ("terminate called without an active exception", SIGABRT) after a run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
