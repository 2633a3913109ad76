"""Benchmark: the memory model's estimate beside the measured peak of a training rank.

    .venv/bin/python bench/memory.py [--hidden 512] [--layers 8]

A ~50M-parameter Llama trains 3 steps (micro batch 2, 128 tokens, fp32) in 2 DeepSpeed
ranks over gloo on the CPU, under ZeRO 0, 2 and 3, with and without `adam_offload`. On
the CPU there is no device memory: a rank's peak RSS is compared with the model's
per-GPU estimate plus its host share plus a baseline measured here once (a rank that
imported everything and joined the process group, with no model). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANK = r"""
import json, os, resource, sys
import torch, deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
out = {"rank": int(os.environ["RANK"])}
if cfg["model"]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**cfg["model"]))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg["ds"])
    ids = torch.randint(0, cfg["model"]["vocab_size"], (cfg["micro"], cfg["seq"]))
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(cfg: dict) -> int:
    """Start 2 ranks; the larger peak RSS."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, json.dumps(cfg)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
    peaks = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        peaks.append(json.loads(line[7:])["maxrss"])
    return max(peaks)


def main() -> None:
    from engine.memory import GB, estimate, shape_from_dims
    from engine.stage import MemoryNeed

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    model = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 4 * args.hidden,
        "vocab_size": args.vocab,
        "tie_word_embeddings": False,
    }
    shape = shape_from_dims(args.hidden, args.layers, 8, args.vocab, 4 * args.hidden)
    micro, seq = 2, 128
    base = run_ranks({"model": None})
    print(
        f"model: {shape.params / 1e6:.1f}M parameters; rank baseline (imports, process group): {base / GB:.2f} GB"
    )
    print(f"{'zero':>4} {'offload':>7} {'estimate':>9} {'measured':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "config.json"
        spec.write_text(json.dumps({**model, "architectures": ["LlamaForCausalLM"]}))
        for zero in (0, 2, 3):
            for offload in (False, True):
                if offload and zero == 0:
                    continue
                zc: dict = {"stage": zero}
                if offload:
                    zc["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
                ds = {
                    "train_micro_batch_size_per_gpu": micro,
                    "gradient_accumulation_steps": 1,
                    "train_batch_size": 2 * micro,
                    "zero_optimization": zc,
                    "zero_allow_untested_optimizer": True,
                    "zero_force_ds_cpu_optimizer": False,
                    "steps_per_print": 10**9,
                }
                need = MemoryNeed(
                    "actor", "trainer", str(Path(tmp)), zero, offload, False, False, micro, seq
                )
                est = estimate(need, 2, 2, None)
                assert est is not None
                predicted = est.gpu_bytes + est.host_bytes + base
                measured = run_ranks({"model": model, "ds": ds, "micro": micro, "seq": seq})
                print(
                    f"{zero:>4} {offload!s:>7} {predicted / GB:>8.2f}G {measured / GB:>8.2f}G "
                    f"{measured / predicted:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
