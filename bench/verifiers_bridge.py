"""verifiers' bridge (`stages.lib.env.served`): how long the stage waits for it, and how many
episodes per second go through it.

The tests' single-turn taskset (`tests/verifiers_envs/vf_arith.py`, a verifiers 0.4.0
`Taskset` with one `@vf.reward`) served from `.venv-verifiers` (`make install-verifiers`);
N one-turn episodes (reset, the scripted right answer, the task's scoring) played at once
through `HTTPEnvironment`, as a stage plays them:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/verifiers_bridge.py --episodes 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from stages.lib.env.contract import Episode, environments, open_episode, take_turn
from stages.lib.env.field import EnvironmentConfig

ENVS = Path(__file__).resolve().parents[1] / "tests" / "verifiers_envs"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--episodes", type=int, default=100)
    n = args.parse_args().episodes
    os.environ["PYTHONPATH"] = str(ENVS)
    cfg = EnvironmentConfig(kind="verifiers", env_id="vf_arith", max_turns=1)
    began = time.perf_counter()
    with environments(cfg, None) as make_env:
        ready = time.perf_counter() - began

        async def one(i: int) -> Episode:
            row = {"prompt": f"{i} + {i} = ?", "answer": str(2 * i)}
            episode = await open_episode(make_env(), row, 30)
            await take_turn(episode, str(2 * i), 1, 30)
            return episode

        async def every() -> list[Episode]:
            return await asyncio.gather(*(one(i) for i in range(n)))

        began = time.perf_counter()
        episodes = asyncio.run(every())
        took = time.perf_counter() - began
    solved = sum(e.solved for e in episodes)
    print(
        f"bridge ready in {ready:.1f} s; {n} episodes in {took:.2f} s ({n / took:.0f}/s), "
        f"{solved} solved"
    )


if __name__ == "__main__":
    main()
