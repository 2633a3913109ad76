"""The python sandbox: model-written code that tries to escape fails cleanly, and the test
process goes on. Each escape runs under both isolations: `auto` (the kernel's namespaces
where this machine allows them, else the fallback) and `hook` (the fallback, forced), so
the fallback guard is proven on every machine, not only where namespaces are refused."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from stages.lib.env.sandbox import Limits, Result, run_python

MODES = ("auto", "hook")


def run(code: str, mode: str, **limits: Any) -> Result:
    return run_python(code, Limits(isolation=mode, **limits))


def no_stray(folder: str) -> list[int]:
    """Processes still running from a sandbox (their command line names its folder)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in proc.info["cmdline"] or ()):
            left.append(proc.pid)
    return left


@pytest.mark.parametrize("mode", MODES)
def test_code_runs_prints_and_writes_in_its_own_folder(mode):
    result = run("open('out.txt', 'w').write('x')\nprint(sum(range(10)))", mode)
    assert (result.stdout, result.exit_code, result.error) == ("45\n", 0, None)
    assert not Path(result.folder).exists()
    assert ("audit-hook" in result.guards) == (result.fallback is not None)


def test_output_over_the_cap_is_cut_and_the_run_stopped():
    result = run("print('x' * 100_000)\nprint('after')", "auto", output_bytes=1000)
    assert result.error == "output"
    assert result.stdout == "x" * 1000


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_stopped_and_leaves_no_process(mode):
    result = run("import os\nwhile True: os.fork()", mode, processes=8, wall_s=5)
    assert result.error in ("processes", "timeout")
    assert result.seconds < 5
    assert no_stray(result.folder) == []


def test_an_endless_loop_stops_at_the_cpu_limit():
    result = run("while True: pass", "auto", cpu_s=1, wall_s=4)
    assert result.error == "cpu"
    assert result.exit_code < 0


def test_a_sleeping_loop_stops_at_the_wall_clock():
    result = run("import time\nwhile True: time.sleep(0.05)", "auto", wall_s=0.8)
    assert result.error == "timeout"
    assert no_stray(result.folder) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_10_gb_allocation_fails_with_memory_error(mode):
    result = run("b = bytearray(10 * 1024**3)\nprint('allocated')", mode, memory_mb=512)
    assert result.error == "memory"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


@pytest.mark.parametrize("mode", MODES)
def test_a_write_outside_the_folder_is_refused(mode):
    target = Path("/tmp") / f"pipe-escape-{uuid.uuid4().hex}"
    code = f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')"
    for attempt in (f"open({str(target)!r}, 'w').write('x')", code):
        result = run(attempt, mode)
        assert result.exit_code != 0, result
        assert not target.exists()


@pytest.mark.parametrize("mode", MODES)
def test_a_socket_to_127_0_0_1_does_not_connect(mode):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        result = run(code, mode)
        assert result.exit_code != 0
        assert "Error" in result.stderr
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize("mode", MODES)
def test_the_secrets_of_the_parent_environment_are_unreadable(mode, monkeypatch):
    secret = f"pipe-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("PIPE_TEST_SECRET", secret)
    code = f"""import os
print(os.environ.get("PIPE_TEST_SECRET"))
for pid in ({os.getpid()}, os.getppid(), 1):
    try:
        print(open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as exc:
        print("refused", type(exc).__name__)
"""
    result = run(code, mode)
    assert result.exit_code == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert result.stdout.startswith("None\n")
    assert "refused" in result.stdout


def test_the_python_environment_runs_a_block_then_scores_the_final_answer():
    from stages.lib.env.builtin import python

    env = python(lambda row, completion: float(completion.strip() == row["answer"]))
    messages = env.reset({"prompt": "what is 123 * 457?", "answer": "56211"})
    reward, observation, done = env.step(messages, "```python\nprint(123 * 457)\n```")
    assert (reward, observation, done) == (0.0, [{"role": "user", "content": "56211\n"}], False)
    assert env.step(messages, "56211") == (1.0, None, True)


def test_the_python_tool_answers_with_stdout_or_the_error():
    from stages.lib.env.tools import TOOLS, call_python_tool

    assert TOOLS["python"].schema["function"]["name"] == "python"
    assert call_python_tool({"code": "print(2 ** 10)"}) == "1024\n"
    assert call_python_tool({"code": "1 / 0"}).endswith("ZeroDivisionError: division by zero")
    assert call_python_tool({"cmd": "ls"}) == "error: the python tool takes {'code': '<program>'}"
