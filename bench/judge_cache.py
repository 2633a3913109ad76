"""Benchmark: the LLM judge's concurrency and its cache, against a stub judge server.

    .venv/bin/python bench/judge_cache.py [--answers 400] [--distinct 200] [--delay-ms 50]
        [--concurrency 16]

A stub OpenAI-compatible judge on 127.0.0.1 (a ThreadingHTTPServer) sleeps `--delay-ms` per
request, standing in for a judge model's latency, and answers "Score: N". The bench grades
`--answers` answers of which `--distinct` differ (each repeated), three times, each with a new
`Judge` over one run folder, as stages and re-runs (`--force` too) do:

1. a cold run folder, `concurrency: 1`: one request at a time;
2. a cold run folder, `concurrency: --concurrency`;
3. the second run folder again (a re-run): every answer from `<run-dir>/.pipe-judge.jsonl`.

Prints one JSON line per pass: seconds, requests the server saw, the judge's counts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stages.lib.config import Verifier
from stages.lib.judge.grader import Judge


def serve(delay_s: float) -> tuple[ThreadingHTTPServer, list[int]]:
    seen = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen[0] += 1
            time.sleep(delay_s)
            n = sum(map(ord, body["messages"][-1]["content"])) % 11
            data = json.dumps({"choices": [{"message": {"content": f"Score: {n}"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def one_pass(url: str, run_dir: str, concurrency: int, pairs: list[Any]) -> dict[str, Any]:
    cfg = Verifier.model_validate(
        {
            "kind": "judge",
            "backend": {"kind": "openai", "base_url": url, "model": "stub-judge"},
            "template": "Question: {question}\nAnswer: {answer}\nScore 0-10.",
            "score_regex": r"Score: (\d+)",
            "score_range": [0.0, 10.0],
            "concurrency": concurrency,
        }
    )
    judge = Judge(cfg, run_dir)
    start = time.perf_counter()
    scores = judge.score_many(pairs)
    seconds = time.perf_counter() - start
    judge.close()
    assert not any(isinstance(s, Exception) for s in scores)
    return {"concurrency": concurrency, "seconds": round(seconds, 3), **judge.counts()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--distinct", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    server, seen = serve(args.delay_ms / 1000)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    row = {"prompt": "What is 17 + 25?", "answer": "42"}
    pairs = [(row, f"answer {i % args.distinct}") for i in range(args.answers)]
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        for name, run_dir, concurrency in (
            ("cold, one at a time", one, 1),
            ("cold", two, args.concurrency),
            ("re-run", two, args.concurrency),
        ):
            before = seen[0]
            result = one_pass(url, run_dir, concurrency, pairs)
            print(json.dumps({"pass": name, **result, "server_requests": seen[0] - before}))
    server.shutdown()


if __name__ == "__main__":
    main()
