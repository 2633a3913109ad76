"""The policy endpoint (`stages.lib.serve`) against generating in-process: what HTTP and the
batching queue cost.

The ChatML family's test checkpoint (hidden 32, 2 layers, built from config) answers N chat
requests of one user message each, greedy, a fixed number of new tokens:

- in-process: one `generate_with` call over the N prompts (the best case: one batch);
- served, one at a time: N requests in sequence (each its own engine call);
- served, concurrent: N requests at once (the queue groups them: the batches are printed).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/policy_endpoint.py --requests 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    from stages.lib.builders.families import build_family_checkpoint
    from stages.lib.model.generate import generate_with, load
    from stages.lib.serve.batcher import local_engine
    from stages.lib.serve.policy import PolicyServer

    folder = build_family_checkpoint(
        "chatml", tempfile.mkdtemp() + "/ckpt", hidden_size=32, num_layers=2, num_heads=4
    )
    model, tok = load(str(folder))
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(args.requests)]
    n, k = args.requests, args.tokens

    # min_new_tokens is not a setting: a random model may stop early, so tokens are counted
    def generate(batch: list[Any]) -> Any:
        return generate_with(
            model,
            tok,
            batch,
            num_samples=1,
            temperature=0,
            top_p=1,
            max_new_tokens=k,
            seed=0,
            batch_size=64,
            logprobs=True,
        )

    generate(prompts[:2])  # warm-up
    t = time.perf_counter()
    gens = generate(prompts)
    direct = time.perf_counter() - t
    direct_tokens = sum(g[0].completion_tokens for g in gens)

    with PolicyServer(local_engine(model, tok), tok, name="tiny") as server:
        url = server.base_url + "/chat/completions"

        def body(p: list[dict[str, str]]) -> dict[str, Any]:
            return {
                "messages": p,
                "temperature": 0,
                "max_tokens": k,
                "logprobs": True,
                "return_tokens_as_token_ids": True,
            }

        post(url, body(prompts[0]))  # warm-up
        server.batcher.batches.clear()
        t = time.perf_counter()
        seq = [post(url, body(p)) for p in prompts]
        sequential = time.perf_counter() - t
        server.batcher.batches.clear()
        t = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            conc = list(pool.map(lambda p: post(url, body(p)), prompts))
        concurrent = time.perf_counter() - t
        batches = list(server.batcher.batches)
    for name, outs in (("sequential", seq), ("concurrent", conc)):
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        assert tokens == direct_tokens, (name, tokens, direct_tokens)  # greedy: the same answers
    print(f"{n} requests, {direct_tokens} new tokens in all (greedy, at most {k} each)")
    print(f"in-process, one generate_with call: {direct:.2f} s ({n / direct:.1f} answers/s)")
    print(f"served, one at a time:             {sequential:.2f} s ({n / sequential:.1f} answers/s)")
    print(
        f"served, {n} concurrent:             {concurrent:.2f} s ({n / concurrent:.1f} answers/s),"
        f" engine calls of {batches}"
    )


if __name__ == "__main__":
    main()
