"""Collect through a backend that generates in the stage's own process (its `in_process`
generator: the `local` backend's batched transformers generation).

Input: (prompt, samples still to do) pairs and a checkpoint directory.
Output: rollouts through the Recorder, a batch of the generator's `batch_size`
prompts at a time, through its `generate` (`stages.lib.model.generate.generate`), which puts prompt
strings and message lists alike through the model's chat template (the
format the train stage trains on). A rollout's latency is its
batch's wall time. An exception in generation fails the stage (a missing
checkpoint is not a per-row failure); the rerun resumes.

With an environment, it plays one episode per pending (prompt,
sample) pair, `batch_size` pairs at a time, with evaluate's batched driver
(`stages.lib.env.message_play.play_batched` and `local_answer`: every turn's open conversations in
one generation call, each rendered by the chat template with the generation prompt). Its
lines are the HTTP path's (`stages.collect.multiturn.episode_line`: messages, per-turn
rewards, total_reward, turns, solved, end, reward, usage summed over the turns, and
latency_s, here the batch's wall time), each written once, when its batch has ended, so a
killed run redoes at most the batch it was playing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from stages.collect.inputs import Prompt
from stages.collect.stats import Progress
from stages.lib.api.client import Completion
from stages.lib.backends.protocol import InProcess
from stages.lib.env.contract import Episode

if TYPE_CHECKING:
    from stages.collect import CollectConfig
    from stages.collect.collector import Recorder

T = TypeVar("T")


def collect_in_process(
    cfg: CollectConfig,
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
    device: str = "cpu",
) -> None:
    """Every pending sample generated (or, with an environment, every pending pair's episode
    played) in batches on `device`, and recorded."""
    if cfg.environment is not None:
        _episodes(cfg, work, recorder, device)
        return
    engine, model, dtype = _engine(cfg)  # the dtype read once: the checkpoint's config.json
    _in_batches(
        work,
        recorder,
        engine.batch_size,
        usable=lambda prompt: prompt.error is None,
        items=lambda prompt, samples: [(prompt, samples)],  # a prompt's samples together
        run=lambda batch: _generate_batch(cfg, engine, model, batch, recorder, device, dtype),
    )


def precision(cfg: CollectConfig) -> tuple[str, str] | None:
    """The dtype the backend loads its checkpoint in (`backend.precision`; auto: its own,
    `stages.lib.model.dtypes.resolve_precision`), and why; None: it loads none here."""
    model = cfg.backend.model
    return None if model is None else cfg.backend.load_dtype([model])


def _engine(cfg: CollectConfig) -> tuple[InProcess, str, str | None]:
    """The backend's in-process generator, its checkpoint and the dtype it loads it in."""
    engine, model = cfg.backend.in_process(), cfg.backend.model
    assert engine is not None and model is not None  # the caller's and the kind's checks
    loaded = precision(cfg)
    return engine, model, loaded[0] if loaded else None


def _in_batches(
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
    size: int,
    usable: Callable[[Prompt], bool],
    items: Callable[[Prompt, list[int]], list[T]],
    run: Callable[[list[T]], None],
) -> None:
    """Feed `run` batches of at least `size` items (the last one smaller), `items` of each
    usable prompt's pending samples; record a prompt that is not usable as a bad row for
    each sample. The rollouts are flushed and progress shown after every batch."""
    progress = Progress(recorder.log, track=recorder.track)
    recorder.stats.set_limit(size)
    batch: list[T] = []
    for prompt, samples in work:
        if not usable(prompt):
            for sample_idx in samples:
                recorder.bad_row(prompt, sample_idx)
            continue
        batch += items(prompt, samples)
        if len(batch) >= size:
            run(batch)
            batch = []
            recorder.sink.flush()
            progress.maybe_report(recorder.stats)
    if batch:
        run(batch)
    recorder.sink.flush()
    progress.close(recorder.stats)


def _generate_batch(
    cfg: CollectConfig,
    engine: InProcess,
    model: str,
    batch: list[tuple[Prompt, list[int]]],
    recorder: Recorder,
    device: str,
    dtype: str | None,
) -> None:
    prompts = [p.messages if p.messages is not None else (p.text or "") for p, _ in batch]
    start = time.perf_counter()
    recorder.stats.in_flight = len(batch) * cfg.num_repeats
    outputs = engine.generate(
        model,
        prompts,
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_output_tokens,
        seed=cfg.seed + batch[0][0].idx,
        device=device,
        dtype=dtype,
    )
    took = time.perf_counter() - start
    recorder.stats.in_flight = 0
    both = zip(batch, outputs, strict=True)
    pairs = [(p.row, gens[i].text) for (p, samples), gens in both for i in samples]
    scored = iter(recorder.score_batch(pairs) or [None] * len(pairs))  # a judge: all at once
    for (prompt, samples), generations in zip(batch, outputs, strict=True):
        for sample_idx in samples:
            gen = generations[sample_idx]
            out = Completion(gen.text, gen.finish_reason, gen.prompt_tokens, gen.completion_tokens)
            recorder.rollout(prompt, sample_idx, out, took, next(scored))


def _episodes(
    cfg: CollectConfig, work: Iterator[tuple[Prompt, list[int]]], recorder: Recorder, device: str
) -> None:
    """Play every pending pair's episode in batches and record the lines."""
    from stages.lib.env.contract import environments

    assert cfg.environment is not None
    # an environment that cannot be loaded fails the stage before the model loads; one
    # served by a process is stopped with the stage
    with environments(cfg.environment, cfg.verifier) as make_env:
        _episodes_with(cfg, work, recorder, device, make_env)


def _episodes_with(
    cfg: CollectConfig,
    work: Iterator[tuple[Prompt, list[int]]],
    recorder: Recorder,
    device: str,
    make_env: Any,
) -> None:
    """`_episodes`'s body, its environments open."""
    engine, model, dtype = _engine(cfg)
    loaded = engine.load(model, device, dtype)
    failed = 0

    def play(batch: list[tuple[Prompt, int]]) -> None:
        nonlocal failed
        failed += _play_batch(cfg, engine.batch_size, batch, recorder, make_env, loaded, failed)

    _in_batches(
        work,
        recorder,
        engine.batch_size,
        usable=lambda prompt: prompt.parsed,  # not a JSON object: no row to reset with
        items=lambda prompt, samples: [(prompt, s) for s in samples],  # an episode each
        run=play,
    )


def _play_batch(
    cfg: CollectConfig,
    batch_size: int,
    batch: list[tuple[Prompt, int]],
    recorder: Recorder,
    make_env: Any,
    loaded: tuple[Any, Any],
    failed_before: int,
) -> int:
    """One batch of episodes played and written; returns how many failed."""
    from stages.collect.multiturn import episode_line
    from stages.lib.env.contract import max_turns
    from stages.lib.env.message_play import local_answer, play_batched
    from stages.lib.env.messages import episode_parser

    assert cfg.environment is not None
    turns = max_turns(cfg.environment)
    answer = local_answer(
        *loaded,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_output_tokens,
        seed=cfg.seed + batch[0][0].idx * turns,  # batches' seeds never overlap
        batch_size=batch_size,
    )
    start = time.perf_counter()
    recorder.stats.in_flight = len(batch)
    episodes: list[Episode] = asyncio.run(
        play_batched(
            make_env,
            [p.row for p, _ in batch],
            answer,
            max_turns=turns,
            timeout_s=cfg.environment.timeout_s,
            concurrency=cfg.environment.concurrency,
            parser=episode_parser(cfg.environment.tool_call_parser, loaded[1]),
        )
    )
    took = time.perf_counter() - start
    recorder.stats.in_flight = 0
    failed = 0
    stats = recorder.stats
    for (prompt, sample_idx), episode in zip(batch, episodes, strict=True):
        usage = (episode.usage[0], episode.usage[1])
        recorder.sink.rollout(episode_line(prompt, sample_idx, episode, usage, took))
        stats.written += 1
        stats.tokens_in += usage[0]
        stats.tokens_out += usage[1]
        stats.latency.add(took)
        if episode.error is not None:
            failed += 1
            if failed_before + failed <= 3:
                recorder.log.warning(
                    "prompt %d sample %d: episode failed: %s", prompt.idx, sample_idx, episode.error
                )
    return failed
