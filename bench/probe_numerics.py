"""Benchmark: where the engine and the actor disagree in bf16, on a real model (Gemma 3 270M).

.venv/bin/python bench/probe_numerics.py [--model DIR_OR_GGUF] [--prompts 16] [--lora-std 0.02]

The actor's model as a rank loads it (`stages.lib.model.lora.wrap.load_trained`, bf16 as
DeepSpeed holds it, LoRA rank 16 on all-linear) with adapters moved off zero (normal,
`--lora-std`: a trained state), and the local engine (`stages.rl.rollout.local.LocalEngine`)
holding the very same weights (copied as a sync copies them). Each row scores the same
chain-sum answers (`Question: ...\\nAnswer:` and the answer, ~10 tokens each) two ways and
gives the largest and mean `|a - b|` log-probability over their tokens, in nats:

- same function: the engine against the actor, each sample alone (what the probe compares),
  then with 1 and 2 torch threads;
- batched: the same samples scored alone against in one padded batch (the actor scores
  micro batches; the probe is one sample);
- generation: the engine's sampled answers, their log-probabilities as generation returns them
  (left-padded batch, KV cache, one token at a time), against the actor's forward over them:
  the rollout's `logprob_diff_*`;
- merged adapters: W + BA merged into the bf16 weight against the unmerged adapters;
- eager attention against sdpa;
- bf16 against fp32 on the same (bf16-valued) weights.

BENCHMARKS.md records the figures ("Engine against actor in bf16").
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TEMPLATE = "Question: {prompt}\nAnswer:"


def default_model() -> str:
    for path in (ROOT / "models" / "gemma-3-270m-q4_k_m.gguf", ROOT / "models" / "gemma-3-270m"):
        if path.exists():
            return str(path)
    return str(ROOT / "models" / "gemma-3-270m-q4_k_m.gguf")


def rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((TEMPLATE.format(prompt=f"{a} + {b} ="), f" {a + b}"))
    return out


def gap(a: Any, b: Any) -> tuple[float, float]:
    import torch

    d = (torch.cat(a).float() - torch.cat(b).float()).abs()
    return float(d.max()), float(d.mean())


def scored(module: Any, samples: list[Any], pad: int, each: bool = True) -> list[Any]:
    import torch

    from stages.rl.algo.logprobs import completion_logprobs

    with torch.no_grad():
        if each:
            return [completion_logprobs(module, [s], "cpu", 1.0, pad)[0][0] for s in samples]
        return completion_logprobs(module, samples, "cpu", 1.0, pad)[0]


def receive(module: Any, sent: dict[str, Any]) -> None:
    """The actor's adapters into `module`, cast to its dtype, as a sync copies them."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in sent:
                p.copy_(sent[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--lora-std", type=float, default=0.02)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from stages.lib.chat.template import template_text
    from stages.lib.model.lora import LoraBlock
    from stages.lib.model.lora.wrap import adapter_params, load_trained
    from stages.lib.model.prepared import prepare_model
    from stages.rl.algo.logprobs import Sample
    from stages.rl.rollout.local import LocalEngine

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="probe-numerics-")
    began = time.perf_counter()
    folder = prepare_model(
        args.model, run_dir=tmp, dtype="bfloat16", template=template_text("plain", TEMPLATE)
    )
    lora = LoraBlock(rank=16)
    torch.manual_seed(0)
    actor = load_trained(folder, {"bf16": {"enabled": True}}, lora, True)
    actor.train()
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, args.lora_std)
    engine = LocalEngine(folder, "cpu", True, lora)
    sent = dict(adapter_params(actor))
    receive(engine.model, sent)
    tok = engine.tokenizer
    pad = engine.pad_id
    samples = []
    for prompt, answer in rows(args.prompts):
        ids = tok(prompt).input_ids
        samples.append(
            Sample(
                ids=tuple(ids + tok(answer, add_special_tokens=False).input_ids),
                prompt_len=len(ids),
            )
        )
    print(
        f"# {args.model}: {len(samples)} samples, "
        f"{sum(s.completion_len for s in samples)} answer tokens; "
        f"ready in {time.perf_counter() - began:.0f} s",
        flush=True,
    )
    table: list[tuple[str, tuple[float, float]]] = []

    def row(name: str, pair: tuple[float, float]) -> None:
        table.append((name, pair))
        print(f"{name:<58} max {pair[0]:.3g}  mean {pair[1]:.3g}", flush=True)

    mine = scored(actor, samples, pad)
    row(
        "same function: engine vs actor, each sample alone",
        gap(scored(engine.model, samples, pad), mine),
    )
    torch.set_num_threads(2)
    row("same function, 2 threads vs 1", gap(scored(engine.model, samples, pad), mine))
    torch.set_num_threads(1)
    row(
        "batched: one padded batch vs each alone",
        gap(scored(engine.model, samples, pad, False), mine),
    )
    prompts = [s.ids[: s.prompt_len] for s in samples]
    from stages.lib.chat.prompt import TokenPrompt
    from stages.lib.model.generate import generate_with

    gens = generate_with(
        engine.model,
        tok,
        [TokenPrompt(tuple(p)) for p in prompts],
        num_samples=1,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=8,
        seed=0,
        batch_size=len(prompts),
        logprobs=True,
    )
    gen_samples = [
        Sample(ids=tuple(p) + tuple(g[0].token_ids), prompt_len=len(p))
        for p, g in zip(prompts, gens, strict=True)
    ]
    behaviour = [torch.tensor(g[0].logprobs) for g in gens]
    row(
        "generation (batched, KV cache) vs the actor's forward",
        gap(behaviour, scored(actor, gen_samples, pad)),
    )
    merged = load_trained(folder, {"bf16": {"enabled": True}}, lora, True)
    receive(merged, sent)
    merged = merged.merge_and_unload()
    row("merged adapters (bf16 W + BA) vs unmerged", gap(scored(merged, samples, pad), mine))
    del merged
    eager = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    )
    from stages.lib.model.lora.wrap import with_lora

    eager = with_lora(eager, lora, inference=True)
    receive(eager, sent)
    row("eager attention vs sdpa", gap(scored(eager, samples, pad), mine))
    del eager
    fp32 = with_lora(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), lora, inference=True
    )
    receive(fp32, sent)
    row("fp32 vs bf16 on the same weights", gap(scored(fp32, samples, pad), mine))
    print(f"# {time.perf_counter() - began:.0f} s in all")


if __name__ == "__main__":
    main()
