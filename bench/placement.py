"""Benchmark: place a generated 1,000-stage pipeline on a declared 64-node x 8-GPU cluster.

.venv/bin/python bench/placement.py [--stages 1000] [--nodes 64]

The pipeline is chains with fan-out and fan-in: vLLM collect stages (tensor-parallel 2) on
the `vllm` role, train stages on `actor`, evaluate stages on plain GPUs. Printed side by
side: the solver alone (best of 5), `pipe validate` as a process without and with
`--cluster` (best of 3, start-up included), and their ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def generate(n: int, nodes: int) -> str:
    gpus = nodes * 8
    lines = [
        "name: big",
        f"cluster: {{gpus: {gpus}, gpus_per_node: 8}}",
        "resources: {ratio: {vllm: 1, actor: 1}}",
        "stages:",
    ]
    for i in range(n):
        kind = ("collect", "filter", "train", "evaluate")[i % 4]
        lines.append(f"  s{i}:")
        lines.append(f"    kind: {kind}")
        if i >= 4:
            lines.append(f"    needs: [s{i - 1}]" if i % 7 else f"    needs: [s{i - 1}, s{i - 4}]")
        if kind == "collect":
            lines.append("    resources: {role: vllm}")
            source = ", input: prompts.jsonl" if i < 4 else ""
            lines.append(
                "    config: {num_repeats: 4, backend: {kind: vllm, model: m, "
                f"vllm_tensor_parallel_size: 2}}{source}}}"
            )
        elif kind == "train":
            lines.append("    resources: {role: actor}")
            source = ", input: rollouts.jsonl" if i < 4 else ""
            lines.append(
                "    config: {model: m, micro_train_batch_size: 1, train_batch_size: 256"
                f"{source}}}"
            )
        elif kind == "evaluate":
            lines.append("    resources: {gpus: 8}")
            lines.append("    config: {input: prompts.jsonl, checkpoints: [m]}")
        elif i < 4:
            lines.append("    config: {input: rollouts.jsonl}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=64)
    args = parser.parse_args()
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.plan.topology_file import load_cluster_file
    from engine.resolve.resolve import resolve

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.yaml"
        path.write_text(generate(args.stages, args.nodes))
        (Path(tmp) / "m").mkdir()  # the checkpoint `model: m` names: its config.json is checked
        shape = '"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8'
        heads = '"num_attention_heads": 8, "vocab_size": 32000'
        (Path(tmp) / "m" / "config.json").write_text(f'{{"model_type": "llama", {shape}, {heads}}}')
        cluster = f"{args.nodes}x8x80GB"
        resolved = resolve(load_pipeline(path))
        view = load_cluster_file(cluster)
        solves = []
        for _ in range(5):
            t = time.perf_counter()
            placed = plan(resolved, view)
            solves.append(time.perf_counter() - t)
        assert placed.placement is not None
        gpu_stages = len(placed.placement.stages)
        plain, with_cluster = [], []
        for _ in range(3):
            for extra, out in (([], plain), (["--cluster", cluster], with_cluster)):
                t = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "engine.cli", "validate", str(path), *extra],
                    check=True,
                    capture_output=True,
                )
                out.append(time.perf_counter() - t)
    print(f"stages: {args.stages} ({gpu_stages} on GPUs), cluster: {args.nodes} nodes x 8 GPUs")
    print(f"plan with placement (in process), best of 5: {min(solves):.3f} s")
    print(f"`pipe validate` process, best of 3:           {min(plain):.3f} s")
    print(f"`pipe validate --cluster` process, best of 3: {min(with_cluster):.3f} s")
    print(f"ratio with/without placement:                 {min(with_cluster) / min(plain):.2f}x")


if __name__ == "__main__":
    main()
