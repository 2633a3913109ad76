"""Where the rl stage's vLLM servers run and how each starts, on every worker of the
`vllm` role.

Input: the model directory, the vllm block, the `vllm` role's devices on this worker (from
the plan) and the run's secret. Output: this worker's OpenAI-compatible servers
(`stages.lib.backends.vllm.server`, one per tensor-parallel slice of the devices) and their URLs:
the controller's worker starts its own under its engine (`start_servers`, from
`stages.rl.rollout.vllm.VLLMEngine`); the role's other workers start the servers on their
own devices (`host_servers`, in the stage's task there), bound to the worker's reachable
address, and publish their URLs through the link.

Each server's command line (`server_args`): the training precision, `--logprobs-mode
processed_logprobs` (a sampled token's log-probability under the temperature-scaled
distribution, as the actor's ratio needs), the weight-sync worker extension
(`--worker-extension-cls`, `stages.lib.backends.vllm.worker_ext`), and on GPUs the context length
(`context_len`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from engine.stage import visible_names
from stages.lib.backends.vllm.backend import VLLMBackend, vllm_block

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

log = logging.getLogger("pipe.rl")
BRIEF_TIMEOUT_S = 900.0
HOLD_S = 7 * 24 * 3600.0  # a worker's servers run until the controller says stop


def engine_devices(ctx: StageContext) -> list[str]:
    """The `vllm` role's devices on this worker as its CUDA_VISIBLE_DEVICES names them (GPU
    or MIG UUIDs where it lists those: a raw id would name another device, or none)."""
    return visible_names(ctx.devices("vllm"))


def context_len(cfg: RLConfig) -> int:
    """The servers' context: the longest prompt + answer trained on (`max_length`) plus an
    answer's tokens, so a prompt of up to `max_length` tokens is still served."""
    return cfg.max_length + cfg.max_output_tokens


# the ranks vLLM's LoRA support accepts for --max-lora-rank (vllm/config/lora.py `MaxLoRARanks`)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter exists then


def lora_rank_arg(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of `rank`."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def server_args(bf16: bool, gpu: bool, max_model_len: int | None, lora_rank: int = 0) -> list[str]:
    """What the rl stage adds to each server's command line: the training precision,
    sampled log-probabilities under the temperature, the weight-sync worker extension, on
    GPUs the context length, and with the actor's LoRA vLLM's LoRA support (one adapter
    serving at a time, the previous one kept in host memory until it is unloaded)."""
    from stages.lib.backends.vllm.worker_ext import EXTENSION

    args = ["--dtype", "bfloat16" if bf16 else "float32"]
    args += ["--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION]
    if gpu and max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank_arg(lora_rank))]
        args += ["--max-loras", "1", "--max-cpu-loras", "2"]
    return args


@contextmanager
def start_servers(
    backend: VLLMBackend,
    model_dir: str,
    devices: Sequence[str],
    *,
    bf16: bool,
    log_file: str,
    secret: str,
    host: str | None = None,
    max_model_len: int | None = None,
    lora_rank: int = 0,
) -> Iterator[list[str]]:
    """This worker's servers of the `vllm` role: one per tensor-parallel slice of `devices`
    (the backend's `vllm_num_engines` on a CPU run); yields their base URLs. Devices a
    worker declares on a machine without CUDA (a loopback cluster standing in for nodes)
    get as many CPU servers, the device ids recorded but not handed to vLLM. On GPUs the
    context is `max_model_len` (the stage's prompt + answer lengths: `context_len`), not the
    checkpoint's own maximum, whose KV cache may not fit the servers' share of the GPU (vLLM
    refuses to start then); on the CPU `--max-model-len auto` fits it to the cache. An fp32
    engine on GPUs computes in fp32, not TF32 (`FP32_EXACT_ENV`): the probe's 1e-4 holds."""
    import torch

    from stages.lib.backends.vllm.server import FP32_EXACT_ENV, vllm_servers

    size = backend.engine_size
    update: dict[str, Any] = {"model": model_dir}
    if devices:
        update["vllm_num_engines"] = max(1, len(devices) // size)
        if not torch.cuda.is_available():
            update["vllm_tensor_parallel_size"] = 1
            update["vllm_pipeline_parallel_size"] = 1
            devices = []
    args = server_args(bf16, bool(devices), max_model_len, lora_rank)
    fp32_gpu = bool(devices) and not bf16
    env = {**(FP32_EXACT_ENV if fp32_gpu else {}), **(LORA_ENV if lora_rank else {})}
    with vllm_servers(
        backend.model_copy(update=update),
        gpus=len(devices),
        log=log,
        log_file=log_file,
        extra_args=args,
        devices=list(devices) or None,
        dev_mode=True,
        secret=secret,
        host=host or "127.0.0.1",
        extra_env=env or None,
    ) as urls:
        yield urls


def host_servers(cfg: RLConfig, ctx: StageContext) -> None:
    """A task of another worker of the `vllm` role: start the servers on this worker's
    devices, bound to its reachable address, publish their URLs, and keep them until the
    controller says stop (or the stage aborts)."""
    from stages.rl.roles.layout import worker_host

    assert ctx.link is not None
    node, worker = ctx.tasks[ctx.node_rank]
    brief = json.loads(ctx.link.lookup("vllm-brief", timeout_s=BRIEF_TIMEOUT_S))
    devices = engine_devices(ctx)
    with start_servers(
        vllm_block(cfg.backend),
        brief["model_dir"],
        devices,
        bf16=cfg.bf16,
        log_file=f"{ctx.stage_dir.rstrip('/')}/vllm.{ctx.node_rank}.log",
        secret=brief["secret"],
        host=worker_host(worker),
        max_model_len=context_len(cfg),
        lora_rank=cfg.lora.rank if cfg.lora is not None else 0,
    ) as urls:
        place = {"node": node, "worker": worker, "devices": devices, "urls": urls}
        ctx.link.publish(f"vllm-{node}-{worker}", json.dumps(place))
        ctx.link.lookup("vllm-stop", timeout_s=HOLD_S)
