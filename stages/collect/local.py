"""The `local` backend: batched generation with transformers in the stage's own process.

Input: (prompt, samples still to do) pairs and a checkpoint directory.
Output: rollouts through the Recorder, a batch of `backend.batch_size`
prompts at a time, through `stages.lib.generate.generate`, which puts prompt
strings and message lists alike through the model's chat template (the
format the train stage trains on). A rollout's latency is its
batch's wall time. An exception in generation fails the stage (a missing
checkpoint is not a per-row failure); the rerun resumes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stages.collect.inputs import Prompt
from stages.collect.stats import Progress
from stages.lib.client import Completion
from stages.lib.config import LocalBackend

if TYPE_CHECKING:
    from stages.collect import CollectConfig
    from stages.collect.collector import Recorder


def collect_local(
    cfg: CollectConfig,
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
    device: str = "cpu",
) -> None:
    """Generate every pending sample in batches (on `device`) and record the rollouts."""
    assert isinstance(cfg.backend, LocalBackend)
    progress = Progress(recorder.log, track=recorder.track)
    recorder.stats.set_limit(cfg.backend.batch_size)
    batch: list[tuple[Prompt, list[int]]] = []
    for prompt, samples in work:
        if prompt.error is not None:
            for sample_idx in samples:
                recorder.bad_row(prompt, sample_idx)
            continue
        batch.append((prompt, samples))
        if len(batch) >= cfg.backend.batch_size:
            _generate_batch(cfg, batch, recorder, device)
            batch = []
            recorder.sink.flush()
            progress.maybe_report(recorder.stats)
    if batch:
        _generate_batch(cfg, batch, recorder, device)
    recorder.sink.flush()
    progress.close(recorder.stats)


def precision(cfg: CollectConfig) -> tuple[str, str]:
    """The dtype the backend's checkpoint is loaded in (`backend.precision`; auto: its own,
    `stages.lib.dtypes.resolve_precision`), and why."""
    from stages.lib.dtypes import resolve_precision

    assert isinstance(cfg.backend, LocalBackend) and cfg.backend.model is not None
    return resolve_precision(cfg.backend.precision, [cfg.backend.model])


def _generate_batch(
    cfg: CollectConfig, batch: list[tuple[Prompt, list[int]]], recorder: Recorder, device: str
) -> None:
    from stages.lib.generate import generate

    assert isinstance(cfg.backend, LocalBackend)
    prompts = [p.messages if p.messages is not None else (p.text or "") for p, _ in batch]
    start = time.perf_counter()
    recorder.stats.in_flight = len(batch) * cfg.num_repeats
    assert cfg.backend.model is not None  # the kind's check requires it
    outputs = generate(
        cfg.backend.model,
        prompts,
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_output_tokens,
        seed=cfg.seed + batch[0][0].idx,
        batch_size=cfg.backend.batch_size,
        device=device,
        dtype=precision(cfg)[0],
    )
    took = time.perf_counter() - start
    recorder.stats.in_flight = 0
    for (prompt, samples), generations in zip(batch, outputs, strict=True):
        for sample_idx in samples:
            gen = generations[sample_idx]
            out = Completion(gen.text, gen.finish_reason, gen.prompt_tokens, gen.completion_tokens)
            recorder.rollout(prompt, sample_idx, out, took)
