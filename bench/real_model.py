"""Benchmark: a real model (Gemma 3 270M) through pipe's code against minimal scripts, in one run.

.venv/bin/python bench/real_model.py [--model DIR] [--steps 3] [--batch 8] [--seq 32]
    [--threads N] [--new-tokens 16] [--bf16] [--only train,lora,generate,vllm]
    [--vllm-timeout 900]

`--model` is a Hugging Face checkpoint folder (default: /work/models/gemma-3-270m, else
models/gemma-3-270m) or a GGUF file (converted first, as a stage converts it). Three parts,
each timed side by side on the same cores, with the same threads, in one process:

- train (full weights, then LoRA): the train stage's own step (`stages.train.loop.Loop`,
  built as `stages.train.worker` builds it: the model `stages.lib.model.lora.wrap.load_trained`
  loads, the trainer the stage picks, DeepSpeed ZeRO-0 when installed, else plain torch)
  against a bare torch loop (`AutoModelForCausalLM`, `labels=` loss, AdamW, clipping at 1.0;
  LoRA: peft's `get_peft_model` with pipe's default rank 16, alpha 32, all-linear). Both
  see the same examples (chain-sum prompts through `chat_template: plain`, about `--seq`
  tokens each), the same batch, dtype and threads; after one warm-up step each, the timed
  steps take turns, so background load hits both alike. Start-up (loading, DeepSpeed's
  initialisation) is outside the timing: this is steady-state tokens/s.
- generate: the local engine (`stages.lib.model.generate.generate_with`, what evaluate's and
  rl's local backends run) against `model.generate(use_cache=True)`, greedy, the same
  prompts, batch and max_new_tokens. Each answer ends at its end-of-sequence token; the
  engine drops finished rows, `generate` pads them to the longest: both count the same
  answer tokens.
- vllm: vLLM's CPU build (`.venv-vllm/`, `make install-vllm`; without it the bench says so
  and skips this part) serving the same folder, started and stopped as a stage's `backend: vllm`
  starts it (`stages.lib.backends.vllm.server`: 127.0.0.1, a secret, `--enforce-eager`, 1 GiB of KV
  cache), in the bench's dtype, its threads unpinned (`VLLM_CPU_OMP_THREADS_BIND` nobind) and
  `--threads` of them, against the local engine in the same process as above. Reported: the server's
  start-up (launch to healthy), then the generate part's batch (the same prompts through the same
  chat template, greedy, the same max_new_tokens) sent as concurrent chat requests
  (`stages.lib.api.client.complete_all`, what evaluate's vllm backend sends) and through the local
  engine, one untimed round, then `--steps` rounds taking turns: wall seconds a batch, CPU seconds a
  batch (vLLM's: its API server, engine core and worker processes together; the engine's: this
  process), and how many of the greedy answers are identical. A server that fails to start or to
  answer gives the key line of its log (the root exception) instead of the figures.

Ratios above 1 mean pipe is faster (the vllm part's too: vLLM's seconds over the local
engine's, below 1 where vLLM is faster). BENCHMARKS.md records the figures ("A real model").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "Question: {prompt}\nAnswer:"


def default_model() -> str:
    for path in ("/work/models/gemma-3-270m", str(ROOT / "models" / "gemma-3-270m")):
        if os.path.isdir(path):
            return path
    return str(ROOT / "models" / "gemma-3-270m")


def sum_rows(n: int, seed: int, terms: int) -> list[dict[str, str]]:
    """chain_sum-like rows: `terms` two-digit numbers to add."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(10, 99) for _ in range(terms)]
        rows.append({"prompt": " + ".join(map(str, nums)) + " =", "answer": str(sum(nums))})
    return rows


def prepared(model: str, tmp: str, dtype: str) -> str:
    """The folder a stage would load: a GGUF converted, `chat_template: plain` applied."""
    from stages.lib.chat.template import template_text
    from stages.lib.model.prepared import prepare_model

    template = template_text("plain", TEMPLATE)
    return prepare_model(model, run_dir=tmp, dtype=dtype, template=template)


def init_distributed() -> str:
    """One-rank process group (DeepSpeed needs one); the trainer kind the stage would pick."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "torch"
    from stages.lib.net import free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        DS_ACCELERATOR="cpu",
    )
    from stages.lib.distributed.rank import init_distributed as start

    start("deepspeed", "cpu", 1)
    return "deepspeed"


# -- train -----------------------------------------------------------------------------------


def training_data(model_dir: str, data_path: str, cfg: Any) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from stages.train.data import read_rows, training_set

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = training_set(
        read_rows(data_path), tok, algorithm="sft", target="answer", max_length=cfg.max_length
    )
    return tok, data


def pipe_loop(model_dir: str, data_path: str, trainer: str, settings: dict[str, Any]) -> Any:
    """One rank's loop exactly as `stages.train.worker` builds it."""
    from stages.lib.chat.tokens import pad_id
    from stages.lib.distributed.ds_config import build_ds_config
    from stages.lib.distributed.rank import make_trainer
    from stages.lib.model.lora.wrap import load_trained
    from stages.train import TrainConfig
    from stages.train.loop import Loop
    from stages.train.worker import plan_for

    cfg = TrainConfig.model_validate({"input": data_path, "model": model_dir, **settings})
    tok, data = training_data(model_dir, data_path, cfg)
    plan = plan_for(cfg, data, 1)
    ds_config = build_ds_config(cfg, 1) if trainer == "deepspeed" else None
    model = load_trained(model_dir, ds_config, cfg.lora, cfg.bf16)
    return Loop(
        cfg=cfg,
        trainer=make_trainer(trainer, ds_config, cfg, model, plan.total_steps, "cpu"),
        plan=plan,
        data=data,
        device="cpu",
        pad_id=pad_id(tok, model.config),
        stage_dir="",
    )


class BareLoop:
    """The minimal script: Hugging Face's `labels=` loss, AdamW, clipping, on padded batches of
    the same examples the pipe loop trains on, in the same order."""

    def __init__(self, model_dir: str, loop: Any, lora: bool, bf16: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if bf16 else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.config.use_cache = False
        if lora:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"
            )
            model = get_peft_model(model, config)
        model.train()
        self.model, self.loop = model, loop
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=loop.cfg.learning_rate, betas=(0.9, 0.95))

    def batch(self, k: int) -> dict[str, Any]:
        import torch

        loop = self.loop
        seqs = [s for u in loop.plan.step(k).units for s in loop.data.units[u]]
        examples = [loop.data.examples[s] for s in seqs]
        width = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), width), loop.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for r, e in enumerate(examples):
            n = len(e.input_ids)
            ids[r, :n] = torch.tensor(e.input_ids)
            mask[r, :n] = 1
            labels[r, :n] = torch.tensor(e.labels())
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def run_step(self, k: int) -> dict[str, float]:
        import torch

        loss = self.model(**self.batch(k)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach())}


def train_part(model_dir: str, data_path: str, trainer: str, args: Any, lora: bool) -> dict:
    settings: dict[str, Any] = {
        "target": "answer",
        "train_batch_size": args.batch,
        "micro_train_batch_size": args.batch,
        "max_steps": args.steps + 1,
        "learning_rate": 1e-5 if not lora else 1e-4,
        "lr_scheduler": "constant",
        "warmup_ratio": 0.0,
        "bf16": args.bf16,
    }
    if lora:
        settings["lora"] = {}
    loop = pipe_loop(model_dir, data_path, trainer, settings)
    bare = BareLoop(model_dir, loop, lora, args.bf16)
    tokens = [
        sum(
            len(loop.data.examples[s].input_ids)
            for u in loop.plan.step(k).units
            for s in loop.data.units[u]
        )
        for k in range(args.steps + 1)
    ]
    times: dict[str, list[float]] = {"pipe": [], "bare": []}
    losses: dict[str, float] = {}
    for k in range(args.steps + 1):  # step 0: the warm-up, untimed
        for name in ("pipe", "bare") if k % 2 == 0 else ("bare", "pipe"):
            t = time.perf_counter()
            rec = loop.run_step(loop.plan.step(k)) if name == "pipe" else bare.run_step(k)
            if k:
                times[name].append(time.perf_counter() - t)
            losses[name] = rec["loss"]
    timed = sum(tokens[1:])
    out = {
        "tokens_per_step": statistics.mean(tokens[1:]),
        "pipe_tokens_s": timed / sum(times["pipe"]),
        "bare_tokens_s": timed / sum(times["bare"]),
        "pipe_step_s": [round(t, 2) for t in times["pipe"]],
        "bare_step_s": [round(t, 2) for t in times["bare"]],
        "loss": {k: round(v, 4) for k, v in losses.items()},
        "trainer": loop.trainer.name,
        "trainable": sum(p.numel() for p in bare.params),
    }
    out["ratio"] = out["pipe_tokens_s"] / out["bare_tokens_s"]
    del loop, bare
    gc.collect()
    return out


# -- generate --------------------------------------------------------------------------------


def batch_prompts(args: Any) -> list[str]:
    """The generation batch both the generate and the vllm parts send: `--batch` chain sums."""
    return [r["prompt"] for r in sum_rows(args.batch, 7, args.terms)]


def load_local(model_dir: str, args: Any) -> tuple[Any, Any]:
    """The model (in the bench's dtype) and tokenizer the local engine generates with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def local_engine(model: Any, tok: Any, prompts: list[str], args: Any) -> Callable[[], list[Any]]:
    """One greedy batch through the local engine (`generate_with`): its `Generation`s."""
    from stages.lib.model.generate import generate_with

    def run() -> list[Any]:
        gens = generate_with(
            model,
            tok,
            prompts,
            num_samples=1,
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=args.new_tokens,
            seed=0,
            batch_size=args.batch,
        )
        return [g[0] for g in gens]

    return run


def side_by_side(
    sides: dict[str, Callable[[], Any]],
    steps: int,
    cpu: dict[str, Callable[[], float]] | None = None,
) -> tuple[dict, dict, dict]:
    """Each side's seconds of each of `steps` timed rounds after one warm-up round, the sides
    taking turns (reversed order on odd rounds); the CPU seconds of each round by the clock
    `cpu` names for that side (where it names one); and each side's last result."""
    cpu = cpu or {}
    times: dict[str, list[float]] = {name: [] for name in sides}
    used: dict[str, list[float]] = {name: [] for name in cpu}
    last: dict[str, Any] = {}
    for k in range(steps + 1):
        for name in list(sides)[:: 1 if k % 2 == 0 else -1]:
            clock = cpu.get(name)
            t, c = time.perf_counter(), clock() if clock else 0.0
            last[name] = sides[name]()
            if k:
                times[name].append(round(time.perf_counter() - t, 3))
                if clock:
                    used[name].append(round(clock() - c, 3))
    return times, used, last


def mean_s(times: list[float]) -> float:
    return round(statistics.mean(times), 3)


def generate_part(model_dir: str, args: Any) -> dict:
    import torch

    from stages.lib.chat.prompt import prompt_ids
    from stages.lib.model.generate import _eos_ids

    model, tok = load_local(model_dir, args)
    tok.padding_side = "left"
    prompts = batch_prompts(args)
    encoded = [prompt_ids(tok, p) for p in prompts]
    eos = sorted(_eos_ids(model, tok))
    width = max(map(len, encoded))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    run = local_engine(model, tok, prompts, args)

    def engine() -> int:
        return sum(g.completion_tokens for g in run())

    def bare() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                use_cache=True,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        new = out[:, width:].tolist()
        return sum(next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in new)

    times, _, counts = side_by_side({"engine": engine, "bare": bare}, args.steps)
    out = {
        "prompt_tokens": width,
        "answer_tokens": counts,
        "engine_s": mean_s(times["engine"]),
        "bare_s": mean_s(times["bare"]),
    }
    out["ratio"] = out["bare_s"] / out["engine_s"]
    return out


# -- vllm ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Greedy:
    """The request settings `stages.lib.backends.endpoint.make_client` reads: greedy, the bench's
    max_new_tokens."""

    max_output_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    timeout_s: float = 600.0


ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b: .+")


def key_error(log_text: str) -> str | None:
    """The line of a vLLM server's log that says why it failed: the first exception a
    traceback ends with (`SomethingError: ...`, without the log's prefix), passing over the
    wrappers that point back at it ("See root cause above") and errors quoted in INFO or
    WARNING lines; None where the log has no such line."""
    found = [
        m.group(0)
        for line in log_text.splitlines()
        if " WARNING " not in line and " INFO " not in line and (m := ERROR_LINE.search(line))
    ]
    causes = [line for line in found if "root cause" not in line]
    return (causes or found or [None])[0]


def server_cpu_s() -> float:
    """CPU seconds used so far by the sessions this process's children lead: a vLLM server
    runs in a session of its own (`stages.lib.backends.vllm.process`) with its API server, engine
    core and worker processes, where the load of the other jobs on a shared machine does not count.
    """
    me, stats = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            # after "pid (comm) ": state ppid pgrp session ... utime (12th) stime (13th)
            stats.append((int(entry), text[text.rindex(")") + 2 :].split()))
    leaders = {pid for pid, f in stats if int(f[1]) == me and int(f[3]) == pid}
    ticks = sum(int(f[11]) + int(f[12]) for _, f in stats if int(f[3]) in leaders)
    return ticks / os.sysconf("SC_CLK_TCK")


def vllm_part(model_dir: str, args: Any, tmp: str) -> dict[str, Any] | str:
    """vLLM's CPU build (`.venv-vllm/`) serving `model_dir` against the local engine: the
    server's start-up, then the generate part's batch (the same prompts through the same chat
    template, greedy, the same max_new_tokens) as concurrent chat requests, a round of both sides
    untimed, then `--steps` rounds taking turns. The server is started and stopped as a stage's
    `backend: vllm` is (`stages.lib.backends.vllm.server`), with the bench's dtype and threads.
    """
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        return (
            "skipped: no .venv-vllm/ here (make install-vllm builds vLLM's CPU build in it); "
            "nothing to compare the local engine against"
        )
    import asyncio
    import logging

    from stages.lib.api.client import RequestError, complete_all
    from stages.lib.backends.endpoint import Endpoint, make_client
    from stages.lib.backends.vllm.auth import new_secret
    from stages.lib.backends.vllm.backend import VLLMBackend
    from stages.lib.backends.vllm.server import vllm_server

    model, tok = load_local(model_dir, args)
    prompts = batch_prompts(args)
    engine = local_engine(model, tok, prompts, args)
    backend = VLLMBackend(kind="vllm", model=model_dir, startup_timeout_s=args.vllm_timeout)
    log_file = Path(tmp) / "vllm.log"
    # the local engine's dtype and thread count; threads unpinned, as torch's are
    dtype = ["--dtype", "bfloat16" if args.bf16 else "float32"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads_used)}
    secret = new_secret()
    started = time.perf_counter()
    try:
        with vllm_server(
            backend,
            gpus=0,
            log=logging.getLogger("bench.real_model"),
            log_file=log_file,
            secret=secret,
            extra_args=dtype,
            extra_env=env,
        ) as url:
            startup = time.perf_counter() - started
            endpoint = Endpoint(url, model_dir, "chat", api_key=secret, vllm=True)
            client = make_client(Greedy(args.new_tokens), endpoint, connections=args.batch)

            def served() -> list[Any]:
                done = complete_all(client, prompts, num_samples=1, seed=0, parallel=args.batch)
                return [c[0] for c in asyncio.run(done)]

            cpu = {"vllm": server_cpu_s, "engine": time.process_time}
            times, used, last = side_by_side({"vllm": served, "engine": engine}, args.steps, cpu)
    except (RuntimeError, RequestError) as exc:
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        # the server's own error, else ours without the log's tail (its folder goes away)
        reason = key_error(text) or str(exc).splitlines()[0].split("; last lines of")[0]
        return f"vLLM's CPU build did not serve {args.model}: {reason}"
    same = sum(v.text == e.text for v, e in zip(last["vllm"], last["engine"], strict=True))
    return {
        "startup_s": round(startup, 1),
        "vllm_s": mean_s(times["vllm"]),
        "engine_s": mean_s(times["engine"]),
        "ratio": mean_s(times["vllm"]) / mean_s(times["engine"]),
        "cpu_ratio": mean_s(used["vllm"]) / mean_s(used["engine"]),
        "rounds_s": times,
        "vllm_cpu_s": mean_s(used["vllm"]),
        "engine_cpu_s": mean_s(used["engine"]),
        "answer_tokens": {
            "vllm": sum(c.completion_tokens for c in last["vllm"]),
            "engine": sum(g.completion_tokens for g in last["engine"]),
        },
        "identical": same,
        "texts": {
            "vllm": [c.text for c in last["vllm"]],
            "engine": [g.text for g in last["engine"]],
        },
    }


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model(), help="checkpoint folder or .gguf")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step / a batch")
    parser.add_argument("--terms", type=int, default=6, help="numbers a prompt adds (~32 tokens)")
    parser.add_argument("--new-tokens", type=int, default=16, help="generation's max_new_tokens")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--bf16", action="store_true", help="bf16 (fp32 otherwise)")
    parser.add_argument("--only", default="train,lora,generate,vllm", help="parts to run")
    parser.add_argument(
        "--vllm-timeout", type=float, default=900, help="seconds vLLM's server may take to start"
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    args.threads_used = threads
    parts = set(args.only.split(","))
    if not os.path.exists(args.model):
        sys.exit(f"{args.model}: no such model (make gemma3 fetches the GGUF)")
    started = time.perf_counter()
    results: dict[str, Any] = {"model": args.model, "threads": threads, "bf16": args.bf16}
    dtype = "bfloat16" if args.bf16 else "float32"
    print(
        f"{args.model}: batch {args.batch}, {args.steps} timed steps after 1 warm-up, "
        f"{threads} thread(s), {dtype}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepared(args.model, tmp, dtype)
        data = Path(tmp) / "train.jsonl"
        rows = sum_rows(args.batch * (args.steps + 1), 0, args.terms)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        trainer = init_distributed() if parts & {"train", "lora"} else "torch"
        for name, lora in (("train", False), ("lora", True)):
            if name not in parts:
                continue
            r = results[name] = train_part(model_dir, str(data), trainer, args, lora)
            print(
                f"{name:<6} {r['trainer']} vs bare torch, {r['trainable'] / 1e6:.1f}M trained, "
                f"{r['tokens_per_step']:.0f} tokens/step: pipe {r['pipe_tokens_s']:.1f} "
                f"tokens/s {r['pipe_step_s']}, bare {r['bare_tokens_s']:.1f} tokens/s "
                f"{r['bare_step_s']}: {r['ratio']:.2f}x; last loss {r['loss']}",
                flush=True,
            )
        if "generate" in parts:
            r = results["generate"] = generate_part(model_dir, args)
            print(
                f"generate: batch {args.batch}, prompt {r['prompt_tokens']} tokens, "
                f"max_new_tokens {args.new_tokens}, answer tokens {r['answer_tokens']}: "
                f"engine {r['engine_s']}s, model.generate {r['bare_s']}s: {r['ratio']:.2f}x",
                flush=True,
            )
        if "vllm" in parts:
            r = results["vllm"] = vllm_part(model_dir, args, tmp)
            if isinstance(r, str):
                print(f"vllm: {r}", flush=True)
            else:
                print(
                    f"vllm: start-up {r['startup_s']}s; batch {args.batch}, max_new_tokens "
                    f"{args.new_tokens}, answer tokens {r['answer_tokens']}: vLLM "
                    f"{r['vllm_s']}s, engine {r['engine_s']}s a batch: {r['ratio']:.2f}x "
                    f"{r['rounds_s']}\n      CPU seconds a batch: vLLM {r['vllm_cpu_s']}, "
                    f"engine {r['engine_cpu_s']}: {r['cpu_ratio']:.2f}x; {r['identical']} of "
                    f"{args.batch} greedy answers identical",
                    flush=True,
                )
    print(f"({time.perf_counter() - started:.0f}s in all; load average {os.getloadavg()[0]:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
