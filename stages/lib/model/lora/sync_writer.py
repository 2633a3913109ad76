"""The adapters a weight sync sends to a vLLM server: peft's files in a folder it loads.

Input: the actor's model with adapters and the folder the server reads. Output: the
adapters, in their training dtype, as peft's files there (`write_sync_adapter`,
`stages.lib.model.lora.files`), with the figures a weight sync reports.
"""

from __future__ import annotations

import os
import time
from typing import Any

from stages.lib.model.lora.files import adapter_state, write_adapter_files


def write_sync_adapter(module: Any, folder: str) -> dict[str, float]:
    """The adapters as peft files in `folder` (in their training dtype; atomically: written
    beside it, then renamed), for a vLLM server to load; `gather_s`, `send_s` (the write) and
    `bytes` as a weight sync reports them."""
    start = time.perf_counter()
    state = {k: v.contiguous() for k, v in adapter_state(module).items()}
    gathered = time.perf_counter()
    write_adapter_files(module, state, folder)
    size = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
    return {"gather_s": gathered - start, "send_s": time.perf_counter() - gathered, "bytes": size}
