"""Benchmark: the rl stage's requests to a vLLM-like server, auto bound beside fixed ones.

    .venv/bin/python bench/rl_requests.py [--capacity 128] [--latency-ms 200] [--steps 2]

The fake OpenAI server of the tests (bench/collect/fake_server.py, its own process, on
127.0.0.1) with `capacity` slots of `latency_ms` each answers token-id prompts as vLLM does;
`stages.rl.rollout.vllm_requests.HTTPRollouts` sends it steps of 64 prompts x 8 samples (one request
per sample) with `num_samples_in_parallel` auto, 16 (the old rl stage kept 16 requests in
flight per server) and the capacity. Printed per step: wall seconds, requests in flight
(mean and peak, from the client), the bound, and the share of the server's limit used
(`requests x latency / (capacity x wall)`: 100% is the server never idle).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "collect"))


class Tokens:
    eos_token_id = 2


def main() -> None:
    from fake_server import start_subprocess

    from stages.lib.chat.prompt import TokenPrompt
    from stages.rl.rollout.vllm_requests import HTTPRollouts

    p = argparse.ArgumentParser()
    p.add_argument("--capacity", type=int, default=128)
    p.add_argument("--latency-ms", type=float, default=200.0)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    server = start_subprocess(args.capacity, args.latency_ms)
    prompts = [TokenPrompt((1, 5 + i % 7, 9)) for i in range(64)]
    print(f"fake server: {args.capacity} slots x {args.latency_ms:.0f} ms; 64 prompts x 8 samples")
    print(
        f"{'bound':>6} {'step':>5} {'wall s':>7} {'in flight':>10} {'peak':>5} {'limit':>6} "
        f"{'server busy':>12}"
    )
    try:
        for parallel in ("auto", 16, args.capacity):
            engine = HTTPRollouts(
                [server.url.removesuffix("/v1")], Tokens(), "fake", {}, 60.0, parallel
            )
            for k in range(args.steps):
                began = time.perf_counter()
                engine.generate(prompts, num_samples=8, temperature=1.0, max_new_tokens=4, seed=k)
                wall = time.perf_counter() - began
                s = engine.stats
                busy = 512 * args.latency_ms / 1000 / (args.capacity * wall)
                print(
                    f"{parallel!s:>6} {k + 1:>5} {wall:>7.2f} {s['in_flight']:>10.1f} "
                    f"{s['in_flight_peak']:>5} {s['parallel_limit']:>6} {busy:>11.0%}",
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
