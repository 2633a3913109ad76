"""Benchmark: the memory model's estimate beside the measured peak of a training rank.

    .venv/bin/python bench/memory.py [--hidden 512] [--layers 8] [--steps 3]

A ~66M-parameter Llama (fp32, micro batch 2, 128 tokens) trains a few steps in 2 DeepSpeed
ranks over gloo on the CPU, under ZeRO 0, 2 and 3, with and without `adam_offload`, through
the train stage's own code: `build_ds_config`, `load_model` (ZeRO-3 partitioned at
construction), `make_trainer`, and the rank environment of `stages.lib.distributed.spawn`. A rank's
peak RSS is compared with `engine.plan.memory.cpu_rank_bytes`, whose runtime term is measured
here once: the peak RSS of a rank that imported everything and joined the process group,
with no model. With `--device cuda` (2 GPUs: NCCL; 1 GPU: one rank) the peak of
`torch.cuda.max_memory_allocated` is compared with the per-GPU estimate instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ((0, False), (2, False), (2, True), (3, False), (3, True))

RANK = r"""
import json, os, resource, sys, types
cfg = json.loads(sys.argv[1])
import faulthandler
faulthandler.dump_traceback_later(cfg.get("watchdog_s", 600), exit=True)
from stages.lib.distributed.rank import init_distributed, load_model, make_trainer
init_distributed("deepspeed", cfg["device"], int(os.environ["WORLD_SIZE"]))
import torch, torch.nn.functional as F
import stages.lib.distributed.trainer
from transformers import LlamaForCausalLM
torch.set_num_threads(1)
device = "cpu"
if cfg["device"] == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = f"cuda:{os.environ['LOCAL_RANK']}"
out = {"rank": int(os.environ["RANK"])}
if cfg["model_dir"]:
    torch.manual_seed(0)
    model = load_model(cfg["model_dir"], cfg["ds"])
    trainer = make_trainer("deepspeed", cfg["ds"], types.SimpleNamespace(**cfg["settings"]),
                           model, cfg["steps"], device)
    ids = torch.randint(0, model.config.vocab_size, (cfg["micro"], cfg["seq"]), device=device)
    for _ in range(cfg["steps"]):
        trainer.begin_micro(True)
        logits = trainer.forward({"input_ids": ids})
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        trainer.backward(loss)
        trainer.step()
out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if cfg["device"] == "cuda":
    out["cuda_max"] = torch.cuda.max_memory_allocated()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def run_ranks(cfg: dict[str, Any], world: int = 2) -> dict[str, int]:
    """Start `world` ranks with the train stage's rank environment; the larger peaks."""
    from stages.lib.distributed.spawn import Ranks, rank_env
    from stages.lib.net import free_port

    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, Ranks(world=world), port, 1, cfg["device"], local=rank)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, json.dumps(cfg)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    peaks: dict[str, int] = {}
    done = [p.communicate(timeout=900) for p in procs]
    for rank, (p, (out, _)) in enumerate(zip(procs, done, strict=True)):
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if not lines:
            tails = "\n".join(f"rank {r}: {e[-2500:]}" for r, (_, e) in enumerate(done))
            raise RuntimeError(f"rank {rank} failed (exit {p.returncode}):\n{tails}")
        for key, value in json.loads(lines[0][7:]).items():
            if key != "rank":
                peaks[key] = max(peaks.get(key, 0), int(value))
    return peaks


def model_spec(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 4 * hidden,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }


def save_model(spec: dict[str, Any], path: Path) -> None:
    """A randomly initialised checkpoint of `spec` (what `load_model` reads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**spec)).save_pretrained(path)


def settings(zero: int, offload: bool, micro: int, world: int) -> dict[str, Any]:
    """The train settings `build_ds_config` and the trainer read (fp32, as on a CPU)."""
    return {
        "zero_stage": zero,
        "adam_offload": offload,
        "overlap_comm": False,
        "bf16": False,
        "micro_train_batch_size": micro,
        "train_batch_size": micro * world,
        "gradient_checkpointing": False,
        "learning_rate": 1e-4,
        "weight_decay": 0.0,
        "warmup_ratio": 0.0,
        "lr_scheduler": "constant",
    }


def measure(
    model_dir: str,
    zero: int,
    offload: bool,
    *,
    device: str = "cpu",
    world: int = 2,
    micro: int = 2,
    seq: int = 128,
    steps: int = 3,
    runtime: int = 0,
) -> tuple[int, int]:
    """(estimate, measured) for one configuration: RSS on the CPU, else CUDA's allocated."""
    from engine.plan.memory import cpu_rank_bytes, estimate
    from engine.stage import MemoryNeed
    from stages.lib.distributed.ds_config import build_ds_config, trainer_memory

    s = settings(zero, offload, micro, world)
    cfg = argparse.Namespace(**s, deepspeed_enable_sleep=False)
    ds = build_ds_config(cfg, world, model_dir=model_dir)
    need: MemoryNeed = trainer_memory(cfg, model_dir, seq, "actor")
    run = {"device": device, "model_dir": model_dir, "ds": ds, "settings": s}
    peaks = run_ranks({**run, "micro": micro, "seq": seq, "steps": steps}, world)
    if device == "cpu":
        predicted = cpu_rank_bytes(need, world, world, runtime)
        measured = peaks["maxrss"]
    else:
        est = estimate(need, world, world, None)
        predicted, measured = (est.gpu_bytes if est else None), peaks["cuda_max"]
    assert predicted is not None
    return predicted, measured


def runtime_rss(device: str = "cpu", world: int = 2) -> int:
    """The peak RSS of a rank with everything imported and the process group joined."""
    return run_ranks({"device": device, "model_dir": None}, world)["maxrss"]


def main() -> None:
    from engine.plan.memory import GB, shape_from_config

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    spec = model_spec(args.hidden, args.layers, args.vocab)
    shape = shape_from_config(spec)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(spec, Path(tmp))
        base = runtime_rss(args.device, args.world) if args.device == "cpu" else 0
        print(
            f"model: {shape.params / 1e6:.1f}M parameters, fp32, {args.world} ranks, {args.device}"
        )
        if args.device == "cpu":
            print(f"rank runtime (imports, process group, no model): {base / GB:.2f} GB")
        print(f"{'zero':>4} {'offload':>7} {'estimate':>9} {'measured':>9} {'ratio':>6}")
        for zero, offload in CONFIGS:
            predicted, measured = measure(
                tmp,
                zero,
                offload,
                device=args.device,
                world=args.world,
                steps=args.steps,
                runtime=base,
            )
            print(
                f"{zero:>4} {offload!s:>7} {predicted / GB:>8.2f}G {measured / GB:>8.2f}G "
                f"{measured / predicted:>6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
