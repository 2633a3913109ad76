"""The rollout engines as vLLM servers: an rl stage with `backend: {kind: vllm}`.

Input: the model directory (the actor's starting weights and its tokenizer), the vllm
block, the devices the plan gives the `vllm` role. Output: what `LocalEngine` gives
(samples with token ids and the sampling distribution's log-probabilities, greedy
answers, the probe's log-probabilities), from `vllm_num_engines` OpenAI-compatible
servers (`stages.lib.vllm.server`, one per tensor-parallel slice of the devices), each
prompt's group sent to one server, prompts spread over the servers in turn, one request
per sample with `num_samples_in_parallel` in flight (`stages.rl.rollout.vllm_requests`). The role's
other workers start the servers on their own devices (`host_servers`, in the stage's task
there), bound to the worker's reachable address, and publish their URLs through the
link; the controller reaches, syncs and probes every server alike.

Weights (`stages.rl.sync.vllm`): a gloo or NCCL group from actor rank 0 into every
server's workers, through our worker extension (`--worker-extension-cls`,
`stages.lib.vllm.worker_ext`) and vLLM's `/collective_rpc`; or, with `disk`, a safetensors file
every server reloads. Either way each server then drops its prefix cache and scores the
probe. Those are development endpoints (`VLLM_SERVER_DEV_MODE=1`); every request bears
the run's secret.

Log-probabilities: the servers run with `--logprobs-mode processed_logprobs`, so a
sampled token's log-probability is taken under the temperature-scaled distribution, as
the actor's ratio needs; nothing else shapes that distribution: the servers start with
`--generation-config vllm` and every request sends every sampling field, top-k, top-p,
min-p and the penalties neutral (`stages.lib.api.sampling`), so a checkpoint's
`generation_config.json` (Qwen2.5-Instruct's top_k 20, top_p 0.8, repetition_penalty
1.05) does not change the policy sampled: softmax(logits / temperature) over the whole
vocabulary. The probe is scored from `prompt_logprobs` (the raw model),
so both sides score it at temperature 1. Sleep (`vllm_enable_sleep`, GPU only):
`/sleep?level=1` while the actor trains, then `/wake_up` for the weights before the
sync and for the KV cache after it.

One name, two sides of one concept (the rl stage's vLLM engines: the rollouts they generate;
`stages/rl/sync/vllm.py`: the weights synced into them).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from engine.stage import visible_names
from stages.lib.api.sampling import request_sampling
from stages.lib.chat.prompt import Prompt
from stages.lib.chat.tokens import checkpoint_eos_ids, pad_id
from stages.lib.config import VLLMBackend
from stages.lib.model.generate import Generation
from stages.rl.algo.logprobs import Sample
from stages.rl.rollout.vllm_requests import HTTPRollouts

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

log = logging.getLogger("pipe.rl")
SPEC_TIMEOUT_S = 900.0
MEMORY_CALL_S = 600.0  # a server's sleep or wake: host <-> GPU copies of its weights
HOLD_S = 7 * 24 * 3600.0  # a worker's servers run until the controller says stop


def engine_devices(ctx: StageContext) -> list[str]:
    """The `vllm` role's devices on this worker as its CUDA_VISIBLE_DEVICES names them (GPU
    or MIG UUIDs where it lists those: a raw id would name another device, or none)."""
    return visible_names(ctx.devices("vllm"))


def context_len(cfg: RLConfig) -> int:
    """The servers' context: the longest prompt + answer trained on (`max_length`) plus an
    answer's tokens, so a prompt of up to `max_length` tokens is still served."""
    return cfg.max_length + cfg.max_output_tokens


def server_args(bf16: bool, gpu: bool, max_model_len: int | None) -> list[str]:
    """What the rl stage adds to each server's command line: the training precision,
    sampled log-probabilities under the temperature, the weight-sync worker extension, and
    on GPUs the context length."""
    from stages.lib.vllm.worker_ext import EXTENSION

    args = ["--dtype", "bfloat16" if bf16 else "float32"]
    args += ["--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION]
    if gpu and max_model_len:
        args += ["--max-model-len", str(max_model_len)]
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

    from stages.lib.vllm.server import FP32_EXACT_ENV, vllm_servers

    tp = backend.vllm_tensor_parallel_size
    update: dict[str, Any] = {"model": model_dir}
    if devices:
        update["vllm_num_engines"] = max(1, len(devices) // tp)
        if not torch.cuda.is_available():
            update["vllm_tensor_parallel_size"] = 1
            devices = []
    args = server_args(bf16, bool(devices), max_model_len)
    fp32_gpu = bool(devices) and not bf16
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
        extra_env=FP32_EXACT_ENV if fp32_gpu else None,
    ) as urls:
        yield urls


def start_vllm(cfg: RLConfig, ctx: StageContext, model_dir: str, log_file: str) -> VLLMEngine:
    """The controller's engine: its own worker's servers and, once they have started theirs,
    the servers of the `vllm` role's other workers (told the model through the link)."""
    import json

    from stages.lib.vllm.auth import new_secret
    from stages.rl.roles.layout import role_workers

    assert isinstance(cfg.backend, VLLMBackend)
    here = ctx.tasks[0] if ctx.tasks else (None, None)
    others = [w for w in role_workers(ctx, "vllm") if w != here[1]]
    nodes = {s.worker: s.node for s in ctx.slots}
    secret = new_secret()  # one for the run's servers: in memory and the link, never on disk
    if others:
        assert ctx.link is not None
        ctx.link.publish("vllm-spec", json.dumps({"model_dir": model_dir, "secret": secret}))

    def remote() -> list[dict[str, Any]]:
        link = ctx.link
        return [
            json.loads(link.lookup(f"vllm-{nodes[w]}-{w}", timeout_s=SPEC_TIMEOUT_S))
            for w in others
            if link is not None
        ]

    devices = engine_devices(ctx)
    return VLLMEngine(
        model_dir,
        cfg.backend,
        devices,
        bf16=cfg.bf16,
        log_file=log_file,
        timeout_s=cfg.sync_timeout_s,
        secret=secret,
        where={"node": here[0], "worker": here[1], "devices": devices},
        remote=remote,
        max_model_len=context_len(cfg),
        parallel=cfg.num_samples_in_parallel,
    )


def host_servers(cfg: RLConfig, ctx: StageContext) -> None:
    """A task of another worker of the `vllm` role: start the servers on this worker's
    devices, bound to its reachable address, publish their URLs, and keep them until the
    controller says stop (or the stage aborts)."""
    import json

    from stages.rl.roles.layout import worker_host

    assert ctx.link is not None and isinstance(cfg.backend, VLLMBackend)
    node, worker = ctx.tasks[ctx.node_rank]
    spec = json.loads(ctx.link.lookup("vllm-spec", timeout_s=SPEC_TIMEOUT_S))
    devices = engine_devices(ctx)
    with start_servers(
        cfg.backend,
        spec["model_dir"],
        devices,
        bf16=cfg.bf16,
        log_file=f"{ctx.stage_dir.rstrip('/')}/vllm.{ctx.node_rank}.log",
        secret=spec["secret"],
        host=worker_host(worker),
        max_model_len=context_len(cfg),
    ) as urls:
        place = {"node": node, "worker": worker, "devices": devices, "urls": urls}
        ctx.link.publish(f"vllm-{node}-{worker}", json.dumps(place))
        ctx.link.lookup("vllm-stop", timeout_s=HOLD_S)


class EngineFailed(RuntimeError):
    """A server refused or failed a request."""


class VLLMEngine:
    """`vllm_num_engines` vLLM servers started for the stage, stopped by `close`."""

    model = None  # the weights live in the servers: receivers reload them there

    def __init__(
        self,
        model_dir: str,
        backend: VLLMBackend,
        devices: Sequence[str],
        *,
        bf16: bool,
        log_file: str,
        timeout_s: float,
        secret: str,
        where: dict[str, Any] | None = None,
        remote: Callable[[], list[dict[str, Any]]] | None = None,
        max_model_len: int | None = None,
        parallel: int | str = "auto",
    ) -> None:
        """Start this worker's servers on `devices`, then take the URLs of the servers the
        role's other workers started (`remote()`: their records, each with `urls`); every
        server requires `secret` on every request, and every request here bears it."""
        from transformers import AutoTokenizer

        from stages.lib.vllm.auth import bearer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.served = model_dir
        self.timeout_s = timeout_s
        import torch

        # vLLM's sleep mode needs CUDA (its CPU build has none)
        self.sleeping_allowed = (
            backend.vllm_enable_sleep and bool(devices) and torch.cuda.is_available()
        )
        self._headers = {"Content-Type": "application/json", **bearer(secret)}
        self._stack = ExitStack()
        try:
            urls = self._stack.enter_context(
                start_servers(
                    backend,
                    model_dir,
                    devices,
                    bf16=bf16,
                    log_file=log_file,
                    secret=secret,
                    max_model_len=max_model_len,
                )
            )
            places = [{**(where or {}), "urls": urls}, *(remote() if remote else [])]
        except BaseException:
            self._stack.close()
            raise
        self.urls = [u.removesuffix("/v1") for p in places for u in p["urls"]]
        self.names = [f"vllm-{i}" for i in range(len(self.urls))]
        self.name = ",".join(self.names)
        self.where = [
            {"name": name, **{k: v for k, v in p.items() if k != "urls"}}
            for name, p in zip(self.names, [p for p in places for _ in p["urls"]], strict=True)
        ]
        self.requests = HTTPRollouts(
            self.urls,
            self.tokenizer,
            self.served,
            self._headers,
            timeout_s,
            parallel,
            checkpoint_eos_ids(model_dir, self.tokenizer),
        )

    @property
    def pad_id(self) -> int:
        return pad_id(self.tokenizer)

    def close(self) -> None:
        self._stack.close()

    def healthy(self, url: str) -> bool:
        """Whether the server at `url` answers `GET /health` (its engine core alive)."""
        req = urllib.request.Request(f"{url}/health", headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def load(self, receiver: Any) -> None:
        """The weights into every server (the receiver reloads each)."""
        receiver.apply(None)

    def post(self, url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(url, data=data, headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise EngineFailed(f"{url}: HTTP {err.code}: {err.read().decode()[:500]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise EngineFailed(f"{url}: {err}") from None
        return json.loads(raw) if raw else None

    # --- generation -------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], **kwargs: Any) -> list[list[Generation]]:
        """`num_samples` answers per prompt with token ids and, when sampling, the sampling
        distribution's log-probabilities: one request per sample, `num_samples_in_parallel`
        in flight (`stages.rl.rollout.vllm_requests`)."""
        return self.requests.generate(prompts, **kwargs)

    @property
    def stats(self) -> dict[str, Any]:
        """The latest step's requests: in flight, the servers' queue wait, tokens/s."""
        return self.requests.stats

    # --- weights ----------------------------------------------------------------------
    def scores(self, sample: Sample) -> dict[str, list[float]]:
        """Each server's log-probabilities of the sample's completion (temperature 1)."""
        out = {}
        for name, url in zip(self.names, self.urls, strict=True):
            body = {
                "model": self.served,
                "prompt": list(sample.ids),
                "max_tokens": 1,
                **request_sampling(1.0),
                "prompt_logprobs": 0,
            }
            data = self.post(f"{url}/v1/completions", body, self.timeout_s)
            rows = data["choices"][0]["prompt_logprobs"]
            out[name] = [
                float(rows[k][str(tok)]["logprob"])
                for k, tok in enumerate(sample.ids)
                if k >= sample.prompt_len
            ]
        return out

    def reload(self, weights_dir: str) -> None:
        """Every server takes the weights in `weights_dir` (safetensors, the model's names)."""
        for url in self.urls:
            self.post(
                f"{url}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                self.timeout_s,
            )
            self.post(f"{url}/reset_prefix_cache", None, self.timeout_s)

    def sleep(self) -> None:
        """Weights to host memory, KV cache freed (GPU, `vllm_enable_sleep`). Not part of a
        sync: bounded by `MEMORY_CALL_S`, not `sync_timeout_s` (copying a large model's
        weights to host memory can take longer than a sync of a small one)."""
        for url in self.urls:
            self.post(f"{url}/sleep?level=1", None, MEMORY_CALL_S)

    def wake(self, tags: str) -> None:
        """`weights` before a sync, `kv_cache` after it (bounded by `MEMORY_CALL_S`)."""
        for url in self.urls:
            self.post(f"{url}/wake_up?tags={tags}", None, MEMORY_CALL_S)
