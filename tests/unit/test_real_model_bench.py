"""bench/real_model.py's vllm part: the reason it gives when vLLM's CPU build fails to serve a
model (the key line of the server's log), and the CPU clock it reads the server's side by."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import real_model  # noqa: E402  (the benchmark script)

# the shape of a vLLM 0.32 log whose engine fails to start: the root cause in the engine
# core's traceback, the API server's wrapper after it, an error quoted in a warning before
FAILED_LOG = """\
(APIServer pid=11) WARNING 11-26 16:30:11 [system_utils.py:255] Found ulimit of 20000 and \
failed to automatically increase it. This can cause fd limit errors like `OSError: [Errno 24] \
Too many open files`.
(EngineCore pid=12) ERROR 11-26 16:30:54 [core.py:1010] EngineCore failed to start.
(EngineCore pid=12) ERROR 11-26 16:30:54 [core.py:1010] Traceback (most recent call last):
(EngineCore pid=12) ERROR 11-26 16:30:54 [core.py:1010]   File "/x/vllm/v1/engine/core.py", \
line 1000, in run_engine_core
(EngineCore pid=12) ERROR 11-26 16:30:54 [core.py:1010] NotImplementedError: sliding window \
attention is not supported on CPU
(APIServer pid=11) Traceback (most recent call last):
(APIServer pid=11) RuntimeError: Engine core initialization failed. See root cause above. \
Failed core proc(s): {}
"""


def test_key_error_is_the_root_cause_not_the_wrapper_nor_a_warning() -> None:
    reason = real_model.key_error(FAILED_LOG)
    assert reason == "NotImplementedError: sliding window attention is not supported on CPU"


def test_key_error_falls_back_to_the_wrapper_then_to_none() -> None:
    wrapper = FAILED_LOG.splitlines()[-2:]
    assert real_model.key_error("\n".join(wrapper)).startswith("RuntimeError: Engine core")
    assert real_model.key_error("INFO: 127.0.0.1 - POST /v1/chat/completions 200 OK\n") is None


def test_server_cpu_s_counts_a_child_session_busy_for_a_while() -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    before = real_model.server_cpu_s()
    child = subprocess.Popen(
        [sys.executable, "-c", busy + "time.sleep(30)"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        while real_model.server_cpu_s() - before < 0.25 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert real_model.server_cpu_s() - before >= 0.25
    finally:
        child.kill()
        child.wait()
