"""vLLM start-up on the CPU: seconds from launch to healthy, first reply, and stop, for a tiny
model.

    .venv/bin/python bench/vllm_startup.py [--runs 3]

Needs `make install-vllm`. Builds the tests' tiny Llama (hidden 64, 2 layers)
in a temporary folder, then starts and stops `vllm_server` `--runs` times and
prints each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.lib.backends.vllm.auth import bearer, new_secret
from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.server import vllm_server
from tests.integration.test_vllm_backend import build_tiny_model

log = logging.getLogger("bench.vllm_startup")


def first_reply(url: str, model: str, secret: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    request = urllib.request.Request(
        f"{url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **bearer(secret)},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        json.load(resp)


def one_run(backend: VLLMBackend, log_file: Path) -> dict[str, float]:
    """Start, ask once, stop; the seconds each took."""
    start = time.monotonic()
    secret = new_secret()
    with vllm_server(backend, gpus=0, log=log, log_file=log_file, secret=secret) as url:
        healthy = time.monotonic()
        first_reply(url, backend.model, secret)
        replied = time.monotonic()
    stopped = time.monotonic()
    return {
        "healthy_s": healthy - start,
        "first_reply_s": replied - healthy,
        "stop_s": stopped - replied,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama")
        backend = VLLMBackend(kind="vllm", model=str(model), startup_timeout_s=600)
        runs = [one_run(backend, Path(tmp) / f"vllm-{i}.log") for i in range(args.runs)]
    for i, run in enumerate(runs):
        print(f"run {i}: " + "  ".join(f"{k} {v:.1f}" for k, v in run.items()))
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"median of {len(runs)}: " + "  ".join(f"{k} {v:.1f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
