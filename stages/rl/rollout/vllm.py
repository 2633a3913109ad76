"""The rollout engines as vLLM servers: an rl stage with `backend: {kind: vllm}`.

Input: the model directory (the actor's starting weights and its tokenizer), the vllm
block, the devices the plan gives the `vllm` role. Output: what `LocalEngine` gives
(samples with token ids and the sampling distribution's log-probabilities, greedy
answers, the probe's log-probabilities), from `vllm_num_engines` OpenAI-compatible
servers (`stages.lib.backends.vllm.server`, one per tensor-parallel slice of the devices), each
prompt's group sent to one server, prompts spread over the servers in turn, one request
per sample with `num_samples_in_parallel` in flight (`stages.rl.rollout.vllm_requests`).
Where the servers run and how each starts, on this worker and on the role's other workers
(which publish their URLs through the link): `stages.rl.rollout.vllm_servers`; the
controller reaches, syncs and probes every server alike.

Weights (`stages.rl.sync.vllm`): a gloo or NCCL group from actor rank 0 into every server's workers,
through our worker extension (`--worker-extension-cls`, `stages.lib.backends.vllm.worker_ext`) and
vLLM's `/collective_rpc`; or, with `disk`, a safetensors file every server reloads. Either way each
server then drops its prefix cache and scores the probe. Those are development endpoints
(`VLLM_SERVER_DEV_MODE=1`); every request bears the run's secret.

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
sync and for the KV cache after it. With the actor's LoRA the servers run with vLLM's LoRA
support and every request names the newest adapter (`serve`; the sync: `VLLMLoraReceiver`).

One name, two sides of one concept (the rl stage's vLLM engines: the rollouts they generate;
`stages/rl/sync/vllm.py`: the weights synced into them).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from stages.lib.api.sampling import request_sampling
from stages.lib.backends.vllm.backend import VLLMBackend, vllm_block
from stages.lib.chat.prompt import Prompt
from stages.lib.chat.tokens import checkpoint_eos_ids, pad_id
from stages.lib.model.generate import Generation
from stages.rl.algo.logprobs import Sample
from stages.rl.rollout.vllm_requests import HTTPRollouts
from stages.rl.rollout.vllm_servers import (
    BRIEF_TIMEOUT_S,
    context_len,
    engine_devices,
    start_servers,
)
from stages.rl.sync.transports import other_kernels

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.rl import RLConfig

MEMORY_CALL_S = 600.0  # a server's sleep or wake: host <-> GPU copies of its weights


def start_vllm(cfg: RLConfig, ctx: StageContext, model_dir: str, log_file: str) -> VLLMEngine:
    """The controller's engine: its own worker's servers and, once they have started theirs,
    the servers of the `vllm` role's other workers (told the model through the link)."""
    import json

    from stages.lib.backends.vllm.auth import new_secret
    from stages.rl.roles.layout import role_workers

    backend = vllm_block(cfg.backend)
    here = ctx.tasks[0] if ctx.tasks else (None, None)
    others = [w for w in role_workers(ctx, "vllm") if w != here[1]]
    nodes = {s.worker: s.node for s in ctx.slots}
    secret = new_secret()  # one for the run's servers: in memory and the link, never on disk
    if others:
        assert ctx.link is not None
        ctx.link.publish("vllm-brief", json.dumps({"model_dir": model_dir, "secret": secret}))

    def remote() -> list[dict[str, Any]]:
        link = ctx.link
        return [
            json.loads(link.lookup(f"vllm-{nodes[w]}-{w}", timeout_s=BRIEF_TIMEOUT_S))
            for w in others
            if link is not None
        ]

    devices = engine_devices(ctx)
    return VLLMEngine(
        model_dir,
        backend,
        devices,
        bf16=cfg.bf16,
        log_file=log_file,
        timeout_s=cfg.sync_timeout_s,
        secret=secret,
        where={"node": here[0], "worker": here[1], "devices": devices},
        remote=remote,
        max_model_len=context_len(cfg),
        parallel=cfg.num_samples_in_parallel,
        lora_rank=cfg.lora.rank if cfg.lora is not None else 0,
    )


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
        lora_rank: int = 0,
    ) -> None:
        """Start this worker's servers on `devices`, then take the URLs of the servers the
        role's other workers started (`remote()`: their records, each with `urls`); every
        server requires `secret` on every request, and every request here bears it."""
        from transformers import AutoTokenizer

        from stages.lib.backends.vllm.auth import bearer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.probe_rule = other_kernels(bf16)  # vLLM's kernels: another function than the actor's
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
                    lora_rank=lora_rank,
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

    @property
    def stop_ids(self) -> list[int]:
        """The `stop_token_ids` every request sends."""
        return list(self.requests.stops)

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
                raw, kind = resp.read(), resp.headers.get("Content-Type") or ""
        except urllib.error.HTTPError as err:
            raise EngineFailed(f"{url}: HTTP {err.code}: {err.read().decode()[:500]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise EngineFailed(f"{url}: {err}") from None
        if not raw:
            return None
        # vLLM's LoRA routes answer in plain text ("Success: LoRA adapter ... added")
        return json.loads(raw) if "json" in kind else raw.decode(errors="replace")

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

    def serve(self, name: str) -> None:
        """Requests (generation and the probe) name `name` from now on: a LoRA adapter the
        servers loaded (`stages.rl.sync.vllm.VLLMLoraReceiver`), or the base model."""
        self.served = self.requests.served = name

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
