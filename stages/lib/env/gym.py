"""NeMo Gym's servers for a stage: started from NeMo Gym's own venv, or found running.

Input: the stage's `EnvironmentConfig` (kind `nemo_gym`: `config_paths` and `agent`, or
`head`; `config`, NeMo Gym config overrides) and the `Endpoint` of the stage's backend (the
policy). Output: `nemo_gym(...)`, a block that yields the agent's URL, its servers ready.

Started (`config_paths`): `ng_run` from `.venv-gym/bin` (`make install-gym`; another venv with
`PIPE_GYM_VENV`), with the environment's configs and NeMo Gym's `vllm_model` model server
config, which pipe adds, pointed at the endpoint (`policy_base_url`, `policy_api_key`,
`policy_model_name`): `vllm_model_for_training.yaml` when the endpoint is one pipe serves
(it answers `/tokenize` and returns token ids, which rl trains on), `vllm_model.yaml`
otherwise. Every server runs from the one venv (`+skip_venv_if_present=true
+uv_venv_dir=...`, each server folder's `.venv` a link to it: `ng_run` would build one per
server with uv, which cannot fetch an interpreter offline). The head server listens on
127.0.0.1 (it serves the policy's key in plain text). Ready when `ng_run` logs "servers
ready!" and the head lists the agent (at most `READY_S`); its output goes to
`<work_dir>/nemo_gym.log`. On leaving the block, also on failure and Ctrl-C, `ng_run` gets
SIGINT (it stops its servers and its Ray cluster), then its process group, which pipe made
for it, SIGKILL if anything is left after `STOP_S`; should the process that started it die
first (a Dask worker ended with its cluster), ng_run gets SIGINT from the kernel
(PDEATHSIG). Each start reads only its own output in the log, which every start in the
stage's folder appends to (evaluate starts the servers once per checkpoint).

Running (`head`): the head's `/server_instances` gives the agent's URL, and its
`/global_config_dict_yaml` the policy its model server calls, which must be the stage's
backend: a stage whose sampling and model would act on nothing is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.lib.backends.endpoint import Endpoint
    from stages.lib.env.field import EnvironmentConfig

READY_S, STOP_S = 300.0, 60.0
ROOT = Path(__file__).resolve().parents[3]
SERVER_TYPES = (
    "resources_servers",
    "responses_api_agents",
    "responses_api_models",
    "environment_servers",
)
MODEL_CONFIGS = "responses_api_models/vllm_model/configs"


def gym_venv() -> Path:
    """NeMo Gym's venv: `PIPE_GYM_VENV`, else `.venv-gym/` at the repository's root."""
    return Path(os.environ.get("PIPE_GYM_VENV") or ROOT / ".venv-gym")


def gym_package(venv: Path) -> Path:
    """The folder NeMo Gym's configs are named relative to (its site-packages)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not (venv / "bin" / "ng_run").exists() or not found:
        raise ValueError(
            f"environment kind nemo_gym: NeMo Gym is not installed in {venv} (run `make "
            "install-gym`, or set PIPE_GYM_VENV to a venv that has it)"
        )
    return found[0]


def overrides(config: dict[str, Any], prefix: str = "") -> list[str]:
    """The `config` block as NeMo Gym's command-line overrides, nested keys dotted."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"++{prefix}{key}={json.dumps(value)}")
    return out


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def agent_url(head: str, agent: str) -> str | None:
    """The URL of the server `agent` names, as the head lists them: its instance name (the
    configs' top-level key, `example_single_tool_call_simple_agent`), else its server's
    (`simple_agent`) when one server alone has it; None when none does."""
    servers = [s for s in json.loads(_get(f"http://{head}/server_instances")) if s.get("url")]
    named = [s for s in servers if agent in (s.get("process_name"), s.get("config_path"))]
    named = named or [s for s in servers if s.get("name") == agent]
    return str(named[0]["url"]).rstrip("/") if len(named) == 1 else None


def _policy_of(head: str) -> str | None:
    """The policy base URL the running servers' configs name."""
    from ruamel.yaml import YAML

    text = _get(f"http://{head}/global_config_dict_yaml").decode()
    config = YAML(typ="safe").load(json.loads(text) if text.startswith('"') else text) or {}
    value = config.get("policy_base_url")
    return str(value).rstrip("/") if value else None


@contextlib.contextmanager
def nemo_gym(
    env: EnvironmentConfig, endpoint: Endpoint, work_dir: str, log: logging.Logger
) -> Iterator[str]:
    """NeMo Gym's servers for the block, started or found (module docstring); yields the
    agent's URL."""
    assert env.agent is not None  # the plan's checks
    if env.head is not None:
        policy = _policy_of(env.head)
        if policy != endpoint.base_url.rstrip("/"):
            raise ValueError(
                f"environment.head: the NeMo Gym servers at {env.head} call the policy at "
                f"{policy}, not the stage's backend ({endpoint.base_url}): point their "
                "policy_base_url at it, or let pipe start them (config_paths)"
            )
        url = agent_url(env.head, env.agent)
        if url is None:
            raise ValueError(
                f"environment.agent: the NeMo Gym head at {env.head} lists no "
                f"server named '{env.agent}'"
            )
        yield url
        return
    with _started(env, endpoint, Path(work_dir), log) as url:
        yield url


def _command(
    env: EnvironmentConfig, endpoint: Endpoint, venv: Path, links: Path, head: int
) -> list[str]:
    package = gym_package(venv)
    served = "vllm_model_for_training.yaml" if endpoint.tokenizes else "vllm_model.yaml"
    paths = [str(p) for p in env.config_paths or []]
    for path in paths:
        if not (Path(path) if os.path.isabs(path) else package / path).exists():
            raise ValueError(f"environment.config_paths: no NeMo Gym config {path} (in {package})")
    paths.append(f"{MODEL_CONFIGS}/{served}")
    return [
        str(venv / "bin" / "ng_run"),
        f"+config_paths=[{','.join(paths)}]",
        f"+policy_base_url={endpoint.base_url}",
        f"+policy_api_key={endpoint.api_key or 'none'}",
        f"+policy_model_name={endpoint.model}",
        "+skip_venv_if_present=true",
        f"+uv_venv_dir={links}",
        "+head_server.host=127.0.0.1",
        f"+head_server.port={head}",
        *overrides(env.config),
    ]


def _link_venvs(venv: Path, links: Path) -> None:
    """`links/<type>/<server>/.venv` -> the venv, for every server NeMo Gym ships."""
    package = gym_package(venv)
    for kind in SERVER_TYPES:
        for server in sorted((package / kind).glob("*/")):
            target = links / kind / server.name / ".venv"
            if not target.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(venv)


@contextlib.contextmanager
def _started(
    env: EnvironmentConfig, endpoint: Endpoint, work_dir: Path, log: logging.Logger
) -> Iterator[str]:
    from stages.lib.net import free_port

    venv = gym_venv()
    links = work_dir / "nemo_gym_venvs"
    head = free_port()
    command = _command(env, endpoint, venv, links, head)
    _link_venvs(venv, links)
    log_path = work_dir / "nemo_gym.log"
    log.info("nemo_gym: starting %s (output: %s)", " ".join(command[:2]), log_path)
    begin = log_path.stat().st_size if log_path.exists() else 0  # earlier starts' output
    start = time.monotonic()
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            command,
            cwd=work_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_signals,
        )
    try:
        url = _wait_ready(process, f"127.0.0.1:{head}", env.agent or "", log_path, begin)
        log.info(
            "nemo_gym: servers ready in %.1f s; agent %s at %s",
            time.monotonic() - start,
            env.agent,
            url,
        )
        yield url
    finally:
        stop_ng_run(process, log)


def _child_signals() -> None:
    """In ng_run's process, before it runs: SIGINT as Python's default (a process started in
    the background of a shell inherits it ignored, and Python then installs no handler, so
    `stop_ng_run`'s SIGINT would wait out STOP_S for the SIGKILL), and SIGINT again when the
    process that started it dies (a Dask worker killed with its cluster, on SIGTERM to `pipe
    run` too): ng_run stops its servers and its Ray cluster on it (Linux's PDEATHSIG)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


def _wait_ready(
    process: subprocess.Popen[bytes], head: str, agent: str, log_path: Path, begin: int = 0
) -> str:
    """The agent's URL once this start's output (the log past `begin`: every start in the
    stage's folder appends to it) says the servers are ready."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"nemo_gym: ng_run exited with {process.returncode} before its servers were "
                f"ready; the end of {log_path}:\n{_tail(log_path)}"
            )
        if b"servers ready!" in log_path.read_bytes()[begin:]:
            url = agent_url(head, agent)
            if url is None:
                raise ValueError(
                    f"environment.agent: NeMo Gym's servers started with no server named "
                    f"'{agent}' (see {log_path})"
                )
            return url
        time.sleep(1.0)
    raise RuntimeError(
        f"nemo_gym: servers not ready after {READY_S:.0f} s; the end of {log_path}:\n"
        f"{_tail(log_path)}"
    )


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_bytes()[-chars:].decode(errors="replace")


def stop_ng_run(process: subprocess.Popen[bytes], log: logging.Logger | None = None) -> None:
    """SIGINT to ng_run, then SIGKILL to its process group (the one its starter made with
    `start_new_session`) if anything outlives STOP_S."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)
    if log is not None:
        log.info("nemo_gym: servers stopped")
