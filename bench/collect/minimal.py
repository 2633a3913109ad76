"""The baseline: a minimal rollout collector (asyncio + aiohttp + a Semaphore).

    python bench/collect/minimal.py IN.jsonl OUT.jsonl BASE_URL PARALLEL [REPEATS]

What a careful engineer writes in 40 lines: one task per (row, repeat) under
a Semaphore, one session, results appended as JSONL. No retries, no resume,
no verification. Prints {"rollouts", "wall_s", "cpu_s"} for the collection.
"""

import asyncio
import json
import resource
import sys
import time

import aiohttp


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main(src: str, dst: str, base_url: str, parallel: int, repeats: int) -> int:
    with open(src) as handle:
        rows = [json.loads(line) for line in handle]
    sem = asyncio.Semaphore(parallel)
    url = f"{base_url}/chat/completions"
    with open(dst, "w") as out:
        connector = aiohttp.TCPConnector(limit=parallel)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(i: int, k: int, row: dict) -> None:
                body = {"model": "fake", "messages": [{"role": "user", "content": row["prompt"]}]}
                body.update(max_tokens=256, temperature=1.0, seed=i * repeats + k)
                async with sem:
                    start = time.perf_counter()
                    async with session.post(url, json=body) as resp:
                        data = await resp.json()
                choice = data["choices"][0]
                record = dict(
                    row, prompt_idx=i, sample_idx=k, completion=choice["message"]["content"]
                )
                record.update(usage=data["usage"], latency_s=time.perf_counter() - start)
                out.write(json.dumps(record) + "\n")

            jobs = [one(i, k, row) for i, row in enumerate(rows) for k in range(repeats)]
            await asyncio.gather(*jobs)
    return len(rows) * repeats


if __name__ == "__main__":
    t0, c0 = time.perf_counter(), cpu_s()
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    n = asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), repeats))
    result = {"rollouts": n, "wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0}
    print(json.dumps(result))
