"""Collect from another ecosystem's agent: each (row, sample) pair is one episode that NeMo
Gym's agent plays against the stage's backend, served over HTTP.

Input: a range of NeMo Gym rows (`responses_create_params`, plus what the resources server
verifies with), the stage's config (an environment of kind `nemo_gym`) and the collector's
Recorder. Output: one JSONL line per episode, as pipe's own environments write them
(`stages.collect.multiturn.record_line`: the row's fields, `messages`, `tools`, `rewards`,
`total_reward`, `turns`, `solved`, `end`, `reward`, `usage`, `latency_s`; `error` and
`end: failed` for an episode the agent failed; `mask_sample` where it asks for it).

The backend's endpoint is opened first (`open_endpoint`: a vLLM server, an `openai`
server, or the `local` backend's model served by pipe in this process), then NeMo Gym's
servers with their model server pointed at it (`stages.lib.env.gym`). Every pair goes to
the agent's `/run` through the collector (`stages.collect.collector`): its concurrency
(`num_samples_in_parallel`, `auto` included), retries with backoff for what a retry may
fix (5xx, timeouts, lost connections), the failures sidecar and resume: an episode is
written once, when `/run` returns. At most `environment.concurrency` runs are in flight.
A `/run` that returns no run result fails its pair as a bad response.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stages.collect.collector import Collector, run_async
from stages.collect.multiturn import record_line
from stages.lib.api.client import RequestError
from stages.lib.env.responses import AgentClient, agent_episode, run_body

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.collect import CollectConfig
    from stages.collect.collector import Recorder
    from stages.collect.inputs import Prompt


class AgentCollector(Collector):
    """The collector, each pair one `/run` of the agent at `url`."""

    def __init__(
        self, *args: Any, url: str, sampling: dict[str, Any], concurrency_env: int, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.url, self.sampling = f"{url}/run", sampling
        self.env_gate = asyncio.Semaphore(concurrency_env)
        self.episodes_failed = 0

    async def _one(self, prompt: Prompt, sample_idx: int) -> None:
        try:
            body = run_body(prompt.row, self.sampling) if prompt.parsed else None
        except ValueError as exc:
            prompt.error, body = f"bad_row: {exc}", None
        if body is None:
            self.recorder.bad_row(prompt, sample_idx)
            return
        start = time.perf_counter()
        async with self.env_gate:
            out, _, attempts = await self.request(self.url, body)
        if not isinstance(out, RequestError):
            try:
                episode = agent_episode(prompt.row, out)
            except ValueError as exc:
                out = RequestError("bad_response", str(exc), retryable=True)
        if isinstance(out, RequestError):
            self.recorder.failure(prompt, sample_idx, out, attempts)
            return
        took = time.perf_counter() - start
        stats = self.stats
        line = record_line(
            prompt, sample_idx, episode.record(), episode.reward, episode.usage, took
        )
        self.sink.rollout(line)
        stats.written += 1
        stats.tokens_in += episode.usage[0]
        stats.tokens_out += episode.usage[1]
        stats.latency.add(took)
        if episode.error is not None:
            self.episodes_failed += 1
            if self.episodes_failed <= 3:
                self.recorder.log.warning(
                    "prompt %d sample %d: the agent failed the episode: %s",
                    prompt.idx,
                    sample_idx,
                    episode.error,
                )


def collect_agent(
    cfg: CollectConfig,
    ctx: StageContext,
    work: Iterator[tuple[Prompt, int]],
    recorder: Recorder,
) -> None:
    """Every pair of `work` through the agent, the backend served for NeMo Gym's model
    server (module docstring)."""
    from stages.lib.api.adaptive import AdaptiveLimit
    from stages.lib.backends.endpoint import Serving
    from stages.lib.devices import torch_device
    from stages.lib.env.gym import nemo_gym

    env = cfg.environment
    assert env is not None
    visible = ctx.device_env().get("CUDA_VISIBLE_DEVICES")
    serving = Serving(
        ctx.log,
        ctx.gpus,
        visible.split(",") if visible else None,
        ctx.path(f"{os.path.basename(cfg.output)}.{cfg.backend.kind}.log"),
        env.tool_call_parser,
        torch_device(ctx),
    )
    parallel = cfg.num_samples_in_parallel
    sampling = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_output_tokens": cfg.max_output_tokens,
    }
    with (
        cfg.backend.open_endpoint(serving) as endpoint,
        nemo_gym(env, endpoint, ctx.stage_dir, ctx.log) as url,
    ):
        client = AgentClient(env.timeout_s, 0 if parallel == "auto" else parallel)

        async def run() -> None:
            async with client:
                collector = AgentCollector(
                    client,
                    recorder,
                    url=url,
                    sampling=sampling,
                    concurrency_env=env.concurrency,
                    concurrency=AdaptiveLimit() if parallel == "auto" else parallel,
                    seed=cfg.seed,
                    num_repeats=cfg.num_repeats,
                    max_retries=cfg.max_retries,
                    backoff_s=cfg.backoff_s,
                )
                await collector.run(work)

        run_async(run())
