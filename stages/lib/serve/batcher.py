"""Concurrent requests to one in-memory model, grouped into batched engine calls.

Input: an engine (`Engine`: prompts and one `Sampling` -> one `Generation` per prompt, with
its token ids and log-probs) and requests arriving concurrently on an event loop.
Output: each request's `Generation`, awaited.

The model is one, so one engine call runs at a time, in a worker thread (the event loop
goes on taking requests meanwhile). Each call takes every waiting request that samples as
the oldest waiting one does (same temperature, top_p, max_tokens and seed), up to
`max_batch`, in arrival order: requests that arrive while a call runs make up the next one,
so concurrency becomes batch size with no waiting timer. A request without a seed gets the
batch's, `seed` + the number of batches before it (a rerun of the same requests in the same
order samples the same answers). An engine call that raises fails the requests of its batch
only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from stages.lib.chat.prompt import Prompt
from stages.lib.serve.wire import Sampling

Engine = Callable[[list[Prompt], Sampling], list[Any]]  # -> one Generation per prompt


def local_engine(model: Any, tokenizer: Any, batch_size: int = 64) -> Engine:
    """The local backend's batched generation (`stages.lib.model.generate.generate_with`, with
    log-probs) on a model and tokenizer in memory, as an `Engine`."""

    def run(prompts: list[Prompt], sampling: Sampling) -> list[Any]:
        from stages.lib.model.generate import generate_with

        gens = generate_with(
            model,
            tokenizer,
            prompts,
            num_samples=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_tokens,
            seed=sampling.seed or 0,
            batch_size=batch_size,
            logprobs=True,
        )
        return [g[0] for g in gens]

    return run


class Batcher:
    """The queue in front of the engine (module docstring)."""

    def __init__(self, engine: Engine, max_batch: int = 64, seed: int = 0) -> None:
        self.engine, self.max_batch = engine, max_batch
        self._seeds = itertools.count(seed)
        self._waiting: list[tuple[Prompt, Sampling, asyncio.Future[Any]]] = []
        self._worker: asyncio.Task[None] | None = None
        self.batches: list[int] = []  # each engine call's size, for tests and logs

    async def generate(self, prompt: Prompt, sampling: Sampling) -> Any:
        """The engine's `Generation` for `prompt`, batched with the requests waiting beside it."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((prompt, sampling, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            key = self._waiting[0][1]
            batch = [w for w in self._waiting if w[1] == key][: self.max_batch]
            taken = {id(w) for w in batch}
            self._waiting = [w for w in self._waiting if id(w) not in taken]
            sampling = (
                key
                if key.seed is not None
                else Sampling(**{**vars(key), "seed": next(self._seeds)})
            )
            self.batches.append(len(batch))
            try:
                gens = await asyncio.to_thread(self.engine, [p for p, _, _ in batch], sampling)
            except Exception as exc:  # the engine's failure is its batch's requests' answer
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), gen in zip(batch, gens, strict=True):
                if not future.done():  # a client that went away cancelled its future
                    future.set_result(gen)
