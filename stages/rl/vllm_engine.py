"""The rollout engines as vLLM servers: an rl stage with `backend: {kind: vllm}`.

Input: the model directory (the actor's starting weights and its tokenizer), the vllm
block, the devices the plan gives the `vllm` role. Output: what `LocalEngine` gives
(samples with token ids and the sampling distribution's log-probabilities, greedy
answers, the probe's log-probabilities), from `vllm_num_engines` OpenAI-compatible
servers (`stages.lib.vllm_server`, one per tensor-parallel slice of the devices), each
prompt's group sent to one server, prompts spread over the servers in turn.

Weights: the actor's rank 0 writes them to `<stage>/sync/model.safetensors` (the disk
sync) and every server reloads them in place (`reload_weights` through vLLM's
`/collective_rpc`) and drops its prefix cache, then the probe is scored on every server.
Those are development endpoints: the servers run with `VLLM_SERVER_DEV_MODE=1`, bound to
127.0.0.1. vLLM's NCCL and IPC weight transfer need its trainer-side engine in the
actor's interpreter, where vLLM is not installed (it pins its own torch); a run that
asks for nccl or gloo with vLLM engines syncs through disk and records why.

Log-probabilities: the servers run with `--logprobs-mode processed_logprobs`, so a
sampled token's log-probability is taken under the temperature-scaled distribution, as
the actor's ratio needs. The probe is scored from `prompt_logprobs` (the raw model),
so both sides score it at temperature 1. Sleep (`vllm_enable_sleep`, GPU only):
`/sleep?level=1` while the actor trains, then `/wake_up` for the weights before the
sync and for the KV cache after it.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

from stages.lib.config import VLLMBackend
from stages.lib.generate import Generation
from stages.lib.prompt import Prompt, format_prompt
from stages.rl.logprobs import Sample

log = logging.getLogger("pipe.rl")
REQUESTS_PER_SERVER = 16


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
    ) -> None:
        from transformers import AutoTokenizer

        from stages.lib.vllm_auth import bearer, new_secret
        from stages.lib.vllm_server import vllm_servers

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.served = model_dir
        self.timeout_s = timeout_s
        self.sleeping_allowed = backend.vllm_enable_sleep and bool(devices)
        args = ["--dtype", "bfloat16" if bf16 else "float32"]
        args += ["--logprobs-mode", "processed_logprobs"]
        secret = new_secret()  # every request bears it: the servers refuse the rest
        self._headers = {"Content-Type": "application/json", **bearer(secret)}
        self._stack = ExitStack()
        try:
            urls = self._stack.enter_context(
                vllm_servers(
                    backend.model_copy(update={"model": model_dir}),
                    gpus=len(devices),
                    log=log,
                    log_file=log_file,
                    extra_args=args,
                    devices=list(devices) or None,
                    dev_mode=True,
                    secret=secret,
                )
            )
        except BaseException:
            self._stack.close()
            raise
        self.urls = [u.removesuffix("/v1") for u in urls]
        self.names = [f"vllm-{i}" for i in range(len(self.urls))]
        self.name = ",".join(self.names)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def close(self) -> None:
        self._stack.close()

    def _post(self, url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
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
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        num_samples: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        batch_size: int,
    ) -> list[list[Generation]]:
        """`num_samples` answers per prompt with token ids and, when sampling, the sampling
        distribution's log-probabilities (`batch_size` is the servers' business here)."""
        encoded = [
            list(
                self.tokenizer(format_prompt(self.tokenizer, p), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            for p in prompts
        ]

        def one(i: int) -> list[Generation]:
            body: dict[str, Any] = {
                "model": self.served,
                "prompt": encoded[i],
                "n": num_samples,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "return_token_ids": True,
                "skip_special_tokens": True,
            }
            if temperature > 0:
                body |= {"seed": seed + i, "logprobs": 0}
            data = self._post(f"{self.urls[i % len(self.urls)]}/v1/completions", body)
            choices = sorted(data["choices"], key=lambda c: c["index"])
            return [self._generation(c, encoded[i]) for c in choices]

        workers = max(1, min(len(prompts), REQUESTS_PER_SERVER * len(self.urls)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _generation(self, choice: dict[str, Any], prompt_ids: list[int]) -> Generation:
        ids = [int(t) for t in choice.get("token_ids") or []]
        eos = self.tokenizer.eos_token_id
        stopped = choice.get("finish_reason") == "stop"
        if stopped and eos is not None and (not ids or ids[-1] != eos):
            ids.append(int(eos))  # the update scores the end-of-sequence token too
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return Generation(
            text=choice.get("text", ""),
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(ids),
            token_ids=tuple(ids),
            logprobs=tuple(float(x) for x in lps[: len(ids)]),
            prompt_ids=tuple(prompt_ids),
        )

    # --- weights ----------------------------------------------------------------------
    def scores(self, sample: Sample) -> dict[str, list[float]]:
        """Each server's log-probabilities of the sample's completion (temperature 1)."""
        out = {}
        for name, url in zip(self.names, self.urls, strict=True):
            body = {
                "model": self.served,
                "prompt": list(sample.ids),
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
            }
            data = self._post(f"{url}/v1/completions", body, self.timeout_s)
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
            self._post(
                f"{url}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                self.timeout_s,
            )
            self._post(f"{url}/reset_prefix_cache", None, self.timeout_s)

    def sleep(self) -> None:
        """Weights to host memory, KV cache freed (GPU, `vllm_enable_sleep`)."""
        for url in self.urls:
            self._post(f"{url}/sleep?level=1", None, self.timeout_s)

    def wake(self, tags: str) -> None:
        """`weights` before a sync, `kv_cache` after it."""
        for url in self.urls:
            self._post(f"{url}/wake_up?tags={tags}", None, self.timeout_s)


class VLLMDiskReceiver:
    """The disk sync into vLLM servers: the actor writes the file, the servers reload it."""

    pulls = True

    def __init__(self, engine: VLLMEngine, path: str) -> None:
        self.engine, self.path = engine, path
        self.name = engine.name

    def apply(self, model: Any) -> None:
        import os

        self.engine.reload(os.path.dirname(self.path))
