"""NeMo Gym's own rollout collection beside pipe's collect, on one NeMo Gym agent, side by side.

    .venv/bin/python bench/gym_collect.py --rows 1000     # ~several minutes on 2 cores

The same rows, agent, stub policy and concurrency for both arms:

- the policy: bench/collect/gym_policy.py in its own process (fixed latency per request,
  a capacity of requests in service), scripted for example_single_tool_call: a structured
  `get_weather` call then a final message, except for a quarter of the rows (a hash of the
  user's message), answered without a call, which `/verify` scores 0.0;
- the rows: example_single_tool_call's five example rows, each user message numbered, so
  `--rows` distinct rows, each with a `row_id`;
- the servers: `ng_run` from `.venv-gym/` with example_single_tool_call's config and NeMo
  Gym's `vllm_model.yaml` model server pointed at the stub, head on 127.0.0.1 (every server
  from the one venv, as stages/lib/env/gym.py starts them);
- arm A, NeMo Gym: `gym eval run --no-serve` (NeMo Gym 0.7.0's collector; `ng_collect_rollouts`
  is its deprecated alias) against the running servers, `--concurrency` the parallelism, its
  aggregation and health check off (they are not collection; off, NeMo Gym's figures only
  improve);
- arm B, pipe: the collect stage's body (`stages.collect.run.run_collect`, in a process of its
  own), `environment: {kind: nemo_gym, head: ...}` against the same running servers, then
  again with `config_paths` (the stage starts, waits for and stops its own servers).

"With start-up" is, for NeMo Gym, `ng_run` until ready + the collector + stopping the
servers; for pipe, the stage's process from start to exit (it starts and stops the servers).
"Without start-up" is the collector's process alone, against servers already running.
CPU: the collector process's own (NeMo Gym's: its rusage; pipe's: the stage process's
RUSAGE_SELF, which leaves out the servers it starts), and the whole tree's (collector,
`ng_run` and every process it starts, found by parent and session in /proc and sampled every
0.2 s; a process's last 0.2 s before it exits can be missed); the stub's CPU is neither's.
Rewards are compared row by row (by `row_id`), and against what the stub's script earns.
Output: a table on stdout, bench/out/gym_collect/gym_collect.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "collect")]

from gym_policy import expected_reward, start_subprocess  # noqa: E402
from proc_tree import TreeCPU  # noqa: E402

from stages.lib.env.gym import agent_url, gym_package, gym_venv, stop_ng_run  # noqa: E402
from stages.lib.net import free_port  # noqa: E402

CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
MODEL = "responses_api_models/vllm_model/configs/vllm_model.yaml"
AGENT = "example_single_tool_call_simple_agent"
SERVERS = (
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "responses_api_models/vllm_model",
    "environment_servers/legacy_agent",
)
READY_S = 300.0


def write_rows(path: Path, n: int) -> list[dict[str, Any]]:
    """`n` rows: the example's rows in turn, each user message numbered."""
    source = gym_package(gym_venv()) / "resources_servers/example_single_tool_call/data"
    examples = [json.loads(x) for x in (source / "example.jsonl").read_text().splitlines()]
    rows = []
    for i in range(n):
        params = json.loads(json.dumps(examples[i % len(examples)]["responses_create_params"]))
        user = params["input"][-1]
        user["content"] = f"{user['content']} (request {i})"
        rows.append({"row_id": i, "responses_create_params": params})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


class GymServers:
    """`ng_run` in a session of its own: started, ready, stopped (SIGINT, then the group)."""

    def __init__(self, work: Path, policy_url: str) -> None:
        self.work, self.head = work, f"127.0.0.1:{free_port()}"
        venv = gym_venv()
        links = work / "venvs"
        for server in SERVERS:  # one venv for every server: uv cannot fetch one offline
            (links / server).mkdir(parents=True, exist_ok=True)
            (links / server / ".venv").symlink_to(venv)
        self.command = [
            str(venv / "bin" / "ng_run"),
            f"+config_paths=[{CONFIG},{MODEL}]",
            f"+policy_base_url={policy_url}",
            "+policy_api_key=none",
            "+policy_model_name=stub",
            "+skip_venv_if_present=true",
            f"+uv_venv_dir={links}",
            "+head_server.host=127.0.0.1",
            f"+head_server.port={self.head.split(':')[1]}",
        ]
        self.log = work / "ng_run.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> int:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.work,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self.process.pid

    def wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ng_run exited: {self.log.read_bytes()[-2000:]!r}")
            if b"servers ready!" in self.log.read_bytes():
                with contextlib.suppress(OSError):
                    if agent_url(self.head, AGENT):
                        return
            time.sleep(0.5)
        raise RuntimeError(f"ng_run not ready after {READY_S:.0f} s (see {self.log})")

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        stop_ng_run(process)
        self.process = None


def run_collector(
    command: list[str], log: Path, tree: TreeCPU, timeout_s: float, extra_roots: tuple[int, ...]
) -> dict[str, Any]:
    """One collector process, in a session of its own: wall, rusage CPU, the tree's CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    with log.open("ab") as out:
        proc = subprocess.Popen(  # in the log's folder: Hydra writes outputs/ where it runs
            command,
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    tree.start((proc.pid, *extra_roots))
    deadline = time.monotonic() + timeout_s
    status = usage = None
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        tree.stop()
        raise RuntimeError(f"{command[:3]} ran past {timeout_s:.0f} s (see {log})")
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    others = tree.stop(leave_out=proc.pid)
    if proc.returncode != 0:
        raise RuntimeError(f"{command[:3]} exited {proc.returncode}: {log.read_bytes()[-3000:]!r}")
    assert usage is not None
    top = {k: round(v, 2) for k, v in list(tree.by_process().items())[:8]}
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall_s": wall, "rusage_cpu_s": cpu, "others_cpu_s": others, "by_process": top}


def gym_collect(rows: Path, out: Path, head: str, parallel: int) -> list[str]:
    port = head.split(":")[1]
    return [
        str(gym_venv() / "bin" / "gym"),
        "eval",
        "run",
        "--no-serve",
        "--agent",
        AGENT,
        "--input",
        str(rows),
        "--output",
        str(out),
        "--concurrency",
        str(parallel),
        "+head_server.host=127.0.0.1",
        f"+head_server.port={port}",
        "+disable_aggregation=true",
        "+disable_health_check=true",
    ]


def pipe_collect(
    work: Path,
    name: str,
    rows: Path,
    policy: str,
    parallel: int,
    env: dict[str, Any],
    profile: bool = False,
) -> list[str]:
    """The collect stage's body in a process of its own (`--stage`, below)."""
    brief = {
        "input": str(rows),
        "output": str(work / f"{name}.jsonl"),
        "backend": {"kind": "openai", "base_url": policy, "model": "stub"},
        "environment": env,
        "num_samples_in_parallel": parallel,
    }
    path = work / f"{name}.brief.json"
    path.write_text(json.dumps({"config": brief, "dir": str(work / name), "profile": profile}))
    return [sys.executable, __file__, "--stage", str(path)]


def stage(brief_path: str) -> None:
    """Run collect's body on a brief; its own CPU (RUSAGE_SELF) beside it in `.cpu.json`, and
    with `profile`, cProfile's top functions in `.profile.txt`."""
    import cProfile
    import io
    import logging
    import pstats

    from engine.stage import StageContext
    from stages.collect import CollectConfig
    from stages.collect.run import run_collect

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    brief = json.loads(Path(brief_path).read_text())
    cfg = CollectConfig.model_validate(brief["config"], strict=False)
    folder = Path(brief["dir"])
    folder.mkdir(parents=True)
    ctx = StageContext("collect", "collect", str(folder), str(folder.parent), str(folder))
    profiler = cProfile.Profile() if brief["profile"] else None
    metrics = profiler.runcall(run_collect, cfg, ctx) if profiler else run_collect(cfg, ctx)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = {"self_cpu_s": usage.ru_utime + usage.ru_stime, "written": metrics.get("written")}
    Path(brief_path).with_suffix(".cpu.json").write_text(json.dumps(cpu))
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        Path(brief_path).with_suffix(".profile.txt").write_text(text.getvalue())


def rewards(path: Path) -> dict[int, float]:
    """Each line's reward by its row's number, read from the user's message ("(request N)"):
    NeMo Gym's output keeps no field of the row but `responses_create_params`."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        user = [m for m in row["responses_create_params"]["input"] if m["role"] == "user"][-1]
        number = int(user["content"].rsplit("(request ", 1)[1].rstrip(")"))
        if number in out:
            raise RuntimeError(f"{path}: row {number} written twice")
        out[number] = float(row["reward"])
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both arms, on one set of rows and one stub (module docstring)."""
    rows_path = work / "rows.jsonl"
    rows = write_rows(rows_path, args.rows)
    expected = {r["row_id"]: expected_reward(r) for r in rows}
    stub = start_subprocess(args.capacity, args.latency_ms)
    gym = GymServers(work / "gym", stub.url)
    tree, logs = TreeCPU(), work / "logs"
    out: dict[str, dict[str, Any]] = {}
    logs.mkdir()
    running = {"kind": "nemo_gym", "head": gym.head, "agent": AGENT}
    started = {"kind": "nemo_gym", "config_paths": [CONFIG], "agent": AGENT}
    n, timeout = args.rows, args.timeout_s
    try:
        begin = time.perf_counter()
        gym_pid = gym.start()
        tree.start((gym_pid,))
        gym.wait_ready()
        out["gym_start"] = {"wall_s": time.perf_counter() - begin, "others_cpu_s": tree.stop()}
        print(f"NeMo Gym's servers ready in {out['gym_start']['wall_s']:.1f} s", flush=True)
        # pipe first against the fresh servers: whatever warming up costs, pipe pays it
        cmd = pipe_collect(work, "pipe_running", rows_path, stub.url, args.parallel, running)
        out["pipe_running"] = run_collector(
            cmd, logs / "pipe_running.log", tree, timeout, (gym_pid,)
        )
        print(f"pipe (servers running): {out['pipe_running']['wall_s']:.1f} s", flush=True)
        cmd = gym_collect(rows_path, work / "gym_rollouts.jsonl", gym.head, args.parallel)
        out["gym_running"] = run_collector(cmd, logs / "gym_running.log", tree, timeout, (gym_pid,))
        print(f"NeMo Gym (servers running): {out['gym_running']['wall_s']:.1f} s", flush=True)
        if args.profile:  # once more under cProfile, not in the table
            cmd = pipe_collect(
                work, "pipe_profiled", rows_path, stub.url, args.parallel, running, profile=True
            )
            log = logs / "pipe_profiled.log"
            out["pipe_profiled"] = run_collector(cmd, log, tree, timeout, (gym_pid,))
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(work / "pipe_profiled.brief.profile.txt", args.out / "pipe_profile.txt")
        begin = time.perf_counter()
        tree.start((gym_pid,))
        gym.stop()
        out["gym_stop"] = {"wall_s": time.perf_counter() - begin, "others_cpu_s": tree.stop()}
        cmd = pipe_collect(work, "pipe_started", rows_path, stub.url, args.parallel, started)
        out["pipe_started"] = run_collector(cmd, logs / "pipe_started.log", tree, timeout, ())
        print(f"pipe (servers started): {out['pipe_started']['wall_s']:.1f} s", flush=True)
        ready = re.search(
            rb"servers ready in ([0-9.]+) s", (logs / "pipe_started.log").read_bytes()
        )
        out["pipe_started"]["servers_ready_s"] = float(ready.group(1)) if ready else None
    finally:
        gym.stop()
        stub.stop()
    for name in ("pipe_running", "pipe_started"):
        cpu = json.loads((work / f"{name}.brief.cpu.json").read_text())
        out[name]["self_cpu_s"] = cpu["self_cpu_s"]
    out["gym_running"]["self_cpu_s"] = out["gym_running"]["rusage_cpu_s"]
    found = {
        "nemo_gym": rewards(work / "gym_rollouts.jsonl"),
        "pipe_running": rewards(work / "pipe_running.jsonl"),
        "pipe_started": rewards(work / "pipe_started.jsonl"),
    }
    return {"runs": out, "rewards": compare(found, expected, n)}


def compare(
    found: dict[str, dict[int, float]], expected: dict[int, float], n: int
) -> dict[str, Any]:
    gym = found["nemo_gym"]
    out: dict[str, Any] = {name: len(r) for name, r in found.items()}
    for name in ("pipe_running", "pipe_started"):
        ours = found[name]
        out[f"{name}_equal"] = sum(1 for i in range(n) if i in gym and gym.get(i) == ours.get(i))
        out[f"{name}_different"] = n - out[f"{name}_equal"]
    out["nemo_gym_as_scripted"] = sum(1 for i in range(n) if gym.get(i) == expected[i])
    out["mean_reward"] = sum(gym.values()) / max(len(gym), 1)
    return out


def table(result: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The four lines: each arm without and with start-up, per rollout."""
    r = result["runs"]
    ends = r["gym_start"], r["gym_stop"]
    gym_full = {
        "wall_s": r["gym_running"]["wall_s"] + sum(x["wall_s"] for x in ends),
        "self_cpu_s": r["gym_running"]["self_cpu_s"],
        "tree_cpu_s": r["gym_running"]["self_cpu_s"]
        + r["gym_running"]["others_cpu_s"]
        + sum(x["others_cpu_s"] for x in ends),
    }
    lines = []
    for arm, startup, x in (
        ("NeMo Gym", "no", r["gym_running"]),
        ("pipe", "no", r["pipe_running"]),
        ("NeMo Gym", "yes", gym_full),
        ("pipe", "yes", r["pipe_started"]),
    ):
        tree = x.get("tree_cpu_s", x["self_cpu_s"] + x.get("others_cpu_s", 0.0))
        lines.append(
            {
                "arm": arm,
                "start_up": startup,
                "wall_s": round(x["wall_s"], 1),
                "rollouts_per_s": round(n / x["wall_s"], 1),
                "collector_cpu_ms": round(1000 * x["self_cpu_s"] / n, 2),
                "tree_cpu_ms": round(1000 * tree / n, 2),
            }
        )
    return lines


def ratios(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for startup in ("no", "yes"):
        gym, ours = (
            next(x for x in lines if x["arm"] == a and x["start_up"] == startup)
            for a in ("NeMo Gym", "pipe")
        )
        out.append(
            {
                "start_up": startup,
                "rollouts_per_s": round(ours["rollouts_per_s"] / gym["rollouts_per_s"], 2),
                "collector_cpu": round(ours["collector_cpu_ms"] / gym["collector_cpu_ms"], 2),
                "tree_cpu": round(ours["tree_cpu_ms"] / gym["tree_cpu_ms"], 2),
            }
        )
    return out


def plot(lines: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{x['arm']}\n{'with' if x['start_up'] == 'yes' else 'no'} start-up" for x in lines]
    colors = ["#76b900" if x["arm"] == "NeMo Gym" else "#1f77b4" for x in lines]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(labels, [x["rollouts_per_s"] for x in lines], color=colors)
    a.set_ylabel("rollouts/s")
    width, pos = 0.4, range(len(lines))
    b.bar(
        [p - width / 2 for p in pos],
        [x["collector_cpu_ms"] for x in lines],
        width,
        color=colors,
        label="collector process (dark)",
    )
    b.bar(
        [p + width / 2 for p in pos],
        [x["tree_cpu_ms"] for x in lines],
        width,
        color=colors,
        alpha=0.45,
        label="whole tree, NeMo Gym's servers in it (light)",
    )
    b.set_xticks(list(pos), labels)
    b.set_ylabel("CPU ms per rollout")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=64, help="rollouts in flight, both arms")
    parser.add_argument("--capacity", type=int, default=64, help="the stub's requests in service")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the stub's per request")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per collector run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gym_collect")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--profile", action="store_true", help="pipe's arm once more under cProfile (not timed)"
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # the child: collect's body
    args = parser.parse_args()
    if args.stage:
        stage(args.stage)
        return
    work = Path(tempfile.mkdtemp(prefix="gym_collect-"))
    try:
        result = measure(args, work)
    finally:
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    lines = table(result, args.rows)
    keys = ("rows", "parallel", "capacity", "latency_ms")
    result.update(
        settings={k: v for k, v in vars(args).items() if k in keys},
        table=lines,
        ratio_pipe_over_nemo_gym=ratios(lines),
        commit=subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gym_collect.json").write_text(json.dumps(result, indent=2) + "\n")
    title = (
        f"example_single_tool_call, {args.rows} rows, {args.parallel} in flight, stub "
        f"{args.latency_ms:.0f} ms x {args.capacity}"
    )
    plot(lines, args.out / "gym_collect.png", title)
    print(f"\n{title}\n")
    print(
        "| arm | start-up | wall s | rollouts/s | collector CPU ms/rollout | tree CPU ms/rollout |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for x in lines:
        print(
            f"| {x['arm']} | {x['start_up']} | {x['wall_s']} | {x['rollouts_per_s']} | "
            f"{x['collector_cpu_ms']} | {x['tree_cpu_ms']} |"
        )
    for x in result["ratio_pipe_over_nemo_gym"]:
        print(
            f"pipe / NeMo Gym, start-up {x['start_up']}: rollouts/s {x['rollouts_per_s']}x, "
            f"collector CPU {x['collector_cpu']}x, tree CPU {x['tree_cpu']}x"
        )
    print(f"rewards: {json.dumps(result['rewards'])}")
    print(f"wrote {args.out / 'gym_collect.json'} and gym_collect.png")


if __name__ == "__main__":
    main()
