"""Batched local generation with transformers: the `local` backend.

Input: a checkpoint directory and prompts (strings or chat messages).
Output: per prompt, `num_samples` `Generation`s (text, finish reason, token counts).

Prompts go through the shared chat template (`stages.lib.chat.prompt.format_prompt`),
so generation sees exactly the format training used. Prompts are grouped by
length and left-padded; each batch is prefilled once (logits at its last position only, the
vocabulary projection on 2-D hidden states: `stages.lib.model.logits.flat_head`) and
its KV cache repeated for the `num_samples` samples (they share the prompt), then decoded
token by token with the cache, finished rows leaving the batch. Temperature 0 is
greedy; otherwise nucleus sampling from a generator seeded with `seed`. The
loaded model is cached per process (one Dask worker evaluates several
batches, or several stages, without reloading).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.stage import at_stage_end
from stages.lib.chat.prompt import Prompt, prompt_ids
from stages.lib.chat.tokens import answer_text, eos_ids, pad_id

log = logging.getLogger("pipe.stages.lib.model.generate")

_CACHE: OrderedDict[tuple[str, float, str, str], tuple[Any, Any]] = OrderedDict()
_CACHE_SIZE = 2


@dataclass(frozen=True)
class Generation:
    """One sampled answer."""

    text: str
    finish_reason: str  # "stop" (end-of-sequence token) | "length" (hit max_new_tokens)
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()  # the completion's tokens (the end-of-sequence one included)
    logprobs: tuple[float, ...] = ()  # with `logprobs=True`: each token's log-probability
    prompt_ids: tuple[int, ...] = ()  # the prompt as the model saw it (chat template applied)


def load(model_dir: str, device: str = "cpu", dtype: str | None = None) -> tuple[Any, Any]:
    """The model (eval mode, on `device`, in `dtype`: a stage's one precision for all its
    checkpoints, `stages.lib.model.dtypes.resolve_precision`; None: the checkpoint's own) and
    tokenizer of `model_dir`, cached per process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.lib.model.dtypes import checkpoint_dtype

    path = os.path.realpath(model_dir)
    key = (path, _mtime(path), device, dtype or "its own")
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    dtype = dtype or checkpoint_dtype(path)  # read on a miss only
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(device)
    model.eval()
    _CACHE[key] = (model, tokenizer)
    at_stage_end(release)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return model, tokenizer


def release() -> None:
    """Drop the cached models (at a stage's end: `engine.stage.at_stage_end`)."""
    _CACHE.clear()


def _mtime(path: str) -> float:
    try:
        return max(os.stat(os.path.join(path, f)).st_mtime for f in os.listdir(path))
    except (FileNotFoundError, ValueError):
        return 0.0


def generate(
    model_dir: str,
    prompts: Sequence[Prompt],
    *,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 64,
    device: str = "cpu",
    dtype: str | None = None,
) -> list[list[Generation]]:
    """Generate `num_samples` answers for every prompt; outer list per prompt, inner per sample
    (the model loaded in `dtype`: `load`)."""
    model, tokenizer = load(model_dir, device, dtype)
    return generate_with(
        model,
        tokenizer,
        prompts,
        num_samples=num_samples,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
    )


def generate_with(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
    logprobs: bool = False,
    lockstep: bool = False,
) -> list[list[Generation]]:
    """`generate` with a model and tokenizer already in memory (e.g. inside a training loop).

    With `logprobs`, each sample carries its token ids and each token's log-probability
    under the sampling distribution (`softmax(logits / temperature)`; greedy: T = 1), and
    the prompt's token ids: what an RL update needs of the behaviour policy. With
    `lockstep`, every batch runs all `max_new_tokens` decode steps over all its rows
    (tokens after an end-of-sequence are dropped from the answers): ranks of a ZeRO-3 model
    given as many prompts then run exactly as many forward passes, each of which gathers
    the parameters together, whatever their answers.
    """
    import torch

    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    per_batch = max(1, batch_size // num_samples)
    rng = torch.Generator(device=model.device).manual_seed(seed)
    eos = _eos_ids(model, tokenizer)
    pad = pad_id(tokenizer, getattr(model, "config", None))
    out: list[list[Generation]] = [[] for _ in prompts]
    started, produced = time.perf_counter(), 0
    for lo in range(0, len(order), per_batch):
        chunk = order[lo : lo + per_batch]
        rows = _decode(
            model,
            [encoded[i] for i in chunk],
            pad=pad,
            eos=eos,
            repeats=num_samples,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            rng=rng,
            logprobs=logprobs,
            lockstep=lockstep,
        )
        for j, i in enumerate(chunk):
            for new, lps in rows[j * num_samples : (j + 1) * num_samples]:
                gen = _finish(tokenizer, new, eos, len(encoded[i]))
                if logprobs:
                    n = gen.completion_tokens
                    gen = replace(
                        gen,
                        token_ids=tuple(new[:n]),
                        logprobs=tuple(lps[:n]),
                        prompt_ids=tuple(encoded[i]),
                    )
                out[i].append(gen)
                produced += gen.completion_tokens
    elapsed = time.perf_counter() - started
    log.info(
        "generated %d answers, %d tokens in %.1fs (%.0f tokens/s)",
        len(prompts) * num_samples,
        produced,
        elapsed,
        produced / max(elapsed, 1e-9),
    )
    return out


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends an answer: the tokenizer's, the config's and generation_config's
    end-of-sequence ids, and the chat template's end-of-turn token (`stages.lib.chat.tokens`)."""
    config = getattr(model, "config", None)
    return set(eos_ids(tokenizer, config, getattr(model, "generation_config", None)))


def _decode(
    model: Any,
    ids: list[list[int]],
    *,
    pad: int,
    eos: set[int],
    repeats: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    rng: Any,
    logprobs: bool = False,
    lockstep: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """New tokens (and, with `logprobs`, their log-probabilities) for each prompt, `repeats`
    rows per prompt (prompt-major).

    The prompts are prefilled once (left-padded), the KV cache is repeated for
    the samples, and rows that emit an end-of-sequence token leave the batch (with
    `lockstep` they stay, and every step runs: see `generate_with`).
    """
    import torch

    from stages.lib.model.logits import flat_head

    # no_grad under lockstep: ZeRO-3 gathers parameters in the forward, and inference-mode
    # tensors must not become a trained parameter's storage
    with torch.no_grad() if lockstep else torch.inference_mode(), flat_head(model):
        cache_arg = _cache_arg(model)
        cache, logits, mask = _prefill(model, ids, pad, repeats)
        last = mask.sum(-1) - 1
        alive = torch.arange(logits.shape[0], device=logits.device)
        new: list[list[int]] = [[] for _ in range(logits.shape[0])]
        lps: list[list[float]] = [[] for _ in range(logits.shape[0])]
        eos_t = torch.tensor(sorted(eos) if eos else [-1], device=logits.device)
        scale = temperature if temperature > 0 else 1.0
        for n in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, rng)
            for row, t in zip(alive.tolist(), token.tolist(), strict=True):
                new[row].append(t)
            if logprobs:
                chosen = torch.log_softmax(logits / scale, dim=-1).gather(1, token[:, None])
                for row, lp in zip(alive.tolist(), chosen.squeeze(1).tolist(), strict=True):
                    lps[row].append(lp)
            keep = torch.ones_like(token, dtype=torch.bool)
            if not lockstep:
                keep = ~torch.isin(token, eos_t)
            if n == max_new_tokens - 1 or not bool(keep.any()):
                break
            if not bool(keep.all()):
                idx = keep.nonzero().squeeze(1)
                cache.batch_select_indices(idx)
                alive, token, mask, last = alive[idx], token[idx], mask[idx], last[idx]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last = last + 1
            step = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=last[:, None],
                use_cache=True,
                **{cache_arg: cache},
            )
            cache, logits = getattr(step, cache_arg), step.logits[:, -1].float()
    return list(zip(new, lps, strict=True))


def _prefill(model: Any, ids: list[list[int]], pad: int, repeats: int) -> tuple[Any, Any, Any]:
    """Run the left-padded prompts once; the cache, last logits and mask, each row `repeats`
    times."""
    import torch

    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = {"logits_to_keep": 1} if _keeps_logits(model) else {}  # only the last position's
    step = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, **keep)
    cache, logits = getattr(step, _cache_arg(model)), step.logits[:, -1].float()
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
        logits = logits.repeat_interleave(repeats, 0)
        mask = mask.repeat_interleave(repeats, 0)
    return cache, logits, mask


def _keeps_logits(model: Any) -> bool:
    """Whether the model's forward (a peft model's: its base's) takes `logits_to_keep`: then
    the prefill projects the last position onto the vocabulary only, as `model.generate`
    does (at Gemma 3's 262k-token vocabulary, all positions' logits cost as much as the rest of
    the prefill together)."""
    return _takes_keep(_base_class(model))


@functools.cache
def _takes_keep(cls: Any) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _cache_arg(model: Any) -> str:
    """The forward's name for the KV cache, in and out: `cache` where the model's forward
    takes it (transformers 5.24 on, where `past_key_values` warns and goes in 5.40),
    `past_key_values` before; a peft model's: its base's (its own forward passes **kwargs on);
    looked up once per model class."""
    return _cache_name(_base_class(model))


def _base_class(model: Any) -> Any:
    """The class whose forward's parameters tell what the model takes: a peft model's base's
    (peft's own forward passes **kwargs on to it), else the model's own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base)


@functools.cache
def _cache_name(cls: Any) -> str:
    import inspect

    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _pick(logits: Any, temperature: float, top_p: float, rng: Any) -> Any:
    """The next token per row: greedy at temperature 0, else nucleus sampling."""
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=rng).squeeze(1)


def _finish(tokenizer: Any, new: list[int], eos: set[int], prompt_tokens: int) -> Generation:
    stop = next((k for k, t in enumerate(new) if t in eos), None)
    if stop is not None:
        new = new[: stop + 1]
    text = answer_text(tokenizer, new)
    return Generation(text, "stop" if stop is not None else "length", prompt_tokens, len(new))
